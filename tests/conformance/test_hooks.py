"""Hook order: Lightning's `tests_pytorch/models/test_hooks.py`, every case that maps.

Mapping: `test_trainer_model_hook_system_fit` -> fit_one_epoch, fit_two_epochs, fit_no_val,
fit_checkpoint_every_epoch and the sanity-check departure; `..._fit_no_val_and_resume_max_epochs`
/ `_max_steps` -> resume_max_epochs / resume_max_steps; `test_trainer_model_hook_system_eval`
-> validate_/test_{2,0}_batches; `..._predict` -> predict_2_batches;
`test_on_before_zero_grad_called` -> optimizer_steps_max_steps_*;
`test_trainer_datamodule_hook_system` -> datamodule_*; `test_train_eval_mode_restored` and
`test_load_from_checkpoint_hook_calls` -> the mode cases. Not mapped: the hooks jaxlight does
not have (`on_before_backward`, `on_before_zero_grad`, `configure_callbacks`,
`transfer_batch_to_device`, `on_*_model_eval`, the per-batch test/predict hooks): sequences are
compared on the hooks both have (`_problem.COMPARED_HOOKS`).
"""

from __future__ import annotations

import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from tests.conformance._cases import (
    assert_sequence,
    case,
    claim,
    covers,
    departure,
)
from tests.conformance._jaxlight import Batches, Recorder, Reg, batches, hooked, make_fit

G = "hooks"


def _fit_calls(checkpoint=None, val=True, **kw):
    calls, module = hooked()
    cbs = [Recorder(calls)] + ([checkpoint] if checkpoint else [])
    make_fit(callbacks=cbs, **kw).fit(module, batches(G), batches(G, "val") if val else None)
    return calls


@claim("fit's hooks run in Lightning's order for one epoch with validation "
       "(validation before on_train_epoch_end)")
@covers("Fit.fit",
        "Callback.setup",
        "Callback.setup(stage)",
        "Callback.teardown",
        "Callback.teardown(stage)",
        "Callback.on_fit_start",
        "Callback.on_fit_end",
        "Callback.on_train_start",
        "Callback.on_train_end",
        "Callback.on_train_epoch_start",
        "Callback.on_train_epoch_end",
        "Callback.on_train_batch_start",
        "Callback.on_train_batch_start(batch_idx)",
        "Callback.on_train_batch_end",
        "Callback.on_train_batch_end(batch_idx)",
        "Callback.on_validation_start",
        "Callback.on_validation_end",
        "Callback.on_validation_epoch_start",
        "Callback.on_validation_epoch_end",
        "Callback.on_validation_batch_end",
        "Callback.on_validation_batch_end(batch_idx)",
        "TrainModule.setup",
        "TrainModule.setup(stage)",
        "TrainModule.teardown",
        "TrainModule.teardown(stage)",
        "TrainModule.on_fit_start",
        "TrainModule.on_fit_end",
        "TrainModule.on_train_start",
        "TrainModule.on_train_end",
        "TrainModule.on_train_epoch_start",
        "TrainModule.on_train_epoch_end",
        "TrainModule.on_train_batch_start",
        "TrainModule.on_train_batch_start(batch_idx)",
        "TrainModule.on_train_batch_end",
        "TrainModule.on_train_batch_end(batch_idx)",
        "TrainModule.on_validation_start",
        "TrainModule.on_validation_end",
        "TrainModule.on_validation_epoch_start",
        "TrainModule.on_validation_epoch_end",
        "TrainModule.on_validation_batch_end",
        "TrainModule.on_validation_batch_end(batch_idx)")
def test_fit_one_epoch():
    calls = _fit_calls(max_epochs=1, limit_train_batches=2, limit_val_batches=2)
    assert_sequence(calls, case(G, "fit_one_epoch")["calls"])


@claim("fit's hooks run in Lightning's order over two epochs with validation")
def test_fit_two_epochs():
    calls = _fit_calls(max_epochs=2, limit_train_batches=2, limit_val_batches=2)
    assert_sequence(calls, case(G, "fit_two_epochs")["calls"])


@claim("fit's hooks run in Lightning's order without validation data")
def test_fit_no_val():
    calls = _fit_calls(val=False, max_epochs=1, limit_train_batches=2)
    assert_sequence(calls, case(G, "fit_no_val")["calls"])


@claim("fit with limit_val_batches=0 validates nothing (no sanity check, no validation hook), "
       "as Lightning")
def test_fit_limit_val_batches_0():
    calls = _fit_calls(max_epochs=1, limit_train_batches=2, limit_val_batches=0,
                       num_sanity_val_steps=2)
    assert_sequence(calls, case(G, "fit_limit_val_batches_0")["calls"])


