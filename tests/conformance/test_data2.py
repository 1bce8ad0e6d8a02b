"""Conformance group `data2`: a torch `DataLoader` ported by renaming trains what Lightning
trains (fixture: tests/conformance/fixtures/data2.json, from lightning_side/data2.py).

Each case runs jaxlight on the numbers Lightning used (regenerated from the seed by
`_data2_problem.py`, checked against the fixture's checksums) and compares what a user sees:
optimizer steps, examples trained on, the epoch-mean training loss, the final weights.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from tests.conformance import _data2_problem as _problem

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixtures" / "data2.json").read_text())

#: case id -> the claim it checks, in words (for the conformance table).
CLAIMS = {
    "dataloader_defaults_train_every_example":
        "jaxlight.data.DataLoader(arrays, batch_size=32) keeps torch's defaults (no shuffle, "
        "last partial batch trained): the same optimizer steps (315), examples, epoch-mean "
        "loss (weighted by batch size) and weights as Lightning with torch's DataLoader",
    "dataloader_drop_last":
        "DataLoader(drop_last=True) drops the partial batch as torch does",
}


class Reg(jl.TrainModule):
    def __init__(self, kernel, bias, lr):
        super().__init__()
        self.kernel, self.bias, self.lr = kernel, bias, lr

    def configure_model(self, rngs):
        layer = nnx.Linear(4, 2, rngs=rngs)
        layer.kernel[...] = self.kernel
        layer.bias[...] = self.bias
        return layer

    def configure_optimizers(self):
        return optax.sgd(self.lr)

    def training_step(self, model, batch):
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss


class EpochLosses(jl.callbacks.Callback):
    def __init__(self):
        self.losses, self.seen = [], 0

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        self.seen += len(batch["x"])

    def on_train_epoch_end(self, fit, module):
        self.losses.append(fit.callback_metrics["train_loss"])


@pytest.mark.parametrize("case_id", sorted(FIXTURE["cases"]))
def test_data2(case_id):
    case = FIXTURE["cases"][case_id]
    prob = _problem.make_problem(case["n"])
    np.testing.assert_allclose(_problem.checksum(prob), case["checksum"], rtol=1e-12)
    module = Reg(prob["kernel"], prob["bias"], case["lr"])
    record = EpochLosses()
    fit = jl.Fit("single", max_epochs=case["epochs"], callbacks=[record],
                 enable_progress_bar=False, logger=False, enable_model_summary=False,
                 enable_checkpointing=False)
    loader = jl.data.DataLoader({"x": prob["x"], "y": prob["y"]}, batch_size=case["batch_size"],
                                drop_last=case["drop_last"])
    fit.fit(module, loader)
    assert fit.global_step == case["global_step"]
    assert record.seen == case["examples_seen"]
    np.testing.assert_allclose(record.losses, case["epoch_losses"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(module.model.kernel[...]), case["kernel"], rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.asarray(module.model.bias[...]), case["bias"], rtol=1e-5,
                               atol=1e-6)
