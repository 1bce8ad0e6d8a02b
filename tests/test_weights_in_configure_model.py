"""Starting from existing weights in `configure_model` (docs/porting.md, 'Starting from existing
weights'): NumPy arrays, as a torch `state_dict()` holds them (Linear weights (out, in),
BatchNorm running statistics), land in the model under every layout, before the first step."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks

rng = np.random.default_rng(0)
#: What `{k: v.numpy() for k, v in torch_model.state_dict().items()}` gives for
#: nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).
STATE = {"0.weight": rng.normal(size=(32, 16)).astype(np.float32),
         "0.bias": rng.normal(size=32).astype(np.float32),
         "1.weight": rng.uniform(0.5, 1.5, size=32).astype(np.float32),
         "1.bias": rng.normal(size=32).astype(np.float32),
         "1.running_mean": rng.normal(size=32).astype(np.float32),
         "1.running_var": rng.uniform(0.5, 2.0, size=32).astype(np.float32),
         "3.weight": rng.normal(size=(4, 32)).astype(np.float32),
         "3.bias": rng.normal(size=4).astype(np.float32)}


def load_torch_state(model: nnx.Sequential, state: dict) -> None:
    """torch's names and layouts into the nnx layers (kernels transposed)."""
    first, norm, _, last = model.layers
    for i, dense in ((0, first), (3, last)):
        dense.kernel[...] = state[f"{i}.weight"].T
        dense.bias[...] = state[f"{i}.bias"]
    norm.scale[...] = state["1.weight"]
    norm.bias[...] = state["1.bias"]
    norm.mean[...] = state["1.running_mean"]
    norm.var[...] = state["1.running_var"]


class Pretrained(jl.TrainModule):
    def configure_model(self, rngs):
        model = nnx.Sequential(nnx.Linear(16, 32, rngs=rngs),
                               nnx.BatchNorm(32, momentum=0.9, rngs=rngs), nnx.relu,
                               nnx.Linear(32, 4, rngs=rngs))
        load_torch_state(model, STATE)
        return model

    def configure_optimizers(self):
        return optax.sgd(0.0)

    def training_step(self, model, batch):
        return (model(batch["x"]) ** 2).mean()

    def predict_step(self, model, batch):
        return model(batch["x"])


def _eval_reference(x):
    h = x @ STATE["0.weight"].T + STATE["0.bias"]
    h = (h - STATE["1.running_mean"]) / np.sqrt(STATE["1.running_var"] + 1e-5)
    h = np.maximum(h * STATE["1.weight"] + STATE["1.bias"], 0)
    return h @ STATE["3.weight"].T + STATE["3.bias"]


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_torch_weights_load_in_configure_model(strategy):
    start = {}
    record = callbacks.LambdaCallback(on_train_start=lambda fit, module: start.update(
        jax.device_get({"params": fit.state.params, "rest": fit.state.rest})))
    fit = jl.Fit(strategy, max_steps=1, enable_progress_bar=False, logger=False,
                 enable_model_summary=False, enable_checkpointing=False, callbacks=[record])
    module = Pretrained()
    x = rng.normal(size=(16, 16)).astype(np.float32)
    fit.fit(module, [{"x": x}])
    np.testing.assert_array_equal(start["params"]["layers"][0]["kernel"], STATE["0.weight"].T)
    np.testing.assert_array_equal(start["rest"]["layers"][1]["var"], STATE["1.running_var"])
    # Prediction runs the model in evaluation mode (running statistics), as torch's eval():
    # a Fit that never trained predicts with configure_model's weights.
    predicted = jl.Fit(strategy, enable_progress_bar=False, logger=False,
                       enable_model_summary=False).predict(Pretrained(), [{"x": x}])
    np.testing.assert_allclose(predicted[0], _eval_reference(x), rtol=1e-5, atol=1e-4)
