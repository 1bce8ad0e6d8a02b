"""The callbacks' shared arguments no other group runs (tests/conformance/_coverage.py lists
them): BackboneFinetuning's and BaseFinetuning's (a backbone with BatchNorm), EarlyStopping's
check_finite, SpikeDetection's mode / atol / finite_only / exclude_batches_path,
StochasticWeightAveraging's avg_fn and swa_start, the weight averages' should_update and
update_starting_at_epoch, Timer's methods, OnExceptionCheckpoint's filename, LambdaCallback,
LearningRateMonitor's log_momentum, LearningRateFinder's and the Tuner's remaining arguments.
Each run is a few steps of a tiny model, with several arguments set at once."""

import contextlib
import json
import logging
import os

from _common import Batches, L, Reg, batches, problem, tmpdir, torch, trainer, write
from lightning.fabric.utilities.spike import TrainingSpikeException
from lightning.pytorch import callbacks
from lightning.pytorch.tuner import Tuner
from torch import nn

prob = problem(seed=12)
train, val = batches(prob, "train"), batches(prob, "val")
cases = {}
rng = torch.Generator().manual_seed(0)


# -- fine-tuning: a backbone (Linear 4 -> 6, BatchNorm) and a head (Linear 6 -> 2) -------------

INIT = {"lin_w": torch.randn(6, 4, generator=rng).mul(0.5), "lin_b": torch.zeros(6),
        "head_w": torch.randn(2, 6, generator=rng).mul(0.5), "head_b": torch.zeros(2)}


class Net(Reg):
    def __init__(self, prob, lr=0.05):
        super().__init__(prob, lr=lr)
        del self.layer
        self.backbone = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6))
        self.head = nn.Linear(6, 2)
        with torch.no_grad():
            self.backbone[0].weight.copy_(INIT["lin_w"])
            self.backbone[0].bias.copy_(INIT["lin_b"])
            self.head.weight.copy_(INIT["head_w"])
            self.head.bias.copy_(INIT["head_b"])

    def loss(self, batch):
        return nn.functional.mse_loss(self.head(self.backbone(batch["x"])), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)

    def kind(self, p) -> str:
        for name, q in self.named_parameters():
            if q is p:
                return {"backbone.0": "linear", "backbone.1": "bn"}.get(name[:10], "head") + \
                    "." + name.rsplit(".", 1)[1]
        raise KeyError


class Trainable(L.Callback):
    """Each epoch (at its first batch, after the fine-tuning callback's epoch start): the
    parameters the optimizer steps, as (kind, lr), sorted."""

    def __init__(self):
        self.epochs = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == 0:
            self.epochs.append(sorted(
                [module.kind(p), round(g["lr"], 9)] for g in trainer.optimizers[0].param_groups
                for p in g["params"] if p.requires_grad))


class Unfreeze(callbacks.BaseFinetuning):
    """freeze(train_bn=False), make_trainable at epoch 1, unfreeze_and_add_param_group at 2."""

    def freeze_before_training(self, module):
        self.freeze(module.backbone, train_bn=False)

    def finetune_function(self, module, epoch, optimizer):
        if epoch == 1:
            self.make_trainable(module.backbone[1])
        if epoch == 2:
            self.unfreeze_and_add_param_group(module.backbone, optimizer, initial_denom_lr=5.0,
                                              train_bn=True)