@claim("a ModelCheckpoint saving every epoch calls on_save_checkpoint right after "
       "on_train_epoch_end, as Lightning's does")
@covers("Callback.on_save_checkpoint",
        "TrainModule.on_save_checkpoint")
def test_fit_checkpoint_every_epoch(tmp_path):
    ckpt = callbacks.ModelCheckpoint(tmp_path / "ck", every_n_epochs=1, save_top_k=-1,
                                     save_last=False)
    calls = _fit_calls(ckpt, max_epochs=2, limit_train_batches=2, limit_val_batches=2)
    assert_sequence(calls, case(G, "fit_checkpoint_every_epoch")["calls"])


def _without_sanity_validation(calls):
    """Lightning's sequence less the validation hooks it runs inside the sanity check."""
    start, end = calls.index("Callback.on_sanity_check_start"), \
        calls.index("Callback.on_sanity_check_end")
    return calls[:start + 1] + calls[end:]


@departure("the sanity check runs the validation steps but calls no validation hook "
           "(Lightning calls on_validation_start ... on_validation_end inside it)",
           section="Deliberate departures")
@covers("Callback.on_sanity_check_start",
        "Callback.on_sanity_check_end")
def test_fit_sanity_check():
    lightning = case(G, "fit_sanity_check")["calls"]
    calls = _fit_calls(max_epochs=1, limit_train_batches=2, limit_val_batches=2,
                       num_sanity_val_steps=2)
    assert calls != lightning
    assert_sequence(calls, _without_sanity_validation(lightning))


def _resume(tmp_path, first_kw, second_kw):
    ckdir = tmp_path / "ck"
    first = callbacks.ModelCheckpoint(ckdir, every_n_epochs=1, save_top_k=-1)
    make_fit(callbacks=[first], **first_kw).fit(Reg(G), batches(G))
    calls, module = hooked()
    second = callbacks.ModelCheckpoint(ckdir, every_n_epochs=1, save_top_k=-1, save_last=False)
    fit = make_fit(callbacks=[Recorder(calls), second], **second_kw)
    fit.fit(module, batches(G), ckpt_path=first.last_model_path)
    return calls, fit


@claim("resuming at an epoch's end (max_epochs 1 -> 2) runs Lightning's hooks: "
       "on_load_checkpoint (module first), then the next epoch")
@covers("Fit.fit(ckpt_path)",
        "Callback.on_load_checkpoint",
        "TrainModule.on_load_checkpoint")
def test_resume_max_epochs(tmp_path):
    calls, fit = _resume(tmp_path, dict(max_epochs=1, limit_train_batches=2),
                         dict(max_epochs=2, limit_train_batches=2))
    expected = case(G, "resume_max_epochs")
    assert_sequence(calls, expected["calls"])
    assert fit.global_step == expected["global_step"]


@claim("resuming mid-epoch (max_steps 1 -> 3) continues at batch 1 with Lightning's hooks")
def test_resume_max_steps(tmp_path):
    calls, fit = _resume(tmp_path, dict(max_steps=1), dict(max_steps=3))
    expected = case(G, "resume_max_steps")
    assert_sequence(calls, expected["calls"])
    assert fit.global_step == expected["global_step"]


def _eval_calls(verb, n):
    calls, module = hooked()
    fit = make_fit(callbacks=[Recorder(calls)], max_epochs=1,
                   **({"limit_val_batches": n} if verb == "validate" else {}))
    data = batches(G, "val")
    if verb == "test":
        data = Batches(data.items[:n])
    getattr(fit, verb)(module, data)
    return calls


@claim("validate's hooks run in Lightning's order (2 batches)")
@covers("Fit.validate")
def test_validate_2_batches():
    assert_sequence(_eval_calls("validate", 2), case(G, "validate_2_batches")["calls"])


@claim("validate with limit_val_batches=0 calls only setup and teardown, as Lightning")
def test_validate_0_batches():
    assert_sequence(_eval_calls("validate", 0), case(G, "validate_0_batches")["calls"])


@claim("test's hooks run in Lightning's order (2 batches)")
@covers("Fit.test",
        "Callback.on_test_start",
        "Callback.on_test_end",
        "TrainModule.on_test_start",
        "TrainModule.on_test_end")
def test_test_2_batches():
    assert_sequence(_eval_calls("test", 2), case(G, "test_2_batches")["calls"])


@claim("predict's hooks run in Lightning's order (2 batches)")
@covers("Fit.predict",
        "Callback.on_predict_start",
        "Callback.on_predict_end",
        "TrainModule.on_predict_start",
        "TrainModule.on_predict_end")
def test_predict_2_batches():
    calls, module = hooked()
    fit = make_fit(callbacks=[Recorder(calls)], max_epochs=1)
    fit.predict(module, Batches(batches(G, "val").items[:2]))
    assert_sequence(calls, case(G, "predict_2_batches")["calls"])


