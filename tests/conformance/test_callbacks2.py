"""Conformance group `callbacks2`: Lightning 2.6 callbacks jaxlight carries under their names,
run beside Lightning on the same problem (fixture: tests/conformance/fixtures/callbacks2.json,
from lightning_side/callbacks2.py).

Weight averaging: the validation losses each epoch (Lightning validates the averaged weights)
and the final weights (Lightning copies the average into the module when training ends).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixtures" / "callbacks2.json").read_text())
_spec = importlib.util.spec_from_file_location("_data2_problem", HERE / "_data2_problem.py")
_problem = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_problem)

#: case id -> the claim it checks, in words (for the conformance table).
CLAIMS = {
    "weight_averaging_default_is_swa_mean":
        "WeightAveraging() averages every step with equal weights; validation and the final "
        "model use the average",
    "ema_decay_start_and_every":
        "EMAWeightAveraging(decay, update_starting_at_step, update_every_n_steps) updates on "
        "Lightning's steps (the first update copies)",
    "ema_adam_default_decay": "EMAWeightAveraging under Adam",
    "ema_validation_before_first_update_uses_initial_weights":
        "before the first update the average is the initial model, which validation reads",
}


class Reg(jl.TrainModule):
    def __init__(self, kernel, bias, lr, optimizer):
        super().__init__()
        self.kernel, self.bias, self.lr, self.optimizer = kernel, bias, lr, optimizer

    def configure_model(self, rngs):
        layer = nnx.Linear(4, 2, rngs=rngs)
        layer.kernel[...] = self.kernel
        layer.bias[...] = self.bias
        return layer

    def configure_optimizers(self):
        return {"sgd": optax.sgd, "adam": optax.adam}[self.optimizer](self.lr)

    def loss(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def training_step(self, model, batch):
        return self.loss(model, batch)

    def validation_step(self, model, batch):
        return {"loss": self.loss(model, batch)}


class ValLosses(callbacks.Callback):
    def __init__(self):
        self.losses = []

    def on_validation_end(self, fit, module):
        self.losses.append(fit.callback_metrics["val_loss"])


def run_case(case, strategy="single", extra=()):
    prob = _problem.make_problem(case["n"], seed=case["seed"])
    np.testing.assert_allclose(_problem.checksum(prob), case["checksum"], rtol=1e-12)
    n = case["n_train"]
    cls = getattr(callbacks, case["callback"]["name"])
    record = ValLosses()
    fit = jl.Fit(strategy, max_epochs=case["epochs"],
                 callbacks=[cls(**case["callback"]["kwargs"]), record, *extra],
                 enable_progress_bar=False, logger=False, enable_model_summary=False,
                 num_sanity_val_steps=0)
    module = Reg(prob["kernel"], prob["bias"], case["lr"], case["optimizer"])
    loader = jl.data.DataLoader
    fit.fit(module, loader({"x": prob["x"][:n], "y": prob["y"][:n]}, case["batch_size"]),
            loader({"x": prob["x"][n:], "y": prob["y"][n:]}, case["batch_size"]))
    return fit, module, record


@pytest.mark.parametrize("case_id", sorted(FIXTURE["cases"]))
def test_callbacks2(case_id):
    case = FIXTURE["cases"][case_id]
    fit, module, record = run_case(case)
    assert fit.global_step == case["global_step"]
    np.testing.assert_allclose(record.losses, case["val_losses"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(module.model.kernel[...]), case["final"]["kernel"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(module.model.bias[...]), case["final"]["bias"],
                               rtol=1e-5, atol=1e-6)
