"""A new user's mistakes with the newer API (issue 30, items 1-13), each answered before the
first step where it would show, with the numbers and the fix. (Disk faults and two runs in one
checkpoint directory: tests/checkpoint/test_disk_faults.py.)"""

from __future__ import annotations

import re
import warnings

import grain
import numpy as np
import optax
import pytest

import jaxlight as jl
from jaxlight import callbacks, strategies
from jaxlight._errors import DataTypeError
from jaxlight.schedules import _configure
from tests.models import Classifier, classification_data


def _fit(strategy="single", **kw) -> jl.Fit:
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("enable_model_summary", False)
    kw.setdefault("logger", False)
    # The default checkpoint's saves only where a test gives a ModelCheckpoint.
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, callbacks.ModelCheckpoint) for cb in kw.get("callbacks", ())))
    return jl.Fit(strategy, **kw)


def _loader(n=128, batch=32, data=None):
    return jl.data.ArrayLoader(classification_data(n) if data is None else data, batch)


class _Steps(callbacks.Callback):
    """Records the training steps taken (a refusal must come before the first)."""

    def __init__(self):
        self.steps = []

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        self.steps.append(fit.global_step)


# -- silent results ------------------------------------------------------------------------


def test_1_a_val_check_interval_longer_than_the_epoch_is_refused_as_lightning_does():
    # 4 batches per epoch: validation every 100 batches within an epoch never runs. Lightning:
    # "`val_check_interval` (100) must be less than or equal to the number of the training
    # batches (4) ... set `check_val_every_n_epoch=None`".
    steps = _Steps()
    with pytest.raises(jl.ConfigurationError, match=r"val_check_interval=100 is more than the 4 "
                       r"training batches of an epoch(.|\n)*val_check_interval <= 4(.|\n)*"
                       r"check_val_every_n_epoch=None"):
        _fit(max_steps=8, val_check_interval=100, callbacks=[steps]).fit(
            Classifier(), _loader(), _loader(64))
    assert steps.steps == []
    # As in Lightning: limit_train_batches is the epoch; counting across epochs is allowed.
    with pytest.raises(jl.ConfigurationError, match=r"more than the 2 training batches"):
        _fit(max_steps=8, val_check_interval=3, limit_train_batches=2).fit(
            Classifier(), _loader(), _loader(64))
    seen = []
    fit = _fit(max_steps=8, val_check_interval=6, check_val_every_n_epoch=None,
               callbacks=[callbacks.LambdaCallback(
                   on_validation_end=lambda f, m: seen.append(f.global_step))])
    fit.fit(Classifier(), _loader(), _loader(64))
    assert seen == [6]


def test_2_resuming_with_another_batch_size_is_refused_naming_both(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    _fit(max_steps=3, callbacks=[callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=3)]).fit(
        Classifier(), _loader(256, 64))
    steps = _Steps()
    with pytest.raises(jl.CheckpointError, match=r"saved with batch_size=64 \(epoch 0, 3 "
                       r"batches read: examples 0-191 .*has batch_size=32.*at example 96.*"
                       r"Resume with batch_size=64"):
        _fit(max_steps=6, callbacks=[steps]).fit(Classifier(), _loader(256, 32),
                                                 ckpt_path=f"{ckpt_dir}/3")
    assert steps.steps == []
    # The same batch size resumes (and continues the epoch).
    fit = _fit(max_steps=4)
    fit.fit(Classifier(), _loader(256, 64), ckpt_path=f"{ckpt_dir}/3")
    assert fit.global_step == 4


def test_3_two_step_transforms_of_one_kind_are_refused():
    for pair, shown in (
            ((callbacks.MixedPrecision("bf16-mixed"), callbacks.MixedPrecision("16-mixed")),
             r"2 MixedPrecision callbacks \(callbacks\[0\] = MixedPrecision\('bf16-mixed'\), "
             r"callbacks\[1\] = MixedPrecision\('16-mixed'\)\)"),
            ((callbacks.GradientClipping(1.0), callbacks.GradientClipping(0.5)),
             r"2 GradientClipping callbacks"),
            ((callbacks.GradientAccumulation(2), callbacks.GradientAccumulation(4)),
             r"2 GradientAccumulation callbacks")):
        with pytest.raises(jl.ConfigurationError, match=shown + r".*Keep one"):
            _fit(max_steps=1, callbacks=list(pair))


def test_4_gathering_a_train_module_is_refused_with_its_model_named():
    with pytest.raises(jl.ConfigurationError, match=r"gather got a Classifier \(a TrainModule\)"
                       r".*jaxlight.distributed.gather\(module.model\)"):
        jl.distributed.gather(Classifier())


class _Err(Classifier):
    def __init__(self, own: dict):
        super().__init__()
        self.own = own

    def training_step(self, model, batch):
        loss, metrics = super().training_step(model, batch)
        self.log("err", loss, on_step=True, on_epoch=True)
        self.log("err_epoch", loss * 0 + 7.0, **self.own)
        return loss, metrics


@pytest.mark.parametrize("own", [{"on_step": False, "on_epoch": True}, {"on_epoch": True}])
def test_5_names_that_collide_after_the_step_and_epoch_suffixes_are_refused(own):
    steps = _Steps()
    with pytest.raises(jl.ConfigurationError, match=r"self.log\('err_epoch'.*and self.log\("
                       r"'err', on_step=True, on_epoch=True\) both reach the loggers as "
                       r"'err_epoch'.*Rename one"):
        _fit(max_epochs=1, callbacks=[steps]).fit(_Err(own), _loader())
    assert steps.steps == []