class UnfreezeNoBn(callbacks.BaseFinetuning):
    """freeze(train_bn=False) then unfreeze_and_add_param_group(train_bn=False) at epoch 1."""

    def freeze_before_training(self, module):
        self.freeze(module.backbone, train_bn=False)

    def finetune_function(self, module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(module.backbone, optimizer, lr=0.02,
                                              train_bn=False)


class Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def finetune(name, cb, epochs=3):
    seen, module, messages = Trainable(), Net(prob), Messages()
    logging.getLogger("lightning.pytorch.callbacks.finetuning").addHandler(messages)
    logging.getLogger("lightning.pytorch.callbacks.finetuning").setLevel(logging.INFO)
    trainer(tmpdir(), max_epochs=epochs, callbacks=[cb, seen]).fit(module, train)
    logging.getLogger("lightning.pytorch.callbacks.finetuning").removeHandler(messages)
    cases[name] = {"trainable": seen.epochs, "messages": messages.lines,
                   "head": module.head.weight.detach().numpy().T.tolist(),
                   "linear": module.backbone[0].weight.detach().numpy().T.tolist()}


cases["finetune_init"] = {k: v.numpy().T.tolist() for k, v in INIT.items()}  # flax layout
finetune("backbone_finetuning_no_bn", callbacks.BackboneFinetuning(
    unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 2.0, backbone_initial_ratio_lr=0.5,
    should_align=False, initial_denom_lr=4.0, train_bn=False, verbose=True, rounding=4))
finetune("backbone_finetuning_initial_lr", callbacks.BackboneFinetuning(
    unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.02, should_align=True, train_bn=True))
finetune("base_finetuning_helpers", Unfreeze())
finetune("base_finetuning_unfreeze_without_bn", UnfreezeNoBn())


# -- EarlyStopping(check_finite) ----------------------------------------------------------------

def check_finite():
    from _common import Passes

    x = torch.tensor(prob["val"]["x"][:4])
    values = [5.0, 4.0, float("nan"), 3.0, 2.5, 2.0]
    out = {}
    for flag in (True, False):
        stop = callbacks.EarlyStopping("val_score", patience=3, check_finite=flag)
        tr = trainer(tmpdir(), max_epochs=len(values), callbacks=[stop], limit_train_batches=1)
        tr.fit(Reg(prob), train, Passes(values, x))
        out[str(flag)] = {"stopped_epoch": stop.stopped_epoch, "global_step": tr.global_step}
    cases["early_stopping_check_finite"] = {"values": values, "runs": out}


# -- SpikeDetection: a loss given by the data (zero gradient) ------------------------------------

class Scored(Reg):
    def training_step(self, batch, batch_idx):
        return self.loss(batch) * 0 + batch["score"].mean()


def scored(scores):
    x = torch.tensor(prob["train"]["x"][:4])
    return Batches([{"x": x, "y": x[:, :2], "score": torch.full((4,), s)} for s in scores])


def spike():
    out = {}
    runs = {"max_atol": ([5.0, 6.0, 7.0, 6.5, 3.0, 6.0, 6.0],
                         {"mode": "max", "window": 3, "atol": 2.0, "rtol": None}),
            "nan_not_finite_only": ([1.0, 1.0, float("nan"), 1.0, 1.0],
                                    {"atol": 0.5, "rtol": None, "finite_only": False})}
    for name, (scores, kw) in runs.items():
        root = tmpdir()
        path = os.path.join(root, "skips", "skip.json")
        cb = callbacks.SpikeDetection(exclude_batches_path=path, **kw)
        tr = trainer(root, max_epochs=1, callbacks=[cb])
        raised = None
        try:
            tr.fit(Scored(prob), scored(scores))
        except TrainingSpikeException as err:
            raised = str(err)
        skipped = None
        if os.path.exists(path):
            with open(path) as f:
                skipped = json.load(f)
        out[name] = {"scores": scores, "kwargs": kw, "raised": raised, "skipped": skipped,
                     "global_step": tr.global_step}
    cases["spike_detection_arguments"] = out


# -- weight averages ------------------------------------------------------------------------------

class OddSteps(callbacks.WeightAveraging):
    def should_update(self, step_idx=None, epoch_idx=None):
        return step_idx is not None and step_idx % 2 == 1


def averaging():
    out = {}
    swa = callbacks.StochasticWeightAveraging(
        swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=1,
        avg_fn=lambda avg, p, n: 0.25 * avg + 0.75 * p)
    module = Reg(prob)
    trainer(tmpdir(), max_epochs=4, limit_train_batches=2, callbacks=[swa]).fit(module, train)
    out["swa_avg_fn"] = {"weights": module.weights(), "swa_start": swa.swa_start}
    module = Reg(prob)
    trainer(tmpdir(), max_epochs=2, limit_train_batches=3, callbacks=[OddSteps()]).fit(
        module, train)
    out["should_update_odd_steps"] = {"weights": module.weights()}
    module = Reg(prob)
    ema = callbacks.EMAWeightAveraging(decay=0.5, update_starting_at_epoch=1)
    trainer(tmpdir(), max_epochs=2, limit_train_batches=3, callbacks=[ema]).fit(module, train)
    out["ema_from_epoch_1"] = {"weights": module.weights()}
    cases["averaging"] = out


# -- Timer's methods, OnExceptionCheckpoint's filename, LambdaCallback --------------------------

class Boom(Exception):
    pass


class RaiseAt(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 3:
            raise Boom("boom")


def small_callbacks():
    timer = callbacks.Timer(duration={"minutes": 1}, interval="epoch", verbose=False)
    tr = trainer(tmpdir(), max_epochs=1, limit_train_batches=2, callbacks=[timer])
    tr.fit(Reg(prob), train, val)
    out = {"timer": {stage: [timer.start_time(stage) is not None,
                             timer.end_time(stage) is not None, timer.time_elapsed(stage) > 0,
                             round(timer.time_elapsed(stage) + timer.time_remaining(stage), 3)]
                     for stage in ("train", "validate", "test")}}
    messages = Messages()  # Timer's line goes through rank_zero_info
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addHandler(messages)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.INFO)
    for verbose in (True, False):
        trainer(tmpdir(), max_epochs=1, limit_train_batches=2, callbacks=[
            callbacks.Timer(duration={"seconds": 0}, verbose=verbose)]).fit(Reg(prob), train)
        out[f"timer_verbose_{verbose}"] = sum("Time limit reached" in m for m in messages.lines)
        messages.lines.clear()
    root = tmpdir()
    with contextlib.suppress(Boom):
        trainer(root, max_epochs=1, enable_checkpointing=True, callbacks=[
            callbacks.OnExceptionCheckpoint(root, "boom"), RaiseAt()]).fit(Reg(prob), train)
    out["on_exception_files"] = sorted(f for f in os.listdir(root) if f.endswith(".ckpt"))
    calls = []
    hooks = callbacks.LambdaCallback(on_fit_start=lambda *a: calls.append("fit_start"),
                                     on_train_epoch_end=lambda *a: calls.append("epoch_end"))
    trainer(tmpdir(), max_epochs=2, limit_train_batches=1, callbacks=[hooks]).fit(Reg(prob),
                                                                                train)
    out["lambda_calls"] = calls
    out["checkpoint_every_n_epochs"] = callbacks.ModelCheckpoint(every_n_epochs=3).every_n_epochs
    cases["small_callbacks"] = out


# -- LearningRateMonitor(log_momentum) ------------------------------------------------------------

class Momentum(Reg):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def lr_monitor():
    csv = L.loggers.CSVLogger(tmpdir())
    tr = trainer(tmpdir(), max_epochs=1, limit_train_batches=2, logger=csv, log_every_n_steps=1,
                 callbacks=[callbacks.LearningRateMonitor(log_momentum=True)])
    tr.fit(Momentum(prob), train)
    with open(os.path.join(csv.log_dir, "metrics.csv")) as f:
        columns = f.readline().strip().split(",")
    cases["lr_monitor_momentum"] = {"columns": sorted(columns)}


# -- the learning-rate finder's and the batch-size search's remaining arguments ------------------

class Named(Reg):
    """The rate as `learning_rate` (attr_name), a `bs` batch size (batch_arg_name)."""

    def __init__(self, prob, learning_rate=0.01, bs=2):
        super().__init__(prob, lr=learning_rate)
        self.learning_rate, self.bs = learning_rate, bs
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)


