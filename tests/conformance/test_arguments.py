"""The shared arguments no other group runs, beside lightning_side/arguments.py: hook arguments
(batch, outputs, checkpoint, exception, a callback's state), hyperparameters, a DataModule's
state, log_dict and self.log's logger / reduce_fx / sync_dist, ckpt_path in validate / test /
predict, CSVLogger's directory and the trainer's properties, the callbacks each switch adds."""

from __future__ import annotations

import contextlib
import copy
import csv
import os

import numpy as np
import pytest

import jaxlight as jl
from jaxlight import callbacks
from tests.conformance._cases import assert_sequence, case, claim, covers, departure
from tests.conformance._jaxlight import RTOL, Reg, _mse, batches, make_fit

G = "arguments"


def xsum(batch) -> float:
    return round(float(np.asarray(batch["x"]).sum()), 4)


class Boom(Exception):
    pass


class ArgRec(callbacks.Callback):
    """lightning_side/arguments.py's ArgRec."""

    def __init__(self, raise_at=None):
        self.seen, self.batches, self.raise_at, self.loaded = [], 0, raise_at, None

    def on_train_batch_start(self, fit, module, batch, batch_idx):
        self.seen.append(["train_batch_start", batch_idx, xsum(batch)])

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        self.batches += 1
        self.seen.append(["train_batch_end", batch_idx, xsum(batch),
                          round(float(outputs["loss"]), 5)])
        if self.raise_at is not None and fit.global_step == self.raise_at:
            raise Boom(f"boom at {fit.global_step}")

    def on_validation_batch_end(self, fit, module, batch, batch_idx):
        self.seen.append(["validation_batch_end", batch_idx, xsum(batch)])

    def on_predict_batch_end(self, fit, module, outputs, batch, batch_idx):
        self.seen.append(["predict_batch_end", batch_idx, xsum(batch),
                          round(float(np.asarray(outputs).sum()), 4)])

    def on_predict_epoch_end(self, fit, module):
        self.seen.append(["predict_epoch_end"])

    def on_exception(self, fit, module, exception):
        self.seen.append(["exception", type(exception).__name__, str(exception)])

    def on_save_checkpoint(self, fit, module, checkpoint):
        checkpoint["arg_rec"] = {"batches": self.batches}
        self.seen.append(["save", checkpoint["epoch"], checkpoint.get("global_step")])

    def on_load_checkpoint(self, fit, module, checkpoint):
        self.seen.append(["load", checkpoint["arg_rec"], checkpoint["epoch"],
                          checkpoint.get("global_step")])

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.loaded = dict(state)


class Writer(callbacks.BasePredictionWriter):
    def __init__(self):
        super().__init__("batch")
        self.seen = []

    def write_on_batch_end(self, fit, module, prediction, batch_indices, batch, batch_idx,
                           dataloader_idx):
        self.seen.append([batch_idx, xsum(batch)])


class HookReg(Reg):
    def __init__(self, lr=0.1, width=3, note="x"):
        super().__init__(G, lr=lr)
        self.save_hyperparameters()
        self.seen = []

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(["train_batch_start", batch_idx, xsum(batch)])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(["train_batch_end", batch_idx, xsum(batch),
                          round(float(outputs["loss"]), 5), self.global_step,
                          self.current_epoch, self.trainer.global_step])

    def on_validation_batch_end(self, batch, batch_idx):
        self.seen.append(["validation_batch_end", batch_idx, xsum(batch)])

    def on_predict_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(["predict_batch_end", batch_idx, xsum(batch),
                          round(float(np.asarray(outputs).sum()), 4)])

    def on_predict_epoch_end(self):
        self.seen.append(["predict_epoch_end"])

    def on_save_checkpoint(self, checkpoint):
        checkpoint["module_note"] = self.global_step

    def on_load_checkpoint(self, checkpoint):
        self.seen.append(["load", checkpoint["module_note"]])


