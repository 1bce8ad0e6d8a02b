"""WeightAveraging / EMAWeightAveraging: in the compiled step, sharded like the parameters,
resumed bit for bit (tests/conformance/test_callbacks2.py compares them with Lightning)."""

from __future__ import annotations

import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.callbacks._weight_averaging import AveragingState
from jaxlight.schedules._scheduler import states_of
from tests.models import saves_checkpoints


class Lin(jl.TrainModule):
    def configure_model(self, rngs):
        return nnx.Linear(8, 16, rngs=rngs)

    def configure_optimizers(self):
        return optax.adam(0.05)

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _data():
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(64, 8)).astype(np.float32),
            "y": rng.normal(size=(64, 16)).astype(np.float32)}


def _fit(strategy, steps, extra=()):
    return jl.Fit(strategy, max_steps=steps, enable_progress_bar=False, logger=False,
                  enable_model_summary=False, enable_checkpointing=saves_checkpoints(extra),
                  callbacks=[callbacks.EMAWeightAveraging(decay=0.7), *extra])


def test_average_is_sharded_like_the_parameters_and_compiled_once():
    fit = _fit("fsdp", 4)
    module = Lin()
    fit.fit(module, jl.data.DataLoader(_data(), 16))
    assert fit.compile_counts["train"] == 1
    (averaging,) = states_of(fit.state.opt_state, AveragingState)
    assert averaging.average["kernel"].sharding == fit.state.params["kernel"].sharding
    assert averaging.average["kernel"].sharding.spec != jax.sharding.PartitionSpec()
    assert int(averaging.n_averaged) == 4 and int(averaging.count) == 4
    # Training ended with the average in the model and in the state.
    np.testing.assert_array_equal(np.asarray(module.model.kernel[...]),
                                  np.asarray(averaging.average["kernel"]))


def test_resume_continues_the_average_bitwise(tmp_path):
    data = _data()
    whole = _fit("single", 6)
    whole.fit(Lin(), jl.data.DataLoader(data, 16))
    ckpt = str(tmp_path / "ckpt")
    first = _fit("single", 3, [callbacks.ModelCheckpoint(ckpt, every_n_steps=3)])
    first.fit(Lin(), jl.data.DataLoader(data, 16))
    resumed = _fit("single", 6)
    resumed.fit(Lin(), jl.data.DataLoader(data, 16), ckpt_path=os.path.join(ckpt, "3"))
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.state)),
                    jax.device_get(jax.tree.leaves(whole.state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_refusals_name_the_lightning_form():
    with pytest.raises(jl.ConfigurationError, match="update_starting_at_step"):
        callbacks.EMAWeightAveraging(update_starting_at_epoch=2)
    with pytest.raises(jl.ConfigurationError, match=r"decay=1.5\) must be in \[0, 1\]"):
        callbacks.EMAWeightAveraging(decay=1.5)
    with pytest.raises(jl.ConfigurationError, match="multi_avg_fn"):
        callbacks.WeightAveraging(multi_avg_fn=lambda *a: a)
