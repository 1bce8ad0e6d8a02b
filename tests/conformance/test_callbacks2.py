"""Conformance group `callbacks2`: Lightning 2.6 callbacks jaxlight carries under their names,
run beside Lightning on the same problem (fixture: tests/conformance/fixtures/callbacks2.json,
from lightning_side/callbacks2.py).

Weight averaging: the validation losses each epoch (Lightning validates the averaged weights)
and the final weights (Lightning copies the average into the module when training ends).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from tests.conformance import _data2_problem as _problem
from tests.conformance._cases import covers

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixtures" / "callbacks2.json").read_text())

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
                 enable_checkpointing=False, num_sanity_val_steps=0)
    module = Reg(prob["kernel"], prob["bias"], case["lr"], case["optimizer"])
    loader = jl.data.DataLoader
    fit.fit(module, loader({"x": prob["x"][:n], "y": prob["y"][:n]}, case["batch_size"]),
            loader({"x": prob["x"][n:], "y": prob["y"][n:]}, case["batch_size"]))
    return fit, module, record


@pytest.mark.parametrize("case_id", sorted(FIXTURE["cases"]))
@covers(
        "EMAWeightAveraging(decay)",
        "EMAWeightAveraging(update_starting_at_step)",
        "EMAWeightAveraging(update_every_n_steps)")
def test_callbacks2(case_id):
    case = FIXTURE["cases"][case_id]
    fit, module, record = run_case(case)
    assert fit.global_step == case["global_step"]
    np.testing.assert_allclose(record.losses, case["val_losses"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(module.model.kernel[...]), case["final"]["kernel"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(module.model.bias[...]), case["final"]["bias"],
                               rtol=1e-5, atol=1e-6)


CLAIMS.update({
    "timer_step_interval_stops_after_the_batch_that_reaches_it":
        "Timer(duration, interval='step') stops after the batch that reaches the limit; the "
        "epoch-end and train-end hooks still run",
    "timer_epoch_interval_stops_at_an_epoch_end":
        "Timer(interval='epoch') checks at epoch ends only",
    "max_time_string_is_a_step_timer": "Fit(max_time='DD:HH:MM:SS') is Timer(interval='step')",
    "timer_zero_duration_trains_nothing":
        "a limit already reached when the fit starts trains no step and runs no train hooks",
})


class _FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


class _Tick(callbacks.Callback):
    def __init__(self, clock, events):
        self.clock, self.events = clock, events

    def on_train_batch_start(self, fit, module, batch, batch_idx):
        self.clock.now += 10.0

    def on_train_epoch_end(self, fit, module):
        self.events.append(f"epoch_end:{fit.global_step}")

    def on_train_end(self, fit, module):
        self.events.append(f"train_end:{fit.global_step}")


@pytest.mark.parametrize("case_id", sorted(FIXTURE["timer_cases"]))
@covers("Timer(duration)",
        "Timer(interval)",
        "Fit(max_time)")
def test_callbacks2_timer(case_id, monkeypatch):
    from jaxlight.callbacks import _timer

    case = FIXTURE["timer_cases"][case_id]
    prob = _problem.make_problem(case["n"], seed=case["seed"])
    np.testing.assert_allclose(_problem.checksum(prob), case["checksum"], rtol=1e-12)
    clock, events = _FakeClock(), []
    monkeypatch.setattr(_timer, "time", clock)
    spec = case["spec"]
    extra = [callbacks.Timer(**spec["timer"])] if "timer" in spec else []
    fit = jl.Fit("single", max_epochs=case["epochs"], max_time=spec.get("max_time"),
                 callbacks=[_Tick(clock, events), *extra], enable_progress_bar=False,
                 logger=False, enable_model_summary=False, enable_checkpointing=False)
    fit.fit(Reg(prob["kernel"], prob["bias"], 0.05, "sgd"),
            jl.data.DataLoader({"x": prob["x"], "y": prob["y"]}, case["batch_size"]))
    assert fit.global_step == case["global_step"]
    assert events == case["events"]


CLAIMS["on_exception_checkpoint_resumes"] = (
    "OnExceptionCheckpoint(dirpath) saves <dirpath>/on_exception.ckpt at the step a hook "
    "raised (7), and Fit.fit(ckpt_path=that path) resumes to Lightning's step count (10). "
    "Departure (docs/porting.md, 'Resuming mid-epoch'): jaxlight resumes with the next unseen "
    "batch and ends equal to the uninterrupted run; Lightning re-reads a plain DataLoader "
    "from its start, so its resumed weights differ from its own uninterrupted run")


class _Boom(callbacks.Callback):
    def __init__(self, at_step):
        self.at_step = at_step

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        if fit.global_step == self.at_step:
            raise RuntimeError(f"boom at step {self.at_step}")


@covers("OnExceptionCheckpoint(dirpath)",
        "OnExceptionCheckpoint.ckpt_path",
        "Callback.on_exception")
def test_callbacks2_on_exception_checkpoint_resumes(tmp_path):
    case = FIXTURE["other_cases"]["on_exception_checkpoint_resumes"]
    prob = _problem.make_problem(case["n"], seed=case["seed"])
    np.testing.assert_allclose(_problem.checksum(prob), case["checksum"], rtol=1e-12)

    def fit_with(extra):
        return jl.Fit("single", max_epochs=case["epochs"], callbacks=extra,
                      enable_progress_bar=False, logger=False, enable_model_summary=False,
                      enable_checkpointing=False)

    def module():
        return Reg(prob["kernel"], prob["bias"], 0.05, "sgd")

    def loader():
        return jl.data.DataLoader({"x": prob["x"], "y": prob["y"]}, case["batch_size"])

    on_exception = callbacks.OnExceptionCheckpoint(tmp_path)
    with pytest.raises(RuntimeError, match="boom at step 7"):
        fit_with([_Boom(case["at_step"]), on_exception]).fit(module(), loader())
    assert on_exception.ckpt_path == str(tmp_path / "on_exception.ckpt" / "7")
    assert int(case["saved_global_step"]) == 7
    resumed_module = module()
    resumed = fit_with([])
    resumed.fit(resumed_module, loader(), ckpt_path=str(tmp_path / "on_exception.ckpt"))
    assert resumed.global_step == case["resumed_global_step"]
    # The departure: jaxlight's resumed run equals the uninterrupted one (Lightning's own
    # uninterrupted weights), where Lightning's resumed run re-read the epoch's first batches.
    for key in ("kernel", "bias"):
        got = np.asarray(getattr(resumed_module.model, key)[...])
        np.testing.assert_allclose(got, case["uninterrupted"][key], rtol=1e-5, atol=1e-6)
        assert not np.allclose(got, case["resumed"][key], rtol=1e-3)


for _interval in ("batch", "epoch", "batch_and_epoch"):
    CLAIMS[f"prediction_writer_{_interval}"] = (
        f"BasePredictionWriter(write_interval={_interval!r}) is called as Lightning calls it: "
        "per batch with the prediction, the examples' indices, batch_idx and dataloader_idx 0; "
        "at the end with every batch's prediction and [[indices per batch]]")


class _Writer(callbacks.BasePredictionWriter):
    def __init__(self, write_interval, calls):
        super().__init__(write_interval)
        self.calls = calls

    def write_on_batch_end(self, fit, module, prediction, batch_indices, batch, batch_idx,
                           dataloader_idx):
        self.calls.append(["batch", batch_idx, list(batch_indices), dataloader_idx,
                           np.asarray(prediction).tolist()])

    def write_on_epoch_end(self, fit, module, predictions, batch_indices):
        self.calls.append(["epoch", [np.asarray(p).tolist() for p in predictions],
                           batch_indices])


class _Predicting(Reg):
    def predict_step(self, model, batch):
        return model(batch["x"])


@pytest.mark.parametrize("interval", ["batch", "epoch", "batch_and_epoch"])
@covers("BasePredictionWriter(write_interval)",
        "BasePredictionWriter.write_on_batch_end",
        "BasePredictionWriter.write_on_epoch_end",
        "BasePredictionWriter.write_on_batch_end(prediction)",
        "BasePredictionWriter.write_on_batch_end(batch_indices)",
        "BasePredictionWriter.write_on_batch_end(batch_idx)",
        "BasePredictionWriter.write_on_batch_end(dataloader_idx)",
        "BasePredictionWriter.write_on_epoch_end(predictions)",
        "BasePredictionWriter.write_on_epoch_end(batch_indices)")
def test_callbacks2_prediction_writer(interval):
    case = FIXTURE["other_cases"][f"prediction_writer_{interval}"]
    prob = _problem.make_problem(case["n"], seed=case["seed"])
    np.testing.assert_allclose(_problem.checksum(prob), case["checksum"], rtol=1e-12)
    calls = []
    fit = jl.Fit("single", max_steps=1, callbacks=[_Writer(interval, calls)],
                 enable_progress_bar=False, logger=False, enable_model_summary=False)
    module = _Predicting(prob["kernel"], prob["bias"], 0.0, "sgd")
    module.model = module.configure_model(nnx.Rngs(0))
    returned = fit.predict(module, jl.data.DataLoader({"x": prob["x"], "y": prob["y"]},
                                                      case["batch_size"]))
    assert len(returned) == case["returned"]
    assert [c[:-1] if c[0] == "batch" else [c[0], c[2]] for c in calls] == \
        [c[:-1] if c[0] == "batch" else [c[0], c[2]] for c in case["calls"]]
    for got, want in zip(calls, case["calls"], strict=True):
        pairs = [(got[4], want[4])] if got[0] == "batch" else zip(got[1], want[1], strict=True)
        for g, w in pairs:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


CLAIMS["spike_detection_raises_at_the_spike"] = (
    "SpikeDetection(window, warmup) raises TrainingSpikeException naming the same batch (6) "
    "and writes the same skip_batches.json ([5, 6]); departure (docs/porting.md): the loss is "
    "read when the next step has been dispatched, so the exception comes one step later "
    "(global_step 8 where Lightning stops at 7)")
CLAIMS["spike_detection_tolerant_trains_on"] = (
    "with a tolerance the spike does not exceed, every step trains and nothing is written")


@pytest.mark.parametrize("case_id", ["spike_detection_raises_at_the_spike",
                                     "spike_detection_tolerant_trains_on"])
@covers("SpikeDetection(window)",
        "SpikeDetection(warmup)",
        "SpikeDetection(rtol)")
def test_callbacks2_spike_detection(case_id, tmp_path):
    case = FIXTURE["other_cases"][case_id]
    prob = _problem.make_problem(case["n"], seed=case["seed"])
    np.testing.assert_allclose(_problem.checksum(prob), case["checksum"], rtol=1e-12)
    y = prob["y"].copy()
    s = case["spike_batch"] * case["batch_size"]
    y[s:s + case["batch_size"]] *= 50
    fit = jl.Fit("single", max_epochs=case["epochs"], default_root_dir=tmp_path,
                 callbacks=[callbacks.SpikeDetection(**case["kwargs"])],
                 enable_progress_bar=False, logger=False, enable_model_summary=False,
                 enable_checkpointing=False)
    module = Reg(prob["kernel"], prob["bias"], 0.02, "sgd")
    loader = jl.data.DataLoader({"x": prob["x"], "y": y}, case["batch_size"])
    path = tmp_path / "skip_batches.json"
    if case["raised"] is None:
        fit.fit(module, loader)
        assert fit.global_step == case["global_step"] and not path.exists()
        return
    with pytest.raises(callbacks.TrainingSpikeException, match=case["raised"]) as info:
        fit.fit(module, loader)
    assert info.value.batch_idx == case["spike_batch"]
    assert json.loads(path.read_text()) == case["skip_batches"]
    assert fit.global_step == case["global_step"] + 1  # the pinned departure


CLAIMS["porting_table_lists_every_lightning_callback_and_logger"] = (
    "docs/porting.md's callback table names every callback and logger of Lightning 2.6; each "
    "is in jaxlight.callbacks or raises an AttributeError saying what to use instead")


def test_callbacks2_porting_table_lists_every_lightning_callback_and_logger():
    import re

    from jaxlight.callbacks._lightning_names import NOT_IN_JAXLIGHT

    text = (HERE.parent.parent / "docs" / "porting.md").read_text()
    section = text.split("## Lightning's callbacks and loggers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:4] for line in section.splitlines() if line.startswith("| `")]
    listed = {name: row for row in rows for name in re.findall(r"`(\w+)`", row[0])}
    names = FIXTURE["lightning_names"]
    for name in names["callbacks"] + names["loggers"]:
        assert name in listed, f"{name} is missing from porting.md's callback table"
        ours = listed[name][1].strip()
        if name in NOT_IN_JAXLIGHT:
            assert ours == "—", (name, ours)
            with pytest.raises(AttributeError, match=f"has no {name} .*porting.md"):
                getattr(callbacks, name)
        else:
            assert ours != "—", name
            assert name in callbacks.__all__, name
