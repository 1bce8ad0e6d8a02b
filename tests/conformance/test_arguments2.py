"""The callbacks' shared arguments no other group runs, beside lightning_side/arguments2.py:
BackboneFinetuning / BaseFinetuning (a backbone with BatchNorm), EarlyStopping(check_finite),
SpikeDetection's mode / atol / finite_only / exclude_batches_path, the weight averages'
avg_fn / should_update / swa_start, Timer's methods, OnExceptionCheckpoint(filename),
LambdaCallback, LearningRateMonitor(log_momentum), the learning-rate finder's and the batch-size
search's remaining arguments."""

from __future__ import annotations

import contextlib
import json
import os

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.callbacks._finetuning import param_paths
from tests.conformance._cases import case, claim, covers, departure
from tests.conformance._jaxlight import (
    Batches,
    Passes,
    Reg,
    _mse,
    assert_weights,
    batches,
    make_fit,
)

G = "arguments2"
SECTION = "Differences the coverage cases pin"

# -- fine-tuning ----------------------------------------------------------------------------------

KIND = {("backbone", "lin", "kernel"): "linear.weight", ("backbone", "lin", "bias"): "linear.bias",
        ("backbone", "bn", "scale"): "bn.weight", ("backbone", "bn", "bias"): "bn.bias",
        ("head", "kernel"): "head.weight", ("head", "bias"): "head.bias"}


