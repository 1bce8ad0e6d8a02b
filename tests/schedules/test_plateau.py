"""schedules.ReduceLROnPlateau makes torch's decisions (issue 25 item 2).

`torch_plateau.json` holds torch 2.13's learning rates after each `step(value)` of
`torch.optim.lr_scheduler.ReduceLROnPlateau` (SGD, lr 0.1) for several configurations and value
sequences; the script that wrote it is in the file (`generated_by`, run under the reference venv).
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, schedules
from jaxlight.schedules._scheduler import states_of

CASES = json.loads((pathlib.Path(__file__).parent / "torch_plateau.json").read_text())["cases"]


@pytest.mark.parametrize("case", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_the_rate_after_each_value_is_torchs(case):
    plateau = schedules.ReduceLROnPlateau(**case["config"], lr=0.1)
    state = plateau.init({"x": jnp.zeros(())})
    step = jax.jit(lambda s, v: plateau.update({}, s, value=v)[1])
    lrs = []
    for value in case["values"]:
        state = step(state, value)
        lrs.append(0.1 * float(state.scale))
    np.testing.assert_allclose(lrs, case["lrs"], rtol=1e-6)


def test_patience_one_lowers_at_the_second_bad_epoch_where_optax_lowers_at_the_first():
    rising = [1.0 + 0.1 * i for i in range(6)]
    ours = schedules.ReduceLROnPlateau(patience=1, factor=0.5)
    theirs = optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
    s, t = ours.init({"x": jnp.zeros(())}), theirs.init({"x": jnp.zeros(())})
    scales = []
    for v in rising:
        s, t = ours.update({}, s, value=v)[1], theirs.update({}, t, value=v)[1]
        scales.append((float(s.scale), float(t.scale)))
    assert [a for a, _ in scales] == [1, 1, 0.5, 0.5, 0.25, 0.25]  # torch's, as in the fixture
    assert [b for _, b in scales] == [1, 0.5, 0.25, 0.125, 0.0625, 0.03125]


def test_min_lr_needs_the_rate():
    with pytest.raises(jl.ConfigurationError, match="pass lr=<the rate given to the optimizer>"):
        schedules.ReduceLROnPlateau(min_lr=1e-3)


class Worsening(jl.TrainModule):
    """Gradient ascent on the validation loss: it rises every epoch."""

    def configure_model(self, rngs):
        return nnx.Linear(1, 1, rngs=rngs)

    def configure_optimizers(self):
        return {"optimizer": optax.sgd(-0.05),
                "lr_scheduler": {"scheduler": schedules.ReduceLROnPlateau(patience=1, factor=0.5),
                                 "monitor": "val_loss", "interval": "epoch"}}

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def validation_step(self, model, batch):
        return {"loss": ((model(batch["x"]) - batch["y"]) ** 2).mean()}


def test_fit_lowers_the_rate_as_lightning_with_torchs_plateau():
    """The issue's case: a rising val_loss, patience=1: torch's rates 1, 1, 0.5, 0.5, 0.25, ..."""
    data = [{"x": np.ones((4, 1), np.float32), "y": np.zeros((4, 1), np.float32)}]
    losses, scales = [], []

    class Record(callbacks.Callback):
        def on_train_epoch_end(self, fit, module):  # after the epoch's validation
            losses.append(fit.callback_metrics["val_loss"])
            (state,) = states_of(jax.device_get(fit.state.opt_state),
                                 schedules.ReduceLROnPlateauState)
            scales.append(float(state.scale))

    fit = jl.Fit("single", max_epochs=6, callbacks=[Record()], logger=False,
                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                 enable_checkpointing=False)
    fit.fit(Worsening(), data, data)
    assert all(b > a for a, b in zip(losses, losses[1:], strict=False))  # rising every epoch
    assert scales == [1, 1, 0.5, 0.5, 0.25, 0.25]