def _hook_runs(tmp_path):
    rec, module = ArgRec(), HookReg(width=5)
    ck = callbacks.ModelCheckpoint(tmp_path / "ck")
    make_fit(max_epochs=1, limit_train_batches=3, limit_val_batches=2,
             callbacks=[rec, ck]).fit(module, batches(G), batches(G, "val"))
    out = {"callback": rec.seen, "module": module.seen, "hparams": dict(module.hparams),
           "state_key": rec.state_key}
    rec2, module2 = ArgRec(), HookReg(width=5)
    make_fit(max_epochs=2, limit_train_batches=3, limit_val_batches=2,
             callbacks=[rec2, callbacks.ModelCheckpoint(tmp_path / "ck2")]).fit(
        module2, batches(G), batches(G, "val"), ckpt_path=ck.best_model_path or "last")
    out["resumed_callback"], out["resumed_module"] = rec2.seen, module2.seen
    out["loaded_state"] = rec2.loaded
    rec3, module3, writer = ArgRec(), HookReg(), Writer()
    make_fit(callbacks=[rec3, writer]).predict(module3, batches(G, "val", batch_size=5))
    out["predict_callback"], out["predict_module"] = rec3.seen, module3.seen
    out["writer_batches"] = writer.seen
    rec4 = ArgRec(raise_at=2)
    with contextlib.suppress(Boom):
        make_fit(max_epochs=1, callbacks=[rec4]).fit(HookReg(), batches(G))
    out["exception_callback"] = [s for s in rec4.seen if s[0] == "exception"]
    return out


@claim("hooks receive Lightning's arguments: each batch and batch_idx, the step's loss as "
       "outputs['loss'], predictions as outputs, the exception; a module's global_step, "
       "current_epoch and trainer.global_step in on_train_batch_end; a callback's state_dict "
       "comes back through load_state_dict under its state_key; keys a hook writes into the "
       "checkpoint come back in on_load_checkpoint; hyperparameters from save_hyperparameters")
@covers("Callback.on_train_batch_start(batch)", "Callback.on_train_batch_end(batch)",
        "Callback.on_train_batch_end(outputs)", "Callback.on_validation_batch_end(batch)",
        "Callback.on_predict_batch_end", "Callback.on_predict_batch_end(batch)",
        "Callback.on_predict_batch_end(batch_idx)", "Callback.on_predict_batch_end(outputs)",
        "Callback.on_predict_epoch_end", "Callback.on_exception(exception)",
        "Callback.on_save_checkpoint(checkpoint)", "Callback.on_load_checkpoint(checkpoint)",
        "Callback.state_dict", "Callback.load_state_dict", "Callback.state_key",
        "TrainModule.on_train_batch_start(batch)", "TrainModule.on_train_batch_end(batch)",
        "TrainModule.on_train_batch_end(outputs)", "TrainModule.on_validation_batch_end(batch)",
        "TrainModule.on_predict_batch_end", "TrainModule.on_predict_batch_end(batch)",
        "TrainModule.on_predict_batch_end(batch_idx)",
        "TrainModule.on_predict_batch_end(outputs)", "TrainModule.on_predict_epoch_end",
        "TrainModule.on_save_checkpoint(checkpoint)",
        "TrainModule.on_load_checkpoint(checkpoint)", "TrainModule.global_step",
        "TrainModule.current_epoch", "TrainModule.trainer", "TrainModule.hparams",
        "TrainModule.save_hyperparameters", "BasePredictionWriter.write_on_batch_end(batch)")
def test_hook_arguments(tmp_path):
    got, want = _hook_runs(tmp_path), copy.deepcopy(case(G, "hook_arguments"))
    for key in sorted(want):
        if isinstance(want[key], list):
            assert_sequence(got[key], want[key], key)
        else:
            assert got[key] == want[key], key


@claim("the checkpoint dict that on_save_checkpoint / on_load_checkpoint receive holds "
       "Lightning's 'epoch' and 'global_step' (0 and 3 after 3 batches) and the "
       "hyperparameters under Lightning's 'hyper_parameters'")
@covers("Callback.on_save_checkpoint(checkpoint)", "Callback.on_load_checkpoint(checkpoint)",
        "TrainModule.on_save_checkpoint(checkpoint)", "TrainModule.on_load_checkpoint(checkpoint)")
def test_checkpoint_global_step_key(tmp_path):
    want = case(G, "hook_arguments")
    saves = [s for s in want["callback"] if s[0] == "save"]
    loads = [s for s in want["resumed_callback"] if s[0] == "load"]
    assert saves == [["save", 0, 3]] and [s[2:] for s in loads] == [[0, 3]]

    class Keys(callbacks.Callback):
        seen = []

        def on_save_checkpoint(self, fit, module, checkpoint):
            self.seen.append(("save", *(checkpoint.get(k) for k in (
                "epoch", "global_step", "hyper_parameters"))))

        def on_load_checkpoint(self, fit, module, checkpoint):
            self.seen.append(("load", *(checkpoint.get(k) for k in (
                "epoch", "global_step", "hyper_parameters"))))

    ck, hparams = callbacks.ModelCheckpoint(tmp_path), {"lr": 0.1, "width": 3, "note": "x"}
    make_fit(max_epochs=1, limit_train_batches=3, callbacks=[Keys(), ck]).fit(
        HookReg(), batches(G))
    make_fit(max_epochs=1, limit_train_batches=3, callbacks=[Keys()]).fit(
        HookReg(), batches(G), ckpt_path=ck.last_model_path)
    assert Keys.seen == [("save", 0, 3, hparams), ("load", 0, 3, hparams)]


