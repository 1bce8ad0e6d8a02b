"""Conformance group `callbacks3`: Lightning 2.6 callbacks that change the training schedule
mid-run (`StochasticWeightAveraging`), run beside Lightning on the same problem (fixture:
tests/conformance/fixtures/callbacks3.json, from lightning_side/callbacks3.py).

SWA: the learning rate of every epoch (SWALR's annealing replaces the optimizer's rate and
any epoch scheduler), the validation losses (Lightning validates the current model, not the
average), the optimizer step count, and the final weights (the average, copied into the model
when training ends).
"""

from __future__ import annotations

import functools
import json
import pathlib

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.callbacks._swa import SWAState
from tests.conformance import _data2_problem as _problem
from tests.conformance._cases import covers

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixtures" / "callbacks3.json").read_text())

#: case id -> the claim it checks, in words (for the conformance table).
CLAIMS = {
    "swa_sgd_cos_from_third_epoch":
        "StochasticWeightAveraging(swa_lrs, swa_epoch_start=3, annealing_epochs=2): SWALR's "
        "cosine rates per epoch, validation of the current model, the average as final model",
    "swa_adam_linear_fraction_start":
        "a fractional swa_epoch_start (int(max_epochs * f)), linear annealing, under Adam",
    "swa_from_the_first_epoch_averages_the_initial_weights":
        "swa_epoch_start=1 averages from the initial weights; annealing_epochs=0 starts at "
        "swa_lrs",
    "swa_replaces_an_epoch_scheduler":
        "SWA's rate replaces an epoch scheduler's from its first epoch on (the rate it anneals "
        "from is the scheduled one); a last partial batch per epoch",
    "swa_default_start_and_annealing": "the defaults: swa_epoch_start=0.8, 10 annealing epochs",
}


