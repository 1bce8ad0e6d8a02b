"""The message for a last partial batch the strategy cannot split."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlight as jl
from tests.models import Linear


def test_the_partial_batch_message_names_its_numbers_and_the_fixes():
    """90 examples in batches of 8 leave 2, which 8 data-parallel devices cannot split. The
    message said "Use a batch size that is a multiple of 8 (for example 8)", when it already
    was 8; it now names the partial batch's size and the ways out."""
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(90, 4)).astype(np.float32),
            "y": rng.normal(size=(90, 2)).astype(np.float32)}
    fit = jl.Fit("dp", max_epochs=1, enable_progress_bar=False, logger=False,
                 enable_model_summary=False)
    with pytest.raises(jl.DataError) as info:
        fit.fit(Linear(d_out=2), jl.data.DataLoader(data, batch_size=8))
    text = str(info.value)
    assert "training batch 11 of epoch 0 is a partial batch of 2 examples (full batches have 8)" \
        in text
    assert "2 is not a multiple of 8" in text and "data-parallel degree 8" in text
    for fix in ("drop_last=True", "Fit(devices=1)", "pad the data with 6 more examples",
                "last batch has 8"):
        assert fix in text, fix
    assert "(for example 8)" not in text
