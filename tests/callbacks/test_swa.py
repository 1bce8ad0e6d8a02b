"""StochasticWeightAveraging: sharded like the parameters, one compile, and its errors
(tests/conformance/test_callbacks3.py compares it with Lightning and resumes it)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.callbacks._swa import SWAState
from jaxlight.schedules._scheduler import states_of


class Lin(jl.TrainModule):
    def __init__(self, tx=None):
        super().__init__()
        self.tx = tx

    def configure_model(self, rngs):
        return nnx.Linear(8, 16, rngs=rngs)

    def configure_optimizers(self):
        return self.tx or optax.adam(0.05)

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _data():
    rng = np.random.default_rng(0)
    return jl.data.DataLoader({"x": rng.normal(size=(32, 8)).astype(np.float32),
                               "y": rng.normal(size=(32, 16)).astype(np.float32)}, 16)


def _fit(strategy="single", swa=None, **kw):
    kw.setdefault("max_epochs", 3)
    return jl.Fit(strategy, enable_progress_bar=False, logger=False, enable_model_summary=False,
                  enable_checkpointing=False,
                  callbacks=[swa or callbacks.StochasticWeightAveraging(1e-2, 2, 1)], **kw)


def test_average_is_sharded_like_the_parameters_and_compiled_once():
    fit = _fit("fsdp")
    module = Lin()
    fit.fit(module, _data())
    assert fit.compile_counts["train"] == 1
    (swa,) = states_of(fit.state.opt_state, SWAState)
    assert swa.average["kernel"].sharding == fit.state.params["kernel"].sharding
    assert swa.average["kernel"].sharding.spec != jax.sharding.PartitionSpec()
    # Epochs 1 and 2 started inside SWA: two parameter sets averaged; the average is the model.
    assert int(swa.n_averaged) == 2 and int(swa.count) == 6
    np.testing.assert_allclose(float(swa.lr), 1e-2, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(module.model.kernel[...]),
                                  np.asarray(swa.average["kernel"]))


@pytest.mark.parametrize("kwargs, match", [
    ({"swa_lrs": 0.1, "swa_epoch_start": 0}, "integer >= 1"),
    ({"swa_lrs": 0.1, "swa_epoch_start": 1.5}, "between 0 and 1"),
    ({"swa_lrs": -0.1}, "positive float"),
    ({"swa_lrs": [0.1, 0.2]}, "one parameter group"),
    ({"swa_lrs": 0.1, "annealing_strategy": "cosine"}, "'cos' or 'linear'"),
    ({"swa_lrs": 0.1, "device": "cuda"}, "sharded like them"),
])
def test_arguments_are_checked(kwargs, match):
    with pytest.raises(jl.ConfigurationError, match=match):
        callbacks.StochasticWeightAveraging(**kwargs)


def test_a_fraction_needs_max_epochs():
    fit = _fit(swa=callbacks.StochasticWeightAveraging(0.1, 0.5), max_epochs=None, max_steps=4)
    with pytest.raises(jl.ConfigurationError, match="fraction of max_epochs"):
        fit.fit(Lin(), _data())


def test_a_hidden_learning_rate_is_refused():
    # Two constant rates: which one is the optimizer's is not knowable.
    tx = optax.chain(optax.sgd(0.1), optax.sgd(0.2))
    with pytest.raises(jl.ConfigurationError, match="cannot read it"):
        _fit().fit(Lin(tx), _data())


def test_an_injected_rate_is_read():
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    fit = _fit(max_epochs=2, swa=callbacks.StochasticWeightAveraging(0.01, 1, 0))
    fit.fit(Lin(tx), _data())
    (swa,) = states_of(fit.state.opt_state, SWAState)
    np.testing.assert_allclose([float(swa.lr0), float(swa.lr)], [0.1, 0.01], rtol=1e-6)


def test_a_changing_accumulation_is_refused():
    fit = jl.Fit("single", max_epochs=2, enable_progress_bar=False, logger=False,
                 callbacks=[callbacks.StochasticWeightAveraging(0.1),
                            callbacks.GradientAccumulationScheduler({1: 2})])
    with pytest.raises(jl.ConfigurationError, match="changing accumulate_grad_batches"):
        fit.fit(Lin(), _data())
