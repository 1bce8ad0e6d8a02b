"""Optimizer steps and weights: accumulate_grad_batches, gradient clipping, and schedulers
through configure_optimizers' dict. SGD weights after training record every step's rate, so
equal weights mean the same rate at every step."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlight as jl
from tests.conformance._cases import case, claim, covers, fixture
from tests.conformance._jaxlight import Passes, Reg, assert_weights, batches, make_fit

G = "optim"


class Scheduled(Reg):
    """Reg with `configure_optimizers` returning Lightning's dict around `schedule`."""

    def __init__(self, lr=0.1, entry=None):
        super().__init__(G, "sgd", lr)
        object.__setattr__(self, "entry", entry)

    def configure_optimizers(self):
        return {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=self.lr),
                "lr_scheduler": self.entry}


def _run(name, module=None, val=None, **kw):
    module = module or Reg(G)
    fit = make_fit(**kw)
    fit.fit(module, batches(G), val)
    expected = case(G, name)
    assert fit.global_step == expected["global_step"]
    assert_weights(module, expected["weights"])


@pytest.mark.parametrize("k", [1, 2, 3])
@claim("accumulate_grad_batches=k takes one SGD step per k loader batches (the last group of an "
       "epoch may be shorter): Lightning's step count and weights")
@covers("Fit(accumulate_grad_batches)",
        "TrainModule.training_step",
        "TrainModule.configure_model")
def test_accumulate_sgd(k):
    _run(f"accumulate_{k}_sgd", max_epochs=2, accumulate_grad_batches=k)


@claim("accumulate_grad_batches=2 with Adam: Lightning's step count and weights")
def test_accumulate_2_adam():
    _run("accumulate_2_adam", Reg(G, "adam", 0.05), max_epochs=2, accumulate_grad_batches=2)


@claim("max_steps counts optimizer steps under accumulate_grad_batches=2 (3 steps, 6 batches)")
def test_accumulate_2_max_steps_3():
    _run("accumulate_2_max_steps_3", max_steps=3, accumulate_grad_batches=2)


@claim("gradient_clip_val clips the global gradient norm (SGD), as Lightning")
@covers("Fit(gradient_clip_val)")
def test_clip_norm_sgd():
    _run("clip_norm_sgd", Reg(G, "sgd", 0.2), max_epochs=1, gradient_clip_val=0.5)


@claim("gradient_clip_algorithm='value' clips each gradient element, as Lightning")
@covers("Fit(gradient_clip_algorithm)")
def test_clip_value_sgd():
    _run("clip_value_sgd", Reg(G, "sgd", 0.2), max_epochs=1, gradient_clip_val=0.05,
         gradient_clip_algorithm="value")


@claim("gradient clipping by norm happens before Adam's update, as Lightning")
def test_clip_norm_adam():
    _run("clip_norm_adam", Reg(G, "adam", 0.05), max_epochs=1, gradient_clip_val=0.3)


@claim("{'interval': 'epoch'} with a factor schedule is torch's LambdaLR stepped each epoch")
@covers("TrainModule.configure_optimizers")
def test_lambdalr_epoch():
    _run("lambdalr_epoch", Scheduled(entry={"scheduler": lambda e: 0.5 ** e,
                                            "interval": "epoch"}), max_epochs=3)


@claim("{'interval': 'step'} is torch's LambdaLR stepped after every optimizer step")
def test_lambdalr_step():
    _run("lambdalr_step", Scheduled(entry={"scheduler": lambda s: 0.9 ** s,
                                           "interval": "step"}), max_epochs=2)


@claim("{'interval': 'step', 'frequency': 3} steps the scheduler as Lightning does")
def test_lambdalr_step_frequency_3():
    _run("lambdalr_step_frequency_3", Scheduled(entry={
        "scheduler": lambda s: 0.8 ** s, "interval": "step", "frequency": 3}), max_epochs=2)


@claim("torch's StepLR(step_size=2, gamma=0.5) is optax.exponential_decay(1, 2, 0.5, "
       "staircase=True) per epoch")
def test_steplr_epoch():
    _run("steplr_epoch", Scheduled(entry={
        "scheduler": optax.exponential_decay(1.0, 2, 0.5, staircase=True),
        "interval": "epoch"}), max_epochs=5)


def onecycle(total_steps, pct_start=0.3, div_factor=25.0, final_div_factor=1e4):
    """torch's OneCycleLR (cosine, cycle_momentum=False) as a factor of max_lr: the rate rises
    from max_lr/div_factor to max_lr at step pct_start * total - 1 (a fraction, unlike
    optax.cosine_onecycle_schedule's whole-step boundary), then falls to
    max_lr/div_factor/final_div_factor at step total - 1."""
    start, peak_at, end_at = 1.0 / div_factor, pct_start * total_steps - 1, total_steps - 1.0

    def anneal(a, b, pct):
        return b + (a - b) / 2 * (1 + jnp.cos(jnp.pi * pct))

    def factor(step):
        step = jnp.asarray(step, jnp.float32)
        return jnp.where(step <= peak_at, anneal(start, 1.0, step / peak_at),
                         anneal(1.0, start / final_div_factor,
                                (step - peak_at) / (end_at - peak_at)))

    return factor


@claim("torch's OneCycleLR(max_lr, total_steps, cycle_momentum=False) is the factor schedule "
       "`onecycle(total_steps)` (porting.md) with the optimizer at max_lr")
def test_onecycle_step():
    total = case(G, "onecycle_step")["total_steps"]
    _run("onecycle_step", Scheduled(0.3, {"scheduler": onecycle(total), "interval": "step"}),
         max_epochs=2)


def _plateau(lr, **torch_kwargs):
    """torch's ReduceLROnPlateau(optimizer, factor=0.5, **torch_kwargs) under its own name."""
    return jl.schedules.ReduceLROnPlateau(factor=0.5, lr=lr, **torch_kwargs)


PLATEAUS = sorted(k for k in fixture(G)["cases"] if k.startswith("plateau_"))


@pytest.mark.parametrize("name", PLATEAUS)
@claim("torch's ReduceLROnPlateau is jaxlight.schedules.ReduceLROnPlateau: with patience, "
       "threshold, threshold_mode, cooldown, min_lr and mode it lowers the rate after the same "
       "epochs")
def test_plateau(name):
    expected = case(G, name)
    kw = expected["kwargs"]
    values = np.asarray(expected["values"], np.float32)
    x = fixture(G)["problem"]["val"]["x"][:4]
    module = Scheduled(entry={"scheduler": _plateau(0.1, **kw), "interval": "epoch",
                              "monitor": "val_score"})
    _run(name, module, Passes(values, x), max_epochs=len(values), limit_train_batches=1)


@claim("in 'min' mode with relative thresholds, torch's ReduceLROnPlateau(patience=p) is "
       "optax.contrib.reduce_on_plateau(patience=p + 1, rtol=threshold)")
def test_plateau_optax_equivalent():
    name = "plateau_threshold_rel"
    expected = case(G, name)
    kw = expected["kwargs"]
    x = fixture(G)["problem"]["val"]["x"][:4]
    tx = optax.contrib.reduce_on_plateau(factor=0.5, patience=kw["patience"] + 1,
                                         rtol=kw["threshold"], atol=0.0)
    module = Scheduled(entry={"scheduler": tx, "interval": "epoch", "monitor": "val_score"})
    _run(name, module, Passes(expected["values"], x), max_epochs=len(expected["values"]),
         limit_train_batches=1)
