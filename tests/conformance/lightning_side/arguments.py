"""The shared arguments no other group runs (tests/conformance/_coverage.py lists them): hook
arguments (batch, outputs, checkpoint, exception, a callback's state), the module's and the
trainer's properties, hyperparameters, log_dict and self.log's logger / reduce_fx / sync_dist,
ckpt_path in validate / test / predict, CSVLogger's directory, the trainer's default callbacks,
and the callbacks' remaining arguments. Each run is a few steps of the 4 -> 2 regression, and
sets several arguments at once."""

import contextlib
import os

from _common import L, Reg, batches, floats, problem, tmpdir, torch, trainer, write

prob = problem(seed=11)
train, val = batches(prob, "train"), batches(prob, "val")
cases = {}


def xsum(batch) -> float:
    return round(float(batch["x"].sum()), 4)


class Boom(Exception):
    pass


class ArgRec(L.Callback):
    """What the hooks receive: batch sums, batch indices, outputs, the checkpoint's keys, the
    exception; a state that goes through state_dict / load_state_dict."""

    def __init__(self, raise_at=None):
        self.seen, self.batches, self.raise_at, self.loaded = [], 0, raise_at, None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append(["train_batch_start", batch_idx, xsum(batch)])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.batches += 1
        self.seen.append(["train_batch_end", batch_idx, xsum(batch),
                          round(float(outputs["loss"]), 5)])
        if self.raise_at is not None and trainer.global_step == self.raise_at:
            raise Boom(f"boom at {trainer.global_step}")

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx,
                                dataloader_idx=0):
        self.seen.append(["validation_batch_end", batch_idx, xsum(batch)])

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append(["predict_batch_end", batch_idx, xsum(batch),
                          round(float(outputs.sum()), 4)])

    def on_predict_epoch_end(self, trainer, module):
        self.seen.append(["predict_epoch_end"])

    def on_exception(self, trainer, module, exception):
        self.seen.append(["exception", type(exception).__name__, str(exception)])

    def on_save_checkpoint(self, trainer, module, checkpoint):
        checkpoint["arg_rec"] = {"batches": self.batches}
        self.seen.append(["save", checkpoint["epoch"], checkpoint["global_step"]])

    def on_load_checkpoint(self, trainer, module, checkpoint):
        self.seen.append(["load", checkpoint["arg_rec"], checkpoint["epoch"],
                          checkpoint["global_step"]])

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state_dict):
        self.loaded = dict(state_dict)


class Writer(L.callbacks.BasePredictionWriter):
    def __init__(self):
        super().__init__("batch")
        self.seen = []

    def write_on_batch_end(self, trainer, module, prediction, batch_indices, batch, batch_idx,
                           dataloader_idx):
        self.seen.append([batch_idx, xsum(batch)])


class HookReg(Reg):
    """Reg recording its own hooks' arguments and properties."""

    def __init__(self, prob, lr=0.1, width=3, note="x"):
        super().__init__(prob, lr=lr)
        self.save_hyperparameters(ignore=["prob"])
        self.seen = []

    def on_train_start(self):
        self.optimizer_objects = [type(self.optimizers()).__name__, self.lr_schedulers()]

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(["train_batch_start", batch_idx, xsum(batch)])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.seen.append(["train_batch_end", batch_idx, xsum(batch),
                          round(float(outputs["loss"]), 5), self.global_step,
                          self.current_epoch, self.trainer.global_step])

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append(["validation_batch_end", batch_idx, xsum(batch)])

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.seen.append(["predict_batch_end", batch_idx, xsum(batch),
                          round(float(outputs.sum()), 4)])

    def on_predict_epoch_end(self):
        self.seen.append(["predict_epoch_end"])

    def on_save_checkpoint(self, checkpoint):
        checkpoint["module_note"] = self.global_step

    def on_load_checkpoint(self, checkpoint):
        self.seen.append(["load", checkpoint["module_note"]])


def hook_arguments():
    root = tmpdir()
    rec, module = ArgRec(), HookReg(prob, width=5)
    ck = L.callbacks.ModelCheckpoint(os.path.join(root, "ck"))
    tr = trainer(root, max_epochs=1, limit_train_batches=3, limit_val_batches=2,
                 callbacks=[rec, ck])
    tr.fit(module, train, val)
    out = {"callback": rec.seen, "module": module.seen, "hparams": dict(module.hparams),
           "state_key": rec.state_key}
    cases["module_optimizer_objects"] = module.optimizer_objects
    rec2, module2 = ArgRec(), HookReg(prob, width=5)
    tr = trainer(root, max_epochs=2, limit_train_batches=3, limit_val_batches=2,
                 callbacks=[rec2, L.callbacks.ModelCheckpoint(os.path.join(root, "ck2"))])
    tr.fit(module2, train, val, ckpt_path=ck.best_model_path)
    out["resumed_callback"], out["resumed_module"] = rec2.seen, module2.seen
    out["loaded_state"] = rec2.loaded
    rec3, module3, writer = ArgRec(), HookReg(prob), Writer()
    trainer(root, callbacks=[rec3, writer]).predict(module3, batches(prob, "val", batch_size=5))
    out["predict_callback"], out["predict_module"] = rec3.seen, module3.seen
    out["writer_batches"] = writer.seen
    rec4 = ArgRec(raise_at=2)
    with contextlib.suppress(Boom):
        trainer(root, max_epochs=1, callbacks=[rec4]).fit(HookReg(prob), train)
    out["exception_callback"] = [s for s in rec4.seen if s[0] == "exception"]
    cases["hook_arguments"] = out