class DM(jl.DataModule):
    def __init__(self, group, batch_size=4, tag="t"):
        super().__init__()
        self.save_hyperparameters(ignore=["group"])
        self.group, self.loaded = group, []

    def train_dataloader(self):
        return batches(self.group, "train", self.hparams.batch_size)

    def state_dict(self):
        return {"passes": 7}

    def load_state_dict(self, state):
        self.loaded.append(dict(state))


@claim("a DataModule's save_hyperparameters(ignore=...) keeps Lightning's hparams, and its "
       "state_dict comes back through load_state_dict when a fit resumes")
@covers("DataModule.hparams", "DataModule.save_hyperparameters",
        "DataModule.save_hyperparameters(ignore)", "DataModule.load_state_dict",
        "TrainModule.save_hyperparameters(ignore)")
def test_datamodule_state(tmp_path):
    want = case(G, "datamodule_state")
    ck = callbacks.ModelCheckpoint(tmp_path / "ck")
    dm = DM(G, batch_size=8)
    make_fit(max_epochs=1, callbacks=[ck]).fit(Reg(G), datamodule=dm)
    dm2 = DM(G, batch_size=8)
    make_fit(max_epochs=2).fit(Reg(G), datamodule=dm2, ckpt_path=ck.last_model_path)
    assert dict(dm.hparams) == want["hparams"]
    assert dm2.loaded == want["loaded"]

    class Ignoring(Reg):  # TrainModule's ignore=, as HookReg's in the Lightning script
        def __init__(self, group=G, width=3):
            super().__init__(group)
            self.save_hyperparameters(ignore=["group"])

    assert dict(Ignoring(width=5).hparams) == {"width": 5}