class DM(L.LightningDataModule):
    def __init__(self, bs=2):
        super().__init__()
        self.bs = bs

    def train_dataloader(self):
        return batches(prob, "train", self.bs)

    def val_dataloader(self):
        return batches(prob, "val", 6)


def refused(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the refusal is what the case records
        return type(err).__name__
    return None


def tuner():
    out = {}
    sweep = {"min_lr": 1e-3, "max_lr": 1.0, "num_training": 20}
    module = Named(prob)
    found = Tuner(trainer(tmpdir(), max_epochs=5)).lr_find(
        module, datamodule=DM(4), attr_name="learning_rate", method="fit", **sweep)
    out["lr_find_datamodule"] = {"lrs": found.results["lr"], "losses": found.results["loss"],
                                 "suggestion": found.suggestion(),
                                 "module_lr": module.learning_rate, "kwargs": sweep}
    module = Named(prob)
    found = Tuner(trainer(tmpdir(), max_epochs=5)).lr_find(
        module, train_dataloaders=batches(prob, "train", 4), val_dataloaders=val,
        attr_name="learning_rate", **sweep)
    out["lr_find_val_dataloaders"] = {"suggestion": found.suggestion()}
    tune = Tuner(trainer(tmpdir(), max_epochs=1))
    out["refusals"] = {
        "lr_find_method_validate": refused(lambda: tune.lr_find(
            Named(prob), datamodule=DM(4), method="validate", attr_name="learning_rate",
            num_training=3)),
        "lr_find_dataloaders_in_fit": refused(lambda: tune.lr_find(
            Named(prob), dataloaders=batches(prob, "train", 4), attr_name="learning_rate",
            num_training=3)),
        "scale_batch_size_dataloaders_in_fit": refused(lambda: tune.scale_batch_size(
            Named(prob), dataloaders=batches(prob, "train", 4), batch_arg_name="bs", max_trials=1)),
        "scale_batch_size_train_dataloaders": refused(lambda: tune.scale_batch_size(
            Named(prob), train_dataloaders=batches(prob, "train", 4), batch_arg_name="bs",
            max_trials=1)),
        "scale_batch_size_val_dataloaders": refused(lambda: tune.scale_batch_size(
            Named(prob), datamodule=DM(), val_dataloaders=val, batch_arg_name="bs", max_trials=1)),
    }
    dm, module = DM(), Named(prob)
    size = Tuner(trainer(tmpdir(), max_epochs=1)).scale_batch_size(
        module, datamodule=dm, method="fit", mode="power", steps_per_trial=1, init_val=2,
        max_trials=3, batch_arg_name="bs")
    out["scale_batch_size_datamodule"] = {"size": size, "dm_bs": dm.bs, "module_bs": module.bs,
                                          "trial_steps": module.steps}
    dm, module = DM(), Named(prob)
    finder = callbacks.BatchSizeFinder(mode="power", steps_per_trial=2, init_val=2, max_trials=2,
                                       batch_arg_name="bs")
    tr = trainer(tmpdir(), max_epochs=1, callbacks=[finder])
    tr.fit(module, datamodule=dm)
    out["batch_size_finder_bs"] = {"size": finder.optimal_batch_size, "dm_bs": dm.bs,
                                   "module_bs": module.bs, "global_step": tr.global_step}
    module = Named(prob)
    finder = callbacks.LearningRateFinder(min_lr=1e-3, max_lr=0.5, num_training_steps=15,
                                          mode="linear", early_stop_threshold=None,
                                          update_attr=False, attr_name="learning_rate")
    trainer(tmpdir(), max_epochs=2, callbacks=[finder]).fit(module, batches(prob, "train", 4))
    out["lr_finder_callback"] = {"lrs": finder.optimal_lr.results["lr"],
                                 "suggestion": finder.optimal_lr.suggestion(),
                                 "module_lr": module.learning_rate}
    cases["tuner_arguments"] = out


check_finite()
spike()
averaging()
small_callbacks()
lr_monitor()
tuner()
write("arguments2", cases, prob)