class DM(L.LightningDataModule):
    def __init__(self, prob, batch_size=4, tag="t"):
        super().__init__()
        self.save_hyperparameters(ignore=["prob"])
        self.prob, self.loaded = prob, []

    def train_dataloader(self):
        return batches(self.prob, "train", self.hparams.batch_size)

    def state_dict(self):
        return {"passes": 7}

    def load_state_dict(self, state_dict):
        self.loaded.append(dict(state_dict))


def datamodule_state():
    root = tmpdir()
    ck = L.callbacks.ModelCheckpoint(os.path.join(root, "ck"), save_last=True)
    dm = DM(prob, batch_size=8)
    trainer(root, max_epochs=1, callbacks=[ck]).fit(Reg(prob), datamodule=dm)
    dm2 = DM(prob, batch_size=8)
    trainer(root, max_epochs=2).fit(Reg(prob), datamodule=dm2, ckpt_path=ck.last_model_path)
    cases["datamodule_state"] = {"hparams": dict(dm.hparams), "loaded": dm2.loaded}


class LogDict(Reg):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log_dict({"a": loss, "b": 2 * loss}, prog_bar=True, on_step=True, on_epoch=True,
                      batch_size=4, sync_dist=True)
        self.log_dict({"c": 3 * loss}, logger=False, on_step=False, on_epoch=True)
        self.log("hidden", loss, logger=False)
        self.log("synced", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss


class Reduce(Reg):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log_dict({"c": 3 * loss}, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("peak", loss, on_step=False, on_epoch=True, reduce_fx="max")
        self.log("low", loss, on_step=False, on_epoch=True, reduce_fx="min")
        return loss


def log_arguments():
    for name, cls in (("log_arguments", LogDict), ("log_reduce_fx", Reduce)):
        tr = trainer(tmpdir(), max_epochs=2)
        tr.fit(cls(prob), train)
        cases[name] = {"logged": floats(tr.logged_metrics),
                       "callback": floats(tr.callback_metrics),
                       "prog_bar": sorted(tr.progress_bar_metrics)}


def ckpt_path_in_evaluation():
    root = tmpdir()
    ck = L.callbacks.ModelCheckpoint(os.path.join(root, "ck"), monitor="val_loss", save_last=True)
    module = Reg(prob)
    tr = trainer(root, max_epochs=3, callbacks=[ck])
    tr.fit(module, train, val)
    first = Reg(prob)  # untrained: each ckpt_path loads the weights the case names
    out = {"best_step": int(torch.load(ck.best_model_path, weights_only=False)["global_step"])}
    out["validate_best"] = tr.validate(first, val, ckpt_path="best", verbose=False)[0]
    out["test_last"] = tr.test(first, val, ckpt_path="last", verbose=False)[0]
    pred = tr.predict(first, batches(prob, "val", 6), ckpt_path=ck.best_model_path)
    out["predict_best"] = round(float(sum(p.sum() for p in pred)), 4)
    cases["ckpt_path_in_evaluation"] = out


class Loggers(Reg):
    def on_train_end(self):
        self.loggers_seen = [type(self.logger).__name__, [type(x).__name__ for x in self.loggers]]


def csv_logger_and_trainer_properties():
    root = tmpdir()
    csv = L.loggers.CSVLogger(os.path.join(root, "logs"), name="exp", version="v7")
    tr = trainer(root, max_epochs=1, logger=csv, log_every_n_steps=3)
    module = Loggers(prob)
    tr.fit(module, train)
    cases["module_loggers"] = module.loggers_seen
    with open(os.path.join(csv.log_dir, "metrics.csv")) as f:
        header = f.readline().strip().split(",")
        rows = [line.strip().split(",") for line in f if line.strip()]
    rel = lambda p: os.path.relpath(p, root)  # noqa: E731
    cases["csv_logger"] = {
        "log_dir": rel(csv.log_dir), "save_dir": rel(csv.save_dir), "name": csv.name,
        "version": csv.version, "trainer_log_dir": rel(tr.log_dir), "columns": sorted(header),
        "train_loss": [round(float(r[header.index("train_loss")]), 5) for r in rows
                       if r[header.index("train_loss")]],
        "default_root_dir": rel(tr.default_root_dir), "is_global_zero": tr.is_global_zero,
        "max_epochs": tr.max_epochs, "max_steps": tr.max_steps}
    tr = trainer(root, max_steps=5)
    cases["csv_logger"]["max_steps_only"] = [tr.max_epochs, tr.max_steps]


def trainer_callbacks():
    """Which callbacks each switch adds (type names, sorted; the checkpoint off: jaxlight adds
    none by default, another case)."""
    out = {}
    for name, kw in {"defaults": {}, "no_bar": {"enable_progress_bar": False},
                     "no_summary": {"enable_model_summary": False},
                     "user": {"callbacks": [L.callbacks.EarlyStopping("val_loss")],
                              "enable_progress_bar": False}}.items():
        tr = L.Trainer(default_root_dir=tmpdir(), enable_checkpointing=False, logger=False, **kw)
        out[name] = sorted(type(c).__name__ for c in tr.callbacks)
    out["strategy"] = type(tr.strategy).__name__
    cases["trainer_callbacks"] = out


hook_arguments()
datamodule_state()
log_arguments()
ckpt_path_in_evaluation()
csv_logger_and_trainer_properties()
trainer_callbacks()
write("arguments", cases, prob)