@pytest.mark.parametrize("max_steps", [1, 3, 10])
@claim("one optimizer step per batch up to max_steps (max_epochs=2, 8 batches an epoch)")
@covers("Fit(max_steps)",
        "Fit.global_step")
def test_optimizer_steps_max_steps(max_steps):
    calls, module = hooked()
    fit = make_fit(callbacks=[Recorder(calls)], max_steps=max_steps, max_epochs=2)
    fit.fit(module, batches(G))
    expected = case(G, f"optimizer_steps_max_steps_{max_steps}")
    assert (fit.global_step, sum(c.startswith("on_train_batch_end") for c in calls)) == \
        (expected["global_step"], expected["train_batches"])


class HookedDataModule(jl.DataModule):
    def __init__(self, called):
        super().__init__()
        self.called = called

    def prepare_data(self):
        self.called.append("prepare_data")

    def setup(self, stage):
        self.called.append(f"setup:{stage}")

    def teardown(self, stage):
        self.called.append(f"teardown:{stage}")

    def state_dict(self):
        self.called.append("state_dict")
        return {}

    def train_dataloader(self):
        self.called.append("train_dataloader")
        return batches(G)

    def _val(self):
        return Batches(batches(G, "val").items[:2])

    def val_dataloader(self):
        self.called.append("val_dataloader")
        return self._val()

    def test_dataloader(self):
        self.called.append("test_dataloader")
        return self._val()

    def predict_dataloader(self):
        self.called.append("predict_dataloader")
        return self._val()


@pytest.mark.parametrize("verb", ["fit", "validate", "test", "predict"])
@claim("a DataModule's hooks run in Lightning's order in each stage")
@covers("Fit.fit(datamodule)",
        "Fit.validate(datamodule)",
        "Fit.test(datamodule)",
        "Fit.predict(datamodule)",
        "DataModule.prepare_data",
        "DataModule.setup",
        "DataModule.setup(stage)",
        "DataModule.teardown",
        "DataModule.teardown(stage)",
        "DataModule.state_dict",
        "DataModule.train_dataloader",
        "DataModule.val_dataloader",
        "DataModule.test_dataloader",
        "DataModule.predict_dataloader")
def test_datamodule(verb):
    called = []
    fit = make_fit(max_epochs=1, limit_train_batches=2, limit_val_batches=2)
    getattr(fit, verb)(Reg(G), datamodule=HookedDataModule(called))
    assert_sequence(called, case(G, f"datamodule_{verb}")["calls"])


@claim("with a sanity check, a DataModule's val_dataloader is asked for before "
       "train_dataloader, as Lightning")
def test_datamodule_fit_sanity_check():
    called = []
    fit = make_fit(max_epochs=1, limit_train_batches=2, limit_val_batches=2,
                   num_sanity_val_steps=2)
    fit.fit(Reg(G), datamodule=HookedDataModule(called))
    assert_sequence(called, case(G, "datamodule_fit_sanity_check")["calls"])


def _training_mode(model) -> bool:
    """Lightning's `module.training` for an nnx model: its dropout is active."""
    drops = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Dropout)]
    assert drops
    return not drops[0].deterministic


class Drop(nnx.Module):
    def __init__(self, layer, rngs):
        self.layer, self.drop = layer, nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.layer(self.drop(x))


class DropReg(Reg):
    def configure_model(self, rngs):
        return Drop(super().configure_model(rngs), rngs)


@claim("after fit, validate, test and predict the model is in training mode, as Lightning "
       "restores it")
def test_training_mode_after_each_stage():
    module, fit = DropReg(G), make_fit(max_epochs=1, limit_train_batches=2)
    seen = {}
    fit.fit(module, batches(G), batches(G, "val"))
    seen["fit"] = _training_mode(module.model)
    for verb in ("validate", "test", "predict"):
        getattr(fit, verb)(module, batches(G, "val"))
        seen[verb] = _training_mode(module.model)
    assert seen == case(G, "training_mode_after_each_stage")


@departure("load_from_checkpoint returns the model in eval mode, ready for inference; "
           "Lightning's returns it in training mode",
           section="Deliberate departures")
@covers("TrainModule.load_from_checkpoint")
def test_load_from_checkpoint_mode(tmp_path):
    assert case(G, "load_from_checkpoint_mode")["training"] is True
    ck = callbacks.ModelCheckpoint(tmp_path / "ck", every_n_epochs=1)
    make_fit(max_epochs=1, limit_train_batches=2, callbacks=[ck]).fit(DropReg(G), batches(G))
    loaded = DropReg.load_from_checkpoint(ck.last_model_path)
    assert _training_mode(loaded.model) is False
