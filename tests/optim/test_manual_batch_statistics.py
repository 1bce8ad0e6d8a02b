"""Manual optimization under FSDP sees the global batch, where FSDP's automatic step sees one
device's share: with BatchNorm in the model the two normalize differently, and jaxlight says
so (it did not)."""

from __future__ import annotations

import warnings

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl

SEEN = {}


class Net(nnx.Module):
    def __init__(self, norm, rngs):
        self.dense = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs) if norm else None

    def __call__(self, x):
        x = self.dense(x)
        return self.norm(x) if self.norm is not None else x


class Manual(jl.TrainModule):
    automatic_optimization = False

    def __init__(self, norm=True):
        super().__init__()
        self.norm = norm

    def configure_model(self, rngs):
        return Net(self.norm, rngs)

    def configure_optimizers(self):
        return [{"name": "all", "params": ".*", "optimizer": optax.sgd(0.1)}]

    def training_step(self, model, batch, opt):
        SEEN["manual"] = batch["x"].shape[0]
        return opt.step("all", lambda m: (m(batch["x"]) ** 2).mean())


class Automatic(Manual):
    automatic_optimization = True

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def training_step(self, model, batch):
        SEEN["automatic"] = batch["x"].shape[0]
        return (model(batch["x"]) ** 2).mean()


def _fit(strategy, module):
    data = jl.data.ArrayLoader({"x": np.ones((64, 8), np.float32)}, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jl.Fit(strategy, max_steps=1, enable_progress_bar=False, logger=False,
               enable_model_summary=False, enable_checkpointing=False).fit(module, data)
    return [w for w in caught if issubclass(w.category, jl.JaxlightWarning)
            and "manual optimization" in str(w.message)]


def test_manual_batchnorm_under_fsdp_warns_at_training_step():
    warned = _fit("fsdp", Manual())
    _fit("fsdp", Automatic())
    # What the warning is about: 32 rows in the manual step, 32 / 8 devices in the automatic.
    assert SEEN == {"manual": 32, "automatic": 4}
    assert len(warned) == 1
    text = str(warned[0].message)
    assert "under fsdp" in text and "BatchNorm" in text and "strategies.DDP()" in text
    assert warned[0].filename == __file__
    assert warned[0].lineno == Manual.training_step.__code__.co_firstlineno


@pytest.mark.parametrize(("strategy", "norm"), [("dp", True), ("fsdp", False)])
def test_no_warning_where_both_modes_agree(strategy, norm):
    assert not _fit(strategy, Manual(norm))