class Backbone(nnx.Module):
    def __init__(self, rngs):
        init = case(G, "finetune_init")
        self.lin = nnx.Linear(4, 6, rngs=rngs)
        self.lin.kernel[...] = jnp.asarray(init["lin_w"], jnp.float32)
        self.lin.bias[...] = jnp.asarray(init["lin_b"], jnp.float32)
        self.bn = nnx.BatchNorm(6, momentum=0.9, epsilon=1e-5, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


class Net(nnx.Module):
    def __init__(self, rngs):
        init = case(G, "finetune_init")
        self.backbone = Backbone(rngs)
        self.head = nnx.Linear(6, 2, rngs=rngs)
        self.head.kernel[...] = jnp.asarray(init["head_w"], jnp.float32)
        self.head.bias[...] = jnp.asarray(init["head_b"], jnp.float32)

    def __call__(self, x):
        return self.head(self.backbone(x))


class NetModule(Reg):
    def __init__(self):
        super().__init__(G, lr=0.05)

    def configure_model(self, rngs):
        return Net(rngs)


class Unfreeze(callbacks.BaseFinetuning):
    """lightning_side's: freeze(train_bn=False), make_trainable at epoch 1, unfreeze at 2."""

    def freeze_before_training(self, module):
        self.freeze(module.model.backbone, train_bn=False)

    def finetune_function(self, module, epoch, optimizer):
        if epoch == 1:
            self.make_trainable(module.model.backbone.bn)
        if epoch == 2:
            self.unfreeze_and_add_param_group(module.model.backbone, optimizer,
                                              initial_denom_lr=5.0, train_bn=True)


class UnfreezeNoBn(callbacks.BaseFinetuning):
    """lightning_side's: freeze(train_bn=False), unfreeze(train_bn=False) at epoch 1."""

    def freeze_before_training(self, module):
        self.freeze(module.model.backbone, train_bn=False)

    def finetune_function(self, module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(module.model.backbone, optimizer, lr=0.02,
                                              train_bn=False)


def _finetune(cb):
    module = NetModule()
    fit = make_fit(max_epochs=3, callbacks=[cb])
    fit.fit(module, batches(G))
    active, lrs, _ = cb.table()
    kinds = [KIND[p] for p in param_paths(fit.state.params)]
    trainable = [sorted([k, round(float(lr), 6)] for k, on, lr in zip(kinds, a, r, strict=True)
                        if on) for a, r in zip(active, lrs, strict=True)]
    return module, trainable


def _assert_finetune(name, module, trainable):
    want = case(G, name)  # rates in float32 here: 6 digits
    assert trainable == [[[k, round(lr, 6)] for k, lr in epoch] for epoch in want["trainable"]]
    np.testing.assert_allclose(np.asarray(module.model.head.kernel[...]), want["head"],
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(module.model.backbone.lin.kernel[...]), want["linear"],
                               rtol=1e-4, atol=1e-5)


@claim("BackboneFinetuning(unfreeze_backbone_at_epoch, lambda_func, backbone_initial_ratio_lr, "
       "backbone_initial_lr, should_align, initial_denom_lr, train_bn) on a backbone with "
       "BatchNorm: the same parameters train each epoch at the same rates, to the same weights")
@covers("BackboneFinetuning(backbone_initial_ratio_lr)", "BackboneFinetuning(should_align)",
        "BackboneFinetuning(initial_denom_lr)", "BackboneFinetuning(train_bn)",
        "BackboneFinetuning(backbone_initial_lr)")
def test_backbone_finetuning_arguments():
    for name, cb in (
            ("backbone_finetuning_no_bn", callbacks.BackboneFinetuning(
                unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 2.0,
                backbone_initial_ratio_lr=0.5, should_align=False, initial_denom_lr=4.0,
                train_bn=False, verbose=True, rounding=4)),
            ("backbone_finetuning_initial_lr", callbacks.BackboneFinetuning(
                unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.02, should_align=True,
                train_bn=True))):
        _assert_finetune(name, *_finetune(cb))


@claim("BaseFinetuning's freeze(train_bn=False), make_trainable(modules) and "
       "unfreeze_and_add_param_group(lr, initial_denom_lr, train_bn=True or False) train what "
       "Lightning's do (train_bn=False leaves a frozen BatchNorm out of the new group)")
@covers("BaseFinetuning.freeze(train_bn)", "BaseFinetuning.make_trainable",
        "BaseFinetuning.make_trainable(modules)",
        "BaseFinetuning.unfreeze_and_add_param_group(initial_denom_lr)",
        "BaseFinetuning.unfreeze_and_add_param_group(train_bn)")
def test_base_finetuning_helpers():
    _assert_finetune("base_finetuning_helpers", *_finetune(Unfreeze()))
    _assert_finetune("base_finetuning_unfreeze_without_bn", *_finetune(UnfreezeNoBn()))


@departure("BackboneFinetuning(verbose=True, rounding=4) prints nothing; Lightning logs "
           "'Current lr: 0.05, Backbone lr: 0.025' each epoch from the unfreeze on, its rates "
           "rounded to `rounding` digits",
           section=SECTION)
@covers("BackboneFinetuning(verbose)", "BackboneFinetuning(rounding)")
def test_backbone_finetuning_verbose(capsys, caplog):
    want = case(G, "backbone_finetuning_no_bn")["messages"]
    assert want == ["Current lr: 0.05, Backbone lr: 0.025", "Current lr: 0.05, Backbone lr: 0.05"]
    capsys.readouterr()
    _finetune(callbacks.BackboneFinetuning(
        unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 2.0,
        backbone_initial_ratio_lr=0.5, should_align=False, initial_denom_lr=4.0,
        train_bn=False, verbose=True, rounding=4))
    out = capsys.readouterr()
    assert "Backbone lr" not in out.out + out.err + caplog.text


# -- EarlyStopping(check_finite) ------------------------------------------------------------------


@claim("EarlyStopping(check_finite=True) stops at the first non-finite value; with "
       "check_finite=False a NaN does not stop it: the same stopped_epoch and steps")
@covers("EarlyStopping(check_finite)")
def test_early_stopping_check_finite():
    want = case(G, "early_stopping_check_finite")
    x = np.asarray(case(G, "finetune_init")["lin_w"], np.float32)[:, :4] * 0 + \
        np.asarray(jl_problem_x(), np.float32)
    for flag, expected in want["runs"].items():
        stop = callbacks.EarlyStopping("val_score", patience=3, check_finite=flag == "True")
        fit = make_fit(max_epochs=len(want["values"]), callbacks=[stop], limit_train_batches=1)
        fit.fit(Reg(G), batches(G), Passes(want["values"], x))
        assert [stop.stopped_epoch, fit.global_step] == \
            [expected["stopped_epoch"], expected["global_step"]], flag


def jl_problem_x():
    from tests.conformance._cases import fixture

    return fixture(G)["problem"]["val"]["x"][:4]


# -- SpikeDetection -------------------------------------------------------------------------------


class Scored(Reg):
    def training_step(self, model, batch):
        return _mse(model, batch) * 0 + batch["score"].mean()


def _scored(scores):
    x = np.asarray(jl_problem_x(), np.float32)
    return Batches([{"x": x, "y": x[:, :2], "score": np.full((4,), s, np.float32)}
                    for s in scores])


@claim("SpikeDetection(mode='max', atol, rtol=None, window, exclude_batches_path): the same "
       "spike, message and skip file; finite_only=False: a NaN loss is no spike")
@covers("SpikeDetection(mode)", "SpikeDetection(atol)", "SpikeDetection(finite_only)",
        "SpikeDetection(exclude_batches_path)")
def test_spike_detection_arguments(tmp_path):
    for name, want in case(G, "spike_detection_arguments").items():
        path = tmp_path / name / "skips" / "skip.json"
        cb = callbacks.SpikeDetection(exclude_batches_path=path, **want["kwargs"])
        fit = make_fit(max_epochs=1, callbacks=[cb], default_root_dir=tmp_path / name)
        raised = None
        try:
            fit.fit(Scored(G), _scored(want["scores"]))
        except callbacks.TrainingSpikeException as err:
            raised = str(err)
        skipped = json.loads(path.read_text()) if path.exists() else None
        assert [raised, skipped] == [want["raised"], want["skipped"]], name


# -- weight averages ------------------------------------------------------------------------------


class OddSteps(callbacks.WeightAveraging):
    def should_update(self, step_idx):
        return step_idx % 2 == 1


@claim("StochasticWeightAveraging(avg_fn=...) averages with that function from swa_start (the "
       "same swa_start) to the same final weights; a WeightAveraging whose should_update(step_idx)"
       " picks the odd steps averages the same steps to the same weights")
@covers("StochasticWeightAveraging(avg_fn)", "StochasticWeightAveraging.avg_fn",
        "StochasticWeightAveraging.swa_start", "WeightAveraging.should_update",
        "WeightAveraging.should_update(step_idx)")
def test_averaging_arguments():
    want = case(G, "averaging")
    swa = callbacks.StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2,
                                              annealing_epochs=1,
                                              avg_fn=lambda avg, p, n: 0.25 * avg + 0.75 * p)
    module = Reg(G)
    make_fit(max_epochs=4, limit_train_batches=2, callbacks=[swa]).fit(module, batches(G))
    assert swa.swa_start == want["swa_avg_fn"]["swa_start"]
    assert_weights(module, want["swa_avg_fn"]["weights"])
    module = Reg(G)
    make_fit(max_epochs=2, limit_train_batches=3, callbacks=[OddSteps()]).fit(module, batches(G))
    assert_weights(module, want["should_update_odd_steps"]["weights"])


@departure("EMAWeightAveraging(update_starting_at_epoch=1) is refused (jaxlight updates inside "
           "the step, by step only: update_starting_at_step); Lightning starts the average at "
           "epoch 1's first step",
           section="Where jaxlight departs from Lightning on purpose")
@covers("EMAWeightAveraging(update_starting_at_epoch)")
def test_ema_update_starting_at_epoch():
    assert case(G, "averaging")["ema_from_epoch_1"]["weights"]
    with pytest.raises(jl.ConfigurationError, match="update_starting_at_step"):
        make_fit(max_epochs=2, limit_train_batches=3, callbacks=[callbacks.EMAWeightAveraging(
            decay=0.5, update_starting_at_epoch=1)]).fit(Reg(G), batches(G))


# -- Timer, OnExceptionCheckpoint, LambdaCallback, ModelCheckpoint.every_n_epochs -----------------


class Boom(Exception):
    pass


class RaiseAt(callbacks.Callback):
    def on_train_batch_end(self, fit, *args):
        if fit.global_step == 3:
            raise Boom("boom")


@claim("Timer's start_time / end_time / time_elapsed / time_remaining(stage) and verbose, "
       "OnExceptionCheckpoint(filename), LambdaCallback's hooks and "
       "ModelCheckpoint.every_n_epochs behave as Lightning's")
@covers("Timer(verbose)", "Timer.start_time", "Timer.start_time(stage)", "Timer.end_time",
        "Timer.end_time(stage)", "Timer.time_elapsed", "Timer.time_elapsed(stage)",
        "Timer.time_remaining", "Timer.time_remaining(stage)", "OnExceptionCheckpoint(filename)",
        "LambdaCallback", "ModelCheckpoint.every_n_epochs")
def test_small_callbacks(tmp_path, capsys):
    want = case(G, "small_callbacks")
    timer = callbacks.Timer(duration={"minutes": 1}, interval="epoch", verbose=False)
    make_fit(max_epochs=1, limit_train_batches=2, callbacks=[timer]).fit(
        Reg(G), batches(G), batches(G, "val"))
    got = {stage: [timer.start_time(stage) is not None, timer.end_time(stage) is not None,
                   timer.time_elapsed(stage) > 0,
                   round(timer.time_elapsed(stage) + timer.time_remaining(stage), 3)]
           for stage in ("train", "validate", "test")}
    assert got == want["timer"]
    for verbose in (True, False):
        capsys.readouterr()
        make_fit(max_epochs=1, limit_train_batches=2, callbacks=[
            callbacks.Timer(duration={"seconds": 0}, verbose=verbose)]).fit(Reg(G), batches(G))
        out = capsys.readouterr()
        assert (out.out + out.err).count("Time limit reached") == want[f"timer_verbose_{verbose}"]
    with contextlib.suppress(Boom):
        make_fit(max_epochs=1, callbacks=[callbacks.OnExceptionCheckpoint(tmp_path / "oe", "boom"),
                                          RaiseAt()]).fit(Reg(G), batches(G))
    assert sorted(f for f in os.listdir(tmp_path / "oe") if f.endswith(".ckpt")) == \
        want["on_exception_files"]
    calls = []
    hooks = callbacks.LambdaCallback(on_fit_start=lambda *a: calls.append("fit_start"),
                                     on_train_epoch_end=lambda *a: calls.append("epoch_end"))
    make_fit(max_epochs=2, limit_train_batches=1, callbacks=[hooks]).fit(Reg(G), batches(G))
    assert calls == want["lambda_calls"]
    assert callbacks.ModelCheckpoint(tmp_path / "ck", every_n_epochs=3).every_n_epochs == \
        want["checkpoint_every_n_epochs"]


# -- LearningRateMonitor(log_momentum) ------------------------------------------------------------


class Momentum(Reg):
    def configure_optimizers(self):
        return optax.inject_hyperparams(optax.sgd)(learning_rate=self.lr, momentum=0.9)


@departure("LearningRateMonitor(log_momentum=True) on SGD(momentum=0.9) logs columns named "
           "after the optax state; Lightning logs 'lr-SGD' and 'lr-SGD-momentum'",
           section=SECTION)
@covers("LearningRateMonitor(log_momentum)")
def test_lr_monitor_momentum(tmp_path):
    want = case(G, "lr_monitor_momentum")["columns"]
    assert {"lr-SGD", "lr-SGD-momentum"} <= set(want)
    logger = callbacks.CSVLogger(tmp_path)
    make_fit(max_epochs=1, limit_train_batches=2, logger=logger, log_every_n_steps=1,
             callbacks=[callbacks.LearningRateMonitor(log_momentum=True)]).fit(
        Momentum(G), batches(G))
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        columns = f.readline().strip().split(",")
    assert not {"lr-SGD", "lr-SGD-momentum"} & set(columns), columns
    assert any("momentum" in c for c in columns), columns
