"""self.log / self.log_dict inside steps: values join the step's metrics, on_epoch means are
summed on device and equal the epoch's mean, prog_bar picks the progress bar's fields."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight._errors import ConfigurationError
from jaxlight.data import ArrayLoader
from tests.models import Classifier, classification_data


class Logs(callbacks.Callback):
    def __init__(self):
        self.rounds = []

    def on_log(self, fit, module, metrics, step):
        self.rounds.append((step, dict(metrics)))


class Logged(Classifier):
    def training_step(self, model, batch):
        logits = model(batch["x"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        loss = losses.mean()
        weight = (batch["y"] == 0).sum()  # varies from batch to batch
        self.log("train_loss", loss, prog_bar=True, on_epoch=True)
        self.log_dict({"class0_loss": (losses * (batch["y"] == 0)).sum() / weight,
                       "class0_count": weight.astype(jnp.float32)})
        self.log("class0_epoch_loss", (losses * (batch["y"] == 0)).sum() / weight,
                 on_step=False, on_epoch=True, batch_size=weight)
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    def validation_step(self, model, batch):
        logits = model(batch["x"])
        self.log("val_loss", optax.softmax_cross_entropy_with_integer_labels(
            logits, batch["y"]).mean(), prog_bar=True)
        return {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


@pytest.fixture(scope="module")
def run():
    logs = Logs()
    fit = jl.Fit("single", max_epochs=2, log_every_n_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, enable_checkpointing=False,
                 callbacks=[logs])
    data = classification_data(128)
    fit.fit(Logged(), ArrayLoader(data, 32), ArrayLoader(classification_data(40, seed=1), 16,
                                                        shuffle=False, drop_remainder=False))
    return fit, logs.rounds


def _steps(rounds):
    return [(s, m) for s, m in rounds if "train_loss_step" in m]


def test_on_epoch_equals_the_epoch_mean(run):
    fit, rounds = run
    steps = _steps(rounds)
    assert [s for s, _ in steps] == list(range(1, 9))  # every step, log_every_n_steps=1
    epochs = [(s, m) for s, m in rounds if "train_loss_epoch" in m]
    assert [s for s, _ in epochs] == [4, 8]  # logged at each epoch's end
    for e, (_, at_end) in enumerate(epochs):
        mine = [m for s, m in steps if 4 * e < s <= 4 * (e + 1)]
        assert at_end["train_loss_epoch"] == pytest.approx(
            np.mean([m["train_loss_step"] for m in mine]), rel=1e-6)
        # batch_size weights an epoch mean: sum(value * weight) / sum(weight).
        values = np.array([m["class0_loss"] for m in mine])
        weights = np.array([m["class0_count"] for m in mine])
        assert at_end["class0_epoch_loss"] == pytest.approx(
            (values * weights).sum() / weights.sum(), rel=1e-6)
        # on_step=False: never logged per step; and no weight entries leak to loggers.
        assert all("class0_epoch_loss" not in m for m in mine)
        assert all(not any(k.endswith(":weight") for k in m) for m in mine)
    assert fit.callback_metrics["train_loss_epoch"] == epochs[-1][1]["train_loss_epoch"]


def test_returned_metrics_and_logged_values_together(run):
    fit, rounds = run
    _, last = _steps(rounds)[-1]
    assert {"loss", "accuracy", "train_loss_step", "class0_loss", "class0_count"} <= set(last)
    assert last["loss"] == pytest.approx(last["train_loss_step"], rel=1e-6)
    assert fit.compile_counts["train"] == 1  # logging adds no compile of the step
    val = [m for _, m in rounds if "val_loss" in m]
    assert len(val) == 2 and "val_accuracy" in val[0]  # logged name as given, returned prefixed


def test_prog_bar_picks_the_fields(run):
    fit, _ = run
    assert fit.progress_bar_metrics == {"train_loss_step", "train_loss_epoch", "val_loss"}
    shows = callbacks.TQDMProgressBar._shows
    assert [k for k in ("loss", "train_loss_step", "val_loss", "val_accuracy", "class0_loss")
            if shows(fit, k)] == ["loss", "train_loss_step", "val_loss"]


def test_logger_false_keeps_values_from_the_loggers(tmp_path):
    """logger=False (Lightning's meaning): not in the CSV nor fit.logged_metrics, in training
    (an on_step + on_epoch value too) and evaluation; fit.callback_metrics and the other
    callbacks (the progress bar reads on_log) still get the values."""

    class Hidden(Classifier):
        def training_step(self, model, batch):
            loss = super().training_step(model, batch)[0]
            self.log("quiet", loss, logger=False, prog_bar=True, on_step=True, on_epoch=True)
            self.log("shown", loss)
            return loss

        def validation_step(self, model, batch):
            loss = super().training_step(model, batch)[0]
            self.log("val_quiet", loss, logger=False, prog_bar=True)
            return {"loss": loss}

    logs, csv = Logs(), callbacks.CSVLogger(str(tmp_path))
    fit = jl.Fit("single", max_steps=2, log_every_n_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=csv, enable_checkpointing=False,
                 callbacks=[logs])
    data = ArrayLoader(classification_data(64), 32)
    fit.fit(Hidden(), data, data)
    fit.validate(data=data)
    hidden = {"quiet", "quiet_step", "quiet_epoch", "val_quiet"}
    assert {"shown", "val_loss"} <= set(fit.logged_metrics)
    assert not hidden & set(fit.logged_metrics)
    assert not hidden & {k for _, row in csv.rows for k in row}
    assert hidden <= set(fit.callback_metrics)
    assert hidden - {"quiet"} <= {k for _, m in logs.rounds for k in m}
    assert {"quiet_step", "val_quiet"} <= fit.progress_bar_metrics


def test_log_errors():
    class Twice(Classifier):
        def training_step(self, model, batch):
            loss = super().training_step(model, batch)[0]
            self.log("a", loss)
            self.log("a", loss)
            return loss

    class Vector(Classifier):
        def training_step(self, model, batch):
            loss = super().training_step(model, batch)[0]
            self.log("v", model(batch["x"]).mean(0))
            return loss

    data = ArrayLoader(classification_data(64), 32)
    for cls, match in ((Twice, "a second time"), (Vector, r"shape \(4,\)")):
        fit = jl.Fit("single", max_steps=1, enable_progress_bar=False,
                     enable_model_summary=False, logger=False)
        with pytest.raises(jl.JaxlightError, match=match):
            fit.fit(cls(), data)
    class Sum(Classifier):
        def training_step(self, model, batch):
            loss = super().training_step(model, batch)[0]
            self.log("m", loss, reduce_fx="sum")
            return loss

    class EvalMax(Classifier):
        def validation_step(self, model, batch):
            self.log("val_m", model(batch["x"]).mean(), reduce_fx="max")

    for cls, match in ((Sum, r"reduce_fx='sum' is not supported in training \(use 'mean', "
                              r"'max' or 'min'\)"),
                       (EvalMax, "reduce_fx='max' is not supported in an evaluation step")):
        with pytest.raises(ConfigurationError, match=match):
            jl.Fit("single", max_epochs=1, enable_progress_bar=False, enable_model_summary=False,
                   logger=False, num_sanity_val_steps=0).fit(cls(), data, data)


def test_reduce_fx_max_min_over_the_epoch():
    """reduce_fx='max' / 'min' (also jnp.max): the epoch's extreme of the step values, whatever
    batch_size says; on_step values are the step's own; the step compiles once."""

    class Extremes(Classifier):
        def training_step(self, model, batch):
            loss = super().training_step(model, batch)[0]
            self.log("top", loss, on_step=True, on_epoch=True, reduce_fx="max", batch_size=3)
            self.log("bottom", loss, on_step=False, on_epoch=True, reduce_fx=jnp.min)
            return loss

    logs = Logs()
    fit = jl.Fit("single", max_epochs=2, log_every_n_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, enable_checkpointing=False,
                 callbacks=[logs])
    fit.fit(Extremes(), ArrayLoader(classification_data(96), 32))
    steps = [m["top_step"] for _, m in logs.rounds if "top_step" in m]
    ends = [m for _, m in logs.rounds if "top_epoch" in m]
    assert len(steps) == 6 and len(ends) == 2
    for e, end in enumerate(ends):
        epoch = steps[3 * e:3 * e + 3]
        assert end["top_epoch"] == pytest.approx(max(epoch), rel=1e-6)
        assert end["bottom"] == pytest.approx(min(epoch), rel=1e-6)
    assert max(steps[3:]) > min(steps[3:])  # the check can tell max, min and mean apart
    assert fit.compile_counts["train"] == 1


def test_on_epoch_logging_adds_no_per_step_host_read(monkeypatch):
    """8 steps in one epoch, no log interval inside it: self.log(on_epoch=True) adds one host
    read (the epoch's end), not one per step."""
    import jax

    reads = []
    real = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda x: reads.append(1) or real(x))

    class Plain(Classifier):
        def training_step(self, model, batch):
            return super().training_step(model, batch)[0]

    class WithLog(Plain):
        def training_step(self, model, batch):
            loss = super().training_step(model, batch)
            self.log("train_loss", loss, prog_bar=True, on_epoch=True)
            return loss

    counts = []
    for cls in (Plain, WithLog):
        fit = jl.Fit("single", max_epochs=1, log_every_n_steps=100, enable_progress_bar=False,
                     enable_model_summary=False, logger=False)
        fit.fit(cls(), ArrayLoader(classification_data(256), 32))
        reads.clear()
        fit.fit(cls(), ArrayLoader(classification_data(256), 32))  # compiled: only the loop
        counts.append(len(reads))
        assert fit.global_step == 8
    assert counts[1] == counts[0] + 1, counts