def test_6_a_path_rule_naming_one_axis_twice_is_refused():
    with pytest.raises(jl.ConfigurationError, match=r"names 'fsdp' for dimensions 0 and 1; one "
                       r"axis can split only one dimension.*\('fsdp', None\)"):
        strategies.FSDP(rules=[(r".*kernel", ("fsdp", "fsdp"))])


class _RateInFactorSlot(Classifier):
    def configure_optimizers(self):
        return {"optimizer": optax.adam(1e-3), "lr_scheduler": {
            "scheduler": optax.cosine_decay_schedule(1e-3, 100), "interval": "step"}}


def test_7_a_learning_rate_schedule_in_the_factor_slot_warns_with_both_forms():
    with pytest.warns(jl.JaxlightWarning, match=r"gives values no larger than 0.001 .*holds a "
                      r"factor.*about 1e-06.*optax.adam\(schedule\).*peak at 1"):
        _fit(max_steps=1).fit(_RateInFactorSlot(), _loader())
    with warnings.catch_warnings():  # a factor schedule (peak 1) is not judged
        warnings.simplefilter("error", jl.JaxlightWarning)
        _configure.resolve(type("F", (Classifier,), {"configure_optimizers": lambda self: {
            "optimizer": optax.adam(1e-3),
            "lr_scheduler": {"scheduler": optax.cosine_decay_schedule(1.0, 100)}}})())


# -- crashes without jaxlight's context --------------------------------------------------------


def test_8_strings_in_a_batch_are_a_data_type_error_naming_the_leaf():
    data = classification_data(128)
    data["id"] = np.array([f"file{i:06d}" for i in range(128)])
    with pytest.raises(DataTypeError, match=r"training batch 0 of epoch 0 has leaf \['id'\] "
                       r"of dtype <U10 \(strings\)"):
        _fit(max_steps=2).fit(Classifier(), _loader(data=data))
    with pytest.raises(DataTypeError, match=r"leaf \['id'\] of dtype <U10"):
        _fit(max_steps=2).validate(Classifier(), _loader(data=data))


class _Ragged:
    """Records whose `x` has length 16 or 17."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        x = np.zeros((16 + i % 2,), np.float32)
        return {"x": x[:16] if i < 8 else x, "y": np.int32(i % 4)}


def test_9_grain_records_of_different_shapes_get_jaxlight_context():
    data = grain.MapDataset.source(_Ragged()).batch(8)
    steps = _Steps()
    with pytest.raises(jl.DataError, match=r"grain could not make training batch 1 of epoch 0 "
                       r"from the BatchMapDataset: ValueError: .*records of shapes \[\(16,\), "
                       r"\(17,\).*same shapes: pad or crop"):
        _fit(max_steps=4, callbacks=[steps]).fit(Classifier(), data)


# -- poor or late answers ------------------------------------------------------------------------


class _DM(jl.DataModule):
    def train_dataloader(self):
        return _loader()


def test_10_a_loader_method_not_called_is_refused_saying_call_it():
    with pytest.raises(jl.DataError, match=r"_DM.train_dataloader, a function or method, not "
                       r"its result: call it.*dm.train_dataloader\(\)"):
        _fit(max_steps=1).fit(Classifier(), _DM().train_dataloader)


def test_11_a_device_named_twice_says_what_to_pass():
    said = re.escape("Fit(devices=[0, 0]) names a device more than once (device 0)")
    with pytest.raises(jl.ConfigurationError, match=said + r".*devices=\[0\] to use it once "
                       r"each. For 2 devices, pass devices=2 .*devices=\[0, 1\]"):
        jl.Fit(devices=[0, 0], max_steps=1)


class _Plateau(Classifier):
    def configure_optimizers(self):
        return {"optimizer": optax.adam(1e-3), "lr_scheduler": {
            "scheduler": optax.contrib.reduce_on_plateau(patience=1), "monitor": "val_los"}}


def test_12_a_plateau_monitor_validation_never_produces_is_refused_at_the_sanity_check():
    steps = _Steps()
    with pytest.raises(jl.ConfigurationError, match=r"monitors 'val_los', which validation did "
                       r"not produce in the sanity check before training.*val_loss"):
        _fit(max_epochs=2, callbacks=[steps]).fit(_Plateau(), _loader(), _loader(64))
    assert steps.steps == []


class _Sgd(Classifier):
    def configure_optimizers(self):
        return optax.sgd(self.lr)


def test_13_resuming_another_optimizers_checkpoint_names_only_the_optimizer_state(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    _fit(max_steps=2, callbacks=[callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=2)]).fit(
        _Sgd(), _loader())
    with pytest.raises(jl.CheckpointError) as raised:
        _fit(max_steps=4).fit(Classifier(), _loader(), ckpt_path=f"{ckpt_dir}/2")
    message = str(raised.value)
    assert "does not match Classifier's opt_state:" in message, message
    assert "['params']" not in message and "['rest']" not in message
    assert "The params and rest match: the optimizer differs" in message
    assert "jaxlight.load_checkpoint(path, module)" in message