class Reg(jl.TrainModule):
    def __init__(self, kernel, bias, lr, optimizer, gamma=None):
        super().__init__()
        self.kernel, self.bias, self.lr, self.optimizer = kernel, bias, lr, optimizer
        self.gamma = gamma

    def configure_model(self, rngs):
        layer = nnx.Linear(4, 2, rngs=rngs)
        layer.kernel[...] = self.kernel
        layer.bias[...] = self.bias
        return layer

    def configure_optimizers(self):
        tx = {"sgd": optax.sgd, "adam": optax.adam}[self.optimizer](self.lr)
        if self.gamma is None:
            return tx
        return {"optimizer": tx, "lr_scheduler": {
            "scheduler": optax.exponential_decay(1.0, 1, self.gamma), "interval": "epoch"}}

    def loss(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def training_step(self, model, batch):
        return self.loss(model, batch)

    def validation_step(self, model, batch):
        return {"loss": self.loss(model, batch)}


class Record(callbacks.Callback):
    """Validation losses, and the rate SWA's state says each epoch's steps applied (read at
    epoch ends: a test may wait for the device)."""

    def __init__(self):
        self.losses, self.lrs = [], []

    def on_validation_end(self, fit, module):
        self.losses.append(fit.callback_metrics["val_loss"])

    def on_train_epoch_end(self, fit, module):
        state = [s for s in _states(fit.state.opt_state)]
        self.lrs.append(float(state[0].lr))


def _states(opt_state):
    import jax

    is_swa = lambda x: isinstance(x, SWAState)  # noqa: E731
    return [x for x in jax.tree.leaves(opt_state, is_leaf=is_swa) if is_swa(x)]


def problem(case):
    prob = _problem.make_problem(case["n"], seed=case["seed"])
    np.testing.assert_allclose(_problem.checksum(prob), case["checksum"], rtol=1e-12)
    return prob


def loaders(case, prob):
    n, bs = case["n_train"], case["batch_size"]
    loader = jl.data.DataLoader
    return (loader({"x": prob["x"][:n], "y": prob["y"][:n]}, bs),
            loader({"x": prob["x"][n:n + 16], "y": prob["y"][n:n + 16]}, bs))


def swa_fit(case, strategy="single", max_epochs=None, extra=(), **fit_kwargs):
    record = Record()
    fit = jl.Fit(strategy, max_epochs=max_epochs or case["epochs"],
                 callbacks=[callbacks.StochasticWeightAveraging(**case["kwargs"]), record,
                            *extra],
                 enable_progress_bar=False, logger=False, enable_model_summary=False,
                 enable_checkpointing=False, num_sanity_val_steps=0, **fit_kwargs)
    return fit, record


@functools.cache
def swa_case_run(case_id):
    """`run_swa` of a swa case, once per module: its test and the resume test's uninterrupted
    run read the same fit."""
    return run_swa(FIXTURE["swa_cases"][case_id])


def run_swa(case, strategy="single"):
    prob = problem(case)
    fit, record = swa_fit(case, strategy)
    module = Reg(prob["kernel"], prob["bias"], case["lr"], case["optimizer"], case["gamma"])
    fit.fit(module, *loaders(case, prob))
    return fit, module, record


def assert_final(module, case):
    np.testing.assert_allclose(np.asarray(module.model.kernel[...]), case["final"]["kernel"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(module.model.bias[...]), case["final"]["bias"],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case_id", sorted(FIXTURE["swa_cases"]))
@covers("StochasticWeightAveraging(swa_lrs)",
        "StochasticWeightAveraging(swa_epoch_start)",
        "StochasticWeightAveraging(annealing_epochs)",
        "StochasticWeightAveraging(annealing_strategy)")
def test_callbacks3_swa(case_id):
    case = FIXTURE["swa_cases"][case_id]
    fit, module, record = swa_case_run(case_id)
    assert fit.global_step == case["global_step"]
    np.testing.assert_allclose(record.lrs, case["epoch_lrs"], rtol=1e-5)
    np.testing.assert_allclose(record.losses, case["val_losses"], rtol=1e-5)
    assert_final(module, case)


CLAIMS["swa_resumes_bitwise_across_its_start"] = (
    "a fit interrupted inside SWA (OnExceptionCheckpoint, real orbax) and resumed from that "
    "checkpoint ends with the uninterrupted run's weights, average and rates bit for bit, and "
    "Lightning's final weights")


class _Boom(callbacks.Callback):
    def __init__(self, at_step):
        self.at_step = at_step

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        if fit.global_step == self.at_step:
            raise RuntimeError(f"boom at step {self.at_step}")


def test_callbacks3_swa_resumes_bitwise_across_its_start(tmp_path):
    import jax

    case = FIXTURE["swa_cases"]["swa_sgd_cos_from_third_epoch"]
    prob = problem(case)

    def module():
        return Reg(prob["kernel"], prob["bias"], case["lr"], case["optimizer"])

    # The uninterrupted run: swa_fit(case) on module() (the case has no epoch scheduler), as
    # test_callbacks3_swa ran it.
    assert case.get("gamma") is None
    whole, _, whole_record = swa_case_run("swa_sgd_cos_from_third_epoch")
    # Step 14: the third step of epoch 2, SWA's first epoch (after its first average).
    on_exception = callbacks.OnExceptionCheckpoint(tmp_path)
    broken, _ = swa_fit(case, extra=[_Boom(14), on_exception])
    with pytest.raises(RuntimeError, match="boom at step 14"):
        broken.fit(module(), *loaders(case, prob))
    resumed_module = module()
    resumed, record = swa_fit(case)
    resumed.fit(resumed_module, *loaders(case, prob),
                ckpt_path=str(tmp_path / "on_exception.ckpt"))
    assert resumed.global_step == case["global_step"]
    assert record.lrs == whole_record.lrs[2:]
    for got, want in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_final(resumed_module, case)


CLAIMS.update({
    "accumulation_scheduler_changes_k_by_epoch":
        "GradientAccumulationScheduler({1: 2, 3: 3}): Lightning's optimizer steps per epoch, "
        "validation losses and final weights; one compiled step kind per distinct k",
    "accumulation_scheduler_short_last_group":
        "an epoch whose batches do not fill the last group of k steps on the batches left "
        "(divided by k), then k=1 again",
    "accumulation_scheduler_adam": "GradientAccumulationScheduler under Adam",
})


class EpochSteps(callbacks.Callback):
    def __init__(self):
        self.steps, self.losses = [], []

    def on_train_epoch_end(self, fit, module):
        self.steps.append(fit.global_step)

    def on_validation_end(self, fit, module):
        self.losses.append(fit.callback_metrics["val_loss"])


@pytest.mark.parametrize("case_id", sorted(FIXTURE["accumulation_cases"]))
@covers("GradientAccumulationScheduler(scheduling)")
def test_callbacks3_accumulation(case_id):
    case = FIXTURE["accumulation_cases"][case_id]
    prob = problem(case)
    scheduling = {int(k): v for k, v in case["scheduling"].items()}
    record = EpochSteps()
    fit = jl.Fit("single", max_epochs=case["epochs"],
                 callbacks=[callbacks.GradientAccumulationScheduler(scheduling), record],
                 enable_progress_bar=False, logger=False, enable_model_summary=False,
                 enable_checkpointing=False, num_sanity_val_steps=0)
    module = Reg(prob["kernel"], prob["bias"], case["lr"], case["optimizer"])
    fit.fit(module, *loaders(case, prob))
    assert fit.global_step == case["global_step"]
    assert record.steps == case["epoch_steps"]
    np.testing.assert_allclose(record.losses, case["val_losses"], rtol=1e-5)
    assert_final(module, case)
    ks = {callbacks.GradientAccumulationScheduler(scheduling).batches_at(e)
          for e in range(case["epochs"])}
    first = callbacks.GradientAccumulationScheduler(scheduling).batches_at(0)
    kinds = {k: v for k, v in fit.compile_counts.items() if k.startswith("train")}
    assert kinds == {"train": 1, **{f"train_accumulate_{k}": 1 for k in ks - {first}}}


CLAIMS["accumulation_scheduler_resumes_bitwise_across_a_k_change"] = (
    "a fit interrupted in an epoch with k=2 (OnExceptionCheckpoint) and resumed ends with the "
    "uninterrupted run's state bit for bit, and Lightning's final weights")


def test_callbacks3_accumulation_scheduler_resumes_bitwise_across_a_k_change(tmp_path):
    import jax

    case = FIXTURE["accumulation_cases"]["accumulation_scheduler_changes_k_by_epoch"]
    prob = problem(case)
    scheduling = {int(k): v for k, v in case["scheduling"].items()}

    def run(extra=(), ckpt_path=None):
        fit = jl.Fit("single", max_epochs=case["epochs"],
                     callbacks=[callbacks.GradientAccumulationScheduler(scheduling), *extra],
                     enable_progress_bar=False, logger=False, enable_model_summary=False,
                     enable_checkpointing=False, num_sanity_val_steps=0)
        module = Reg(prob["kernel"], prob["bias"], case["lr"], case["optimizer"])
        fit.fit(module, *loaders(case, prob), ckpt_path=ckpt_path)
        return fit, module

    whole, _ = run()
    # Step 7: the first accumulated step of epoch 1 (k=2), mid-epoch.
    with pytest.raises(RuntimeError, match="boom at step 7"):
        run([_Boom(7), callbacks.OnExceptionCheckpoint(tmp_path)])
    resumed, module = run(ckpt_path=str(tmp_path / "on_exception.ckpt"))
    assert resumed.global_step == case["global_step"]
    for got, want in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_final(module, case)


CLAIMS.update({
    "backbone_finetuning_adam_unfreezes_with_zero_moments":
        "BackboneFinetuning(unfreeze_backbone_at_epoch=2, lambda_func): the backbone frozen, "
        "then a new group at rate × 0.1 growing by lambda; Adam's moments and step count of "
        "the backbone start at zero when it joins (Lightning's weights, rates, val losses)",
    "backbone_finetuning_defaults_align_to_the_rate":
        "BackboneFinetuning's default doubling, aligned to the optimizer's rate",
    "base_finetuning_sgd_momentum_default_denominator":
        "a BaseFinetuning subclass: unfreeze_and_add_param_group without lr joins at the first "
        "group's rate / initial_denom_lr; SGD momentum starts from zero",
})


class Net(nnx.Module):
    def __init__(self, initial, rngs):
        self.backbone = nnx.Linear(4, 3, rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)
        for name in ("backbone", "head"):
            getattr(self, name).kernel[...] = np.asarray(initial[name]["kernel"], np.float32)
            getattr(self, name).bias[...] = np.asarray(initial[name]["bias"], np.float32)

    def __call__(self, x):
        return self.head(nnx.tanh(self.backbone(x)))


class NetModule(Reg):
    """Reg's loss and steps on the backboned network."""

    def __init__(self, initial, lr, optimizer):
        super().__init__(None, None, lr, optimizer)
        self.initial = initial

    def configure_model(self, rngs):
        return Net(self.initial, rngs)

    def configure_optimizers(self):
        if self.optimizer == "sgd_momentum":
            return optax.sgd(self.lr, momentum=0.9)
        return optax.adam(self.lr)


class UnfreezeAt(callbacks.BaseFinetuning):
    def __init__(self, epoch, lr=None):
        super().__init__()
        self.epoch, self.lr = epoch, lr

    def freeze_before_training(self, module):
        self.freeze(module.model.backbone)

    def finetune_function(self, module, epoch, optimizer):
        if epoch == self.epoch:
            self.unfreeze_and_add_param_group(module.model.backbone, optimizer, lr=self.lr)


def finetune_callback(spec):
    kwargs = dict(spec["kwargs"])
    if spec["name"] == "BackboneFinetuning":
        if kwargs.pop("lambda", None) is not None:
            kwargs["lambda_func"] = lambda epoch: 1.5
        return callbacks.BackboneFinetuning(**kwargs)
    return UnfreezeAt(**kwargs)


@functools.cache
def finetune_case_run(case_id):
    """`finetune_fit` of a finetune case, once per module: its test and the resume test's
    uninterrupted run read the same fit."""
    return finetune_fit(FIXTURE["finetune_cases"][case_id])


def finetune_fit(case, extra=(), ckpt_path=None):
    prob = problem(case)
    record = ValLoss()
    cb = finetune_callback(case["callback"])
    fit = jl.Fit("single", max_epochs=case["epochs"], callbacks=[cb, record, *extra],
                 enable_progress_bar=False, logger=False, enable_model_summary=False,
                 enable_checkpointing=False, num_sanity_val_steps=0)
    module = NetModule(case["initial"], case["lr"], case["optimizer"])
    fit.fit(module, *loaders(case, prob), ckpt_path=ckpt_path)
    return fit, module, record, cb


class ValLoss(callbacks.Callback):
    def __init__(self):
        self.losses = []

    def on_validation_end(self, fit, module):
        self.losses.append(fit.callback_metrics["val_loss"])


def assert_net(module, case):
    # atol 1e-5: on this tanh network plain Adam (no callback, 30 steps at lr 0.05) already
    # ends 4.8e-6 from torch's weights (float rounding that Adam's normalisation magnifies where
    # a gradient is near zero); a backbone whose moments did not start at zero when it joins
    # ends 1e-2 or more away (checked by breaking it).
    for name in ("backbone", "head"):
        for key in ("kernel", "bias"):
            np.testing.assert_allclose(np.asarray(getattr(getattr(module.model, name), key)[...]),
                                       case["final"][name][key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case_id", sorted(FIXTURE["finetune_cases"]))
@covers("BackboneFinetuning(unfreeze_backbone_at_epoch)",
        "BackboneFinetuning(lambda_func)",
        "BaseFinetuning.freeze",
        "BaseFinetuning.freeze(modules)",
        "BaseFinetuning.freeze_before_training",
        "BaseFinetuning.finetune_function",
        "BaseFinetuning.finetune_function(epoch)",
        "BaseFinetuning.finetune_function(optimizer)",
        "BaseFinetuning.unfreeze_and_add_param_group",
        "BaseFinetuning.unfreeze_and_add_param_group(modules)",
        "BaseFinetuning.unfreeze_and_add_param_group(optimizer)",
        "BaseFinetuning.unfreeze_and_add_param_group(lr)")
def test_callbacks3_finetune(case_id):
    case = FIXTURE["finetune_cases"][case_id]
    fit, module, record, cb = finetune_case_run(case_id)
    assert fit.global_step == case["global_step"]
    active, lrs, _ = cb.table()
    # The rate of each parameter group (groups of one rate counted once).
    got = [sorted({round(float(x), 9) for x in row[on]})
           for row, on in zip(lrs, active, strict=True)]
    want = [sorted({round(x, 9) for x in row}) for row in case["group_lrs"]]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)
    np.testing.assert_allclose(record.losses, case["val_losses"], rtol=1e-5)
    assert_net(module, case)


CLAIMS["finetuning_resumes_bitwise_across_the_unfreeze"] = (
    "a BackboneFinetuning fit interrupted after the backbone joined (OnExceptionCheckpoint) and "
    "resumed ends with the uninterrupted run's state bit for bit")


def test_callbacks3_finetuning_resumes_bitwise_across_the_unfreeze(tmp_path):
    import jax

    case = FIXTURE["finetune_cases"]["backbone_finetuning_adam_unfreezes_with_zero_moments"]
    whole, _, _, _ = finetune_case_run("backbone_finetuning_adam_unfreezes_with_zero_moments")
    # Step 14: the second step of epoch 2, the backbone's first epoch in the optimizer.
    with pytest.raises(RuntimeError, match="boom at step 14"):
        finetune_fit(case, [_Boom(14), callbacks.OnExceptionCheckpoint(tmp_path)])
    resumed, module, _, _ = finetune_fit(case, ckpt_path=str(tmp_path / "on_exception.ckpt"))
    assert resumed.global_step == case["global_step"]
    for got, want in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_net(module, case)
