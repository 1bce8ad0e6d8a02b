"""Data that reads the live model (docs/data.md, 'Data that reads the model')."""

from __future__ import annotations

import time

import numpy as np
import pytest

import jaxlight as jl
from tests.models import Linear


class ScaledByTheModel:
    """Each batch scaled by the model's current kernel sum: it reads module.model."""

    def __init__(self, module):
        self.module = module
        self.seen = []

    def __len__(self):
        return 6

    def __iter__(self):
        for _ in range(6):
            kernel = self.module.model.kernel
            # Read ahead in a thread, the loop dispatches the next step (which donates this
            # state) meanwhile: the sleep makes that certain instead of likely.
            time.sleep(0.2)
            total = float(np.asarray(kernel[...]).sum())
            self.seen.append(total)
            yield {"x": np.full((8, 4), total, np.float32)}


class DeclaredLive(ScaledByTheModel):
    reads_live_model = True


def _fit():
    return jl.Fit("single", max_steps=6, enable_progress_bar=False, logger=False,
                  enable_model_summary=False, enable_checkpointing=False)


def test_undeclared_live_model_reads_name_the_flag():
    """Read ahead in a thread (the default for a loader not in memory), the data reads arrays
    the next step has donated: JAX's bare "Array has been deleted" became an error that names
    `reads_live_model = True`."""
    module = Linear()
    with pytest.raises(jl.DataError, match=r"reads_live_model = True") as info:
        _fit().fit(module, ScaledByTheModel(module))
    assert "has been deleted" in str(info.value) and "prefetch_batches" in str(info.value)


def test_declared_live_model_data_sees_each_step_result():
    module = Linear()
    data = DeclaredLive(module)
    fit = _fit()
    fit.fit(module, data)
    assert fit.global_step == 6 and len(data.seen) == 6
    # Every batch read after the step before it: the kernel sums all differ.
    assert len(set(data.seen)) == 6
