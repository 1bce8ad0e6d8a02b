"""configure_optimizers' Lightning dict: schedulers, reduce-on-plateau, resume (issue 15 item 5)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.schedules._scheduler import ScheduleState, scheduler_state
from tests.models import Classifier, classification_data, saves_checkpoints

BATCH = 32


class Scheduled(Classifier):
    """Classifier whose configure_optimizers returns what it is given (and whose validation
    loss can be pinned to a constant, a metric that stalls)."""

    def __init__(self, optimizers=None, stall: bool = False):
        super().__init__()
        self.optimizers, self.stall = optimizers, stall

    def configure_optimizers(self):
        return self.optimizers()

    def validation_step(self, model, batch):
        out = super().validation_step(model, batch)
        if self.stall:
            out["loss"] = out["loss"] * 0 + 1.0
        return out


def _data(n_batches: int, seed: int = 0) -> list[dict]:
    data = classification_data(n_batches * BATCH, seed=seed)
    return [{k: v[i * BATCH:(i + 1) * BATCH] for k, v in data.items()} for i in range(n_batches)]


def _fit(module, train, val=None, cbs=(), ckpt_path=None, **kw):
    logs: list[tuple[int, dict]] = []
    fit = jl.Fit("single", callbacks=[*cbs, callbacks.LearningRateMonitor(),
                                      callbacks.LambdaCallback(
                                          on_log=lambda f, m, metrics, step: logs.append(
                                              (step, dict(metrics))))],
                 log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                 logger=False, enable_checkpointing=saves_checkpoints(cbs), **kw)
    fit.fit(module, train, val, ckpt_path=ckpt_path)
    return fit, logs


def _lrs(logs, key="lr") -> dict[int, float]:
    return {step: m[key] for step, m in logs if key in m}


def _plateau_opt(patience=1):
    def make():
        return {"optimizer": optax.inject_hyperparams(optax.adam)(learning_rate=0.1),
                "lr_scheduler": {"scheduler": optax.contrib.reduce_on_plateau(
                    factor=0.5, patience=patience), "monitor": "val_loss"}}
    return make


def test_plateau_lowers_the_rate_when_the_metric_stalls():
    train, val = _data(2), _data(1, seed=1)
    fit, logs = _fit(Scheduled(_plateau_opt(), stall=True), train, val, max_epochs=5)
    lrs = _lrs(logs)
    # val_loss is 1.0 every epoch: epoch 0 sets the best, every later epoch is a plateau of
    # patience 1, so the rate halves after epochs 1, 2, 3 (each update applies to the next).
    per_epoch = [lrs[2 * e + 2] for e in range(5)]
    np.testing.assert_allclose(per_epoch, [0.1, 0.1, 0.05, 0.025, 0.0125], rtol=1e-6)
    state = scheduler_state(jax.device_get(fit.state.opt_state))
    assert float(state.plateau.scale) == 0.5 ** 4  # after epoch 4's validation

    improving, logs = _fit(Scheduled(_plateau_opt()), train, val, max_epochs=3)
    val_losses = [m["val_loss"] for _, m in logs if "val_loss" in m]
    assert len(val_losses) == 3 and val_losses == sorted(val_losses, reverse=True)  # improves
    np.testing.assert_allclose(list(_lrs(logs).values()), 0.1, rtol=1e-6)


@pytest.mark.slow
def test_plateau_resumes_bitwise(tmp_path):
    train, val = _data(2), _data(1, seed=1)
    whole, _ = _fit(Scheduled(_plateau_opt(), stall=True), train, val, max_epochs=5)
    ckpt = str(tmp_path / "ckpt")
    _fit(Scheduled(_plateau_opt(), stall=True), train, val, max_epochs=3,
         cbs=[callbacks.ModelCheckpoint(ckpt)])
    resumed, logs = _fit(Scheduled(_plateau_opt(), stall=True), train, val, max_epochs=5,
                         ckpt_path=ckpt)
    assert min(step for step, _ in logs) == 7  # it did resume after epoch 3 (step 6)
    a = jax.device_get(resumed.state)
    b = jax.device_get(whole.state)
    assert isinstance(scheduler_state(a.opt_state), ScheduleState)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_epoch_interval_schedule_with_frequency():
    def make():
        return {"optimizer": optax.inject_hyperparams(optax.sgd)(learning_rate=0.2),
                "lr_scheduler": {"scheduler": optax.exponential_decay(1.0, 1, 0.5),
                                 "interval": "epoch", "frequency": 2, "name": "lr-sgd"}}

    fit, logs = _fit(Scheduled(make), _data(3), max_epochs=5)
    lrs = _lrs(logs, "lr-sgd")  # the scheduler's name, as Lightning's LearningRateMonitor
    per_epoch = [[lrs[3 * e + i] for i in (1, 2, 3)] for e in range(5)]
    expected = [0.2, 0.2, 0.1, 0.1, 0.05]  # halved every 2 epochs, constant within an epoch
    np.testing.assert_allclose(per_epoch, [[x] * 3 for x in expected], rtol=1e-6)
    assert fit.compile_counts["train"] == 1


def test_step_interval_equals_the_same_schedule_inside_optax():
    schedule = optax.exponential_decay(1.0, 1, 0.8)
    data = _data(4)
    dict_form, _ = _fit(Scheduled(lambda: {
        "optimizer": optax.sgd(0.3),
        "lr_scheduler": {"scheduler": schedule, "interval": "step"}}), data, max_steps=4)
    optax_form, _ = _fit(Scheduled(lambda: optax.sgd(lambda t: 0.3 * schedule(t))), data,
                         max_steps=4)
    for x, y in zip(jax.tree.leaves(nnx.state(dict_form.session.module.model)),
                    jax.tree.leaves(nnx.state(optax_form.session.module.model)), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("returned", "error", "match"), [
    ({"optimizer": optax.sgd(0.1), "lr_schedular": optax.constant_schedule(1.0)},
     jl.ConfigurationError, r"unknown key\(s\) \['lr_schedular'\]; valid keys are \['optimizer', "
                            r"'lr_scheduler', 'monitor'\]. Did you mean 'lr_scheduler'"),
    ({"optimizer": optax.sgd(0.1), "lr_scheduler": {"scheduler": optax.constant_schedule(1.0),
                                                    "intervall": "step"}},
     jl.ConfigurationError, r"\['lr_scheduler'\] has unknown key\(s\) \['intervall'\]; valid "
                            r"keys are \['scheduler', 'interval', 'frequency', 'monitor', "
                            r"'strict', 'name'\]"),
    ({"optimizer": optax.sgd(0.1), "lr_scheduler": {"interval": "step"}},
     jl.ConfigurationError, r"has no 'scheduler' key \(it has \['interval'\]\)"),
    ({"optimizer": optax.sgd(0.1), "lr_scheduler": {"scheduler": optax.constant_schedule(1.0),
                                                    "interval": "batch"}},
     jl.ConfigurationError, r"'interval'\] = 'batch'; it must be 'step' or 'epoch'"),
    ({"optimizer": optax.sgd(0.1),
      "lr_scheduler": {"scheduler": optax.contrib.reduce_on_plateau()}},
     jl.ConfigurationError, r"reduce_on_plateau but names no metric.*'monitor': 'val_loss'"),
    ({"lr_scheduler": optax.constant_schedule(1.0)},
     jl.ConfigurationError, r"without 'optimizer' \(keys: \['lr_scheduler'\]\)"),
    (([optax.sgd(0.1)], [optax.constant_schedule(1.0)]),
     jl.PortingError, r"Lightning.s \(\[optimizers\], \[schedulers\]\) pair"),
])
def test_a_bad_configure_optimizers_is_refused(returned, error, match):
    fit = jl.Fit("single", max_steps=1, enable_progress_bar=False, logger=False)
    with pytest.raises(error, match=match):
        fit.fit(Scheduled(lambda: returned), _data(1))


def test_a_monitor_validation_does_not_produce_is_refused():
    def make():
        return {"optimizer": optax.adam(0.1),
                "lr_scheduler": {"scheduler": optax.contrib.reduce_on_plateau(),
                                 "monitor": "val_los"}}

    with pytest.raises(jl.ConfigurationError, match=r"monitors 'val_los', which validation did "
                                                    r"not produce.*Did you mean 'val_loss'"):
        _fit(Scheduled(make), _data(1), _data(1), max_epochs=1)
    with pytest.raises(jl.ConfigurationError, match=r"monitors 'val_los'.*no val_data"):
        _fit(Scheduled(make), _data(1), max_epochs=1)


def test_lr_monitor_logs_the_effective_rate_of_a_constant_rate():
    """optax.adam(0.1) keeps its rate in a closure, which the monitor reads (it logged only the
    factor, as 'lr_scale', before); Lightning logs the group's rate, 0.1 times the factor."""
    def make():
        return {"optimizer": optax.adam(0.1),
                "lr_scheduler": {"scheduler": optax.exponential_decay(1.0, 1, 0.5),
                                 "interval": "step"}}

    _, logs = _fit(Scheduled(make), _data(3), max_steps=3)
    np.testing.assert_allclose(list(_lrs(logs).values()), [0.1, 0.05, 0.025], rtol=1e-6)
    assert not _lrs(logs, "lr_scale")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_plateau_under_other_strategies(strategy):
    train, val = _data(2), _data(1, seed=1)
    logs: list[tuple[int, dict]] = []
    fit = jl.Fit(strategy, max_epochs=3, callbacks=[
        callbacks.LearningRateMonitor(),
        callbacks.LambdaCallback(on_log=lambda f, m, metrics, step: logs.append((step, metrics)))],
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False)
    fit.fit(Scheduled(_plateau_opt(), stall=True), train, val)
    lrs = _lrs(logs)
    np.testing.assert_allclose([lrs[2], lrs[4], lrs[6]], [0.1, 0.1, 0.05], rtol=1e-6)
    assert fit.compile_counts["schedule"] == 1