class LogDict(Reg):
    def training_step(self, model, batch):
        loss = _mse(model, batch)
        self.log_dict({"a": loss, "b": 2 * loss}, prog_bar=True, on_step=True, on_epoch=True,
                      batch_size=4, sync_dist=True)
        self.log_dict({"c": 3 * loss}, logger=False, on_step=False, on_epoch=True)
        self.log("hidden", loss, logger=False)
        self.log("synced", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


class Reduce(Reg):
    def training_step(self, model, batch):
        loss = _mse(model, batch)
        self.log_dict({"c": 3 * loss}, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("peak", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("low", loss, on_step=False, on_epoch=True, reduce_fx="min")
        return loss


@claim("log_dict(dictionary, prog_bar, on_step, on_epoch, batch_size, sync_dist) and "
       "log(sync_dist=True) give Lightning's logged, callback and progress-bar metrics")
@covers("TrainModule.log_dict", "TrainModule.log_dict(dictionary)",
        "TrainModule.log_dict(prog_bar)", "TrainModule.log_dict(on_step)",
        "TrainModule.log_dict(on_epoch)", "TrainModule.log_dict(batch_size)",
        "TrainModule.log_dict(sync_dist)", "TrainModule.log(sync_dist)")
def test_log_arguments():
    want = case(G, "log_arguments")
    fit = make_fit(max_epochs=2)
    fit.fit(LogDict(G), batches(G))
    for what, got in (("logged", fit.logged_metrics), ("callback", fit.callback_metrics)):
        # 'loss': the pinned departure of the metrics group
        got = {k: v for k, v in got.items() if k != "loss"}
        assert sorted(got) == sorted(want[what]), what
        np.testing.assert_allclose([got[k] for k in sorted(got)],
                                   [want[what][k] for k in sorted(got)], rtol=RTOL, err_msg=what)
    assert sorted(fit.progress_bar_metrics) == want["prog_bar"]


@claim("self.log(..., logger=False) and log_dict(..., logger=False) keep the values out of "
       "the loggers and fit.logged_metrics; callback_metrics has them, as Lightning's")
@covers("TrainModule.log(logger)", "TrainModule.log_dict(logger)")
def test_log_logger_false(tmp_path):
    want = case(G, "log_arguments")
    assert {"c", "hidden"} <= set(want["callback"]) and not {"c", "hidden"} & set(want["logged"])
    csv = callbacks.CSVLogger(str(tmp_path))
    fit = make_fit(max_epochs=2, logger=csv)
    fit.fit(LogDict(G), batches(G))
    assert {"c", "hidden"} <= set(fit.callback_metrics)
    assert not {"c", "hidden"} & set(fit.logged_metrics)
    assert not {"c", "hidden"} & {k for _, row in csv.rows for k in row}


@claim("self.log / log_dict(reduce_fx='max' or 'min') in a training step log the epoch's "
       "max / min, as Lightning (peak 0.890, low 0.104, c 2.671 in the second epoch)")
@covers("TrainModule.log(reduce_fx)", "TrainModule.log_dict(reduce_fx)")
def test_log_reduce_fx():
    want = case(G, "log_reduce_fx")
    assert want["callback"]["peak"] > want["callback"]["low"]
    fit = make_fit(max_epochs=2)
    fit.fit(Reduce(G), batches(G))
    for what, got in (("logged", fit.logged_metrics), ("callback", fit.callback_metrics)):
        got = {k: v for k, v in got.items() if k != "loss"}  # the metrics group's departure
        assert sorted(got) == sorted(want[what]), what
        np.testing.assert_allclose([got[k] for k in sorted(got)],
                                   [want[what][k] for k in sorted(got)], rtol=RTOL, err_msg=what)
    assert sorted(fit.progress_bar_metrics) == want["prog_bar"]


@claim("validate(ckpt_path='best'), test(ckpt_path='last') and predict(ckpt_path=a path) "
       "evaluate the weights of the checkpoint named, as Lightning")
@covers("Fit.validate(ckpt_path)", "Fit.test(ckpt_path)", "Fit.predict(ckpt_path)",
        "TrainModule.predict_step", "Fit.predict")
def test_ckpt_path_in_evaluation(tmp_path):
    want = case(G, "ckpt_path_in_evaluation")
    ck = callbacks.ModelCheckpoint(tmp_path / "ck", monitor="val_loss", save_last=True)
    fit = make_fit(max_epochs=3, callbacks=[ck])
    fit.fit(Reg(G), batches(G), batches(G, "val"))
    assert fit.global_step == want["best_step"] and ck.best_model_path.endswith(
        str(want["best_step"]))
    first = Reg(G)
    np.testing.assert_allclose(
        fit.validate(first, batches(G, "val"), ckpt_path="best")["val_loss"],
        want["validate_best"]["val_loss"], rtol=RTOL)
    np.testing.assert_allclose(fit.test(first, batches(G, "val"), ckpt_path="last")["test_loss"],
                               want["test_last"]["test_loss"], rtol=RTOL)
    pred = fit.predict(first, batches(G, "val", 6), ckpt_path=ck.best_model_path)
    np.testing.assert_allclose(round(float(sum(np.asarray(p).sum() for p in pred)), 4),
                               want["predict_best"], rtol=1e-4)


class Loggers(Reg):
    def on_train_end(self):
        self.loggers_seen = [type(self.logger).__name__, [type(x).__name__ for x in self.loggers]]


def _csv_run(tmp_path):
    logger = callbacks.CSVLogger(tmp_path / "logs", name="exp", version="v7")
    fit = make_fit(max_epochs=1, logger=logger, log_every_n_steps=3, default_root_dir=tmp_path)
    module = Loggers(G)
    fit.fit(module, batches(G))
    assert module.loggers_seen == case(G, "module_loggers")
    rel = lambda p: os.path.relpath(p, tmp_path)  # noqa: E731
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    for row in rows:  # the returned loss, logged as 'loss': a pinned departure (metrics group)
        row.pop("loss", None)
    return {"log_dir": rel(logger.log_dir), "save_dir": rel(logger.save_dir),
            "name": logger.name, "version": logger.version, "trainer_log_dir": rel(fit.log_dir),
            "columns": sorted(rows[0]),
            "train_loss": [round(float(r["train_loss"]), 5) for r in rows if r["train_loss"]],
            "default_root_dir": rel(fit.default_root_dir), "is_global_zero": fit.is_global_zero,
            "max_epochs": fit.max_epochs, "max_steps": fit.max_steps,
            "max_steps_only": [make_fit(max_steps=5).max_epochs, make_fit(max_steps=5).max_steps]}


#: What test_csv_logger_differences pins (the rest of the run equals Lightning's).
CSV_DIFFERENCES = ("log_dir", "trainer_log_dir")


@claim("CSVLogger(save_dir, name, version): the same save_dir, name, version and columns; the "
       "same train_loss rows under log_every_n_steps=3 over 8 steps (steps 3 and 6, none for "
       "the last); the module's logger and loggers; the Fit's default_root_dir, "
       "is_global_zero, max_epochs, and max_steps (-1 when not given)")
@covers("CSVLogger(save_dir)", "CSVLogger(name)", "CSVLogger.save_dir", "CSVLogger.name",
        "CSVLogger.version", "Fit(logger)", "Fit(log_every_n_steps)", "Fit(default_root_dir)",
        "Fit.default_root_dir", "Fit.is_global_zero", "Fit.max_epochs", "Fit.max_steps",
        "TrainModule.logger", "TrainModule.loggers")
def test_csv_logger(tmp_path):
    got, want = _csv_run(tmp_path), case(G, "csv_logger")
    diffs = {k: (got[k], want[k]) for k in sorted(want)
             if k not in CSV_DIFFERENCES and got[k] != want[k]}
    assert not diffs, diffs


@departure("CSVLogger(version='v7') writes to <save_dir>/<name>/version_v7 (Lightning: .../v7, a "
           "str version is the directory's name); Fit.log_dir is the default_root_dir "
           "(Lightning's trainer.log_dir is the logger's log_dir)",
           section="Differences the coverage cases pin")
@covers("CSVLogger(version)", "CSVLogger.log_dir", "Fit.log_dir")
def test_csv_logger_differences(tmp_path):
    got, want = _csv_run(tmp_path), case(G, "csv_logger")
    assert want["log_dir"] == want["trainer_log_dir"] == os.path.join("logs", "exp", "v7")
    assert (got["log_dir"], got["trainer_log_dir"]) == (os.path.join("logs", "exp", "version_v7"),
                                                        ".")


@claim("enable_progress_bar, enable_model_summary and callbacks add the callbacks Lightning's "
       "Trainer adds (a TQDMProgressBar, a ModelSummary, the user's)")
@covers("Fit(enable_progress_bar)", "Fit(enable_model_summary)", "Fit(callbacks)")
def test_trainer_callbacks():
    want = case(G, "trainer_callbacks")
    shown = {"ModelSummary", "TQDMProgressBar", "EarlyStopping"}
    for name, kw in {"defaults": {}, "no_bar": {"enable_progress_bar": False},
                     "no_summary": {"enable_model_summary": False},
                     "user": {"callbacks": [callbacks.EarlyStopping("val_loss")],
                              "enable_progress_bar": False}}.items():
        fit = jl.Fit("single", max_epochs=1, logger=False, **kw)
        got = sorted(type(c).__name__ for c in fit.callbacks if type(c).__name__ in shown)
        assert got == want[name], name


@departure("self.optimizers(), lr_schedulers(), toggle_optimizer(), untoggle_optimizer() and "
           "manual_backward() raise a PortingError naming the jaxlight form (the step takes an "
           "`opt` argument under automatic_optimization = False); Lightning's return its "
           "optimizer objects (measured in on_train_start: LightningSGD, None)",
           section="What jaxlight refuses")
@covers("TrainModule.optimizers", "TrainModule.lr_schedulers", "TrainModule.toggle_optimizer",
        "TrainModule.untoggle_optimizer", "TrainModule.manual_backward")
def test_module_optimizer_objects():
    assert case(G, "module_optimizer_objects") == ["LightningSGD", None]
    names = ("optimizers", "lr_schedulers", "toggle_optimizer", "untoggle_optimizer",
             "manual_backward")

    class Asks(Reg):
        def on_train_start(self):
            self.refused = []
            for name in names:
                with pytest.raises(jl.PortingError, match="automatic_optimization = False"):
                    getattr(self, name)(*(() if name in names[:2] else (None,)))
                self.refused.append(name)

    module = Asks(G)
    make_fit(max_epochs=1, limit_train_batches=1).fit(module, batches(G))
    assert module.refused == list(names)


@departure("Fit.strategy is a jaxlight strategy (JAX sharding: SingleDevice, DataParallel, "
           "FSDP, ...); Lightning's trainer.strategy is a torch one (SingleDeviceStrategy)",
           section="Differences the coverage cases pin")
@covers("Fit.strategy")
def test_fit_strategy_object():
    assert case(G, "trainer_callbacks")["strategy"] == "SingleDeviceStrategy"
    assert type(make_fit(max_epochs=1).strategy).__name__ == "SingleDevice"
