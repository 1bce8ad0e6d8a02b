"""jl.DataModule with Fit's `datamodule=` (issue 15 item 8) and its misuse messages (item 7).

Lightning's order (trainer/call.py `_call_setup_hook` / `_call_teardown_hook`, and its
`test_trainer_datamodule_hook_system`): `prepare_data`, the DataModule's `setup(stage)` before
the callbacks' and the module's, `val_dataloader` before `train_dataloader`, `state_dict` at each
checkpoint, the DataModule's `teardown(stage)` before the callbacks' and the module's.
"""

from __future__ import annotations

import itertools
import os

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._restore import complete_steps, read_meta
from jaxlight.data._datamodule import datamodule_state
from tests.models import Classifier, classification_data

#: The hooks the order test records (others run too, unrecorded).
RECORDED = ("setup", "teardown", "on_fit_start", "on_fit_end", "on_validation_start",
            "on_test_start", "on_predict_start")


def _fit(**kw):
    kw.setdefault("max_steps", 8)
    # The default checkpoint's saves only where a test gives a ModelCheckpoint.
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, callbacks.ModelCheckpoint) for cb in kw.get("callbacks", ())))
    return jl.Fit("single", enable_progress_bar=False, enable_model_summary=False,
                  logger=False, log_every_n_steps=4, **kw)


def _params(module):
    return [np.asarray(x) for x in jax.tree.leaves(module.model)]


class Digits(jl.DataModule):
    """64 training, 32 validation, 32 test examples of the synthetic classification task."""

    def __init__(self, batch_size=16):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage):
        data = classification_data(128)
        self.parts = {name: {k: v[sl] for k, v in data.items()} for name, sl in
                      (("train", slice(0, 64)), ("val", slice(64, 96)), ("test", slice(96, 128)))}

    def train_dataloader(self):
        return jl.data.ArrayLoader(self.parts["train"], self.batch_size, seed=3)

    def val_dataloader(self):
        return jl.data.ArrayLoader(self.parts["val"], self.batch_size, shuffle=False,
                                   drop_remainder=False)

    def test_dataloader(self):
        return jl.data.ArrayLoader(self.parts["test"], self.batch_size, shuffle=False,
                                   drop_remainder=False)

    def predict_dataloader(self):
        return jl.data.ArrayLoader({"x": self.parts["test"]["x"]}, self.batch_size,
                                   shuffle=False, drop_remainder=False)


def _direct_loaders():
    dm = Digits()
    dm.setup("fit")
    return dm.train_dataloader(), dm.val_dataloader(), dm.test_dataloader()


# -- the hooks ---------------------------------------------------------------------------------


class RecordingDigits(Digits):
    def __init__(self, events):
        super().__init__()
        self.events = events

    def prepare_data(self):
        self.events.append(("datamodule", "prepare_data"))

    def setup(self, stage):
        self.events.append(("datamodule", "setup", stage))
        super().setup(stage)

    def teardown(self, stage):
        self.events.append(("datamodule", "teardown", stage))

    def state_dict(self):
        self.events.append(("datamodule", "state_dict"))
        return {"batch_size": self.batch_size}

    def load_state_dict(self, state):
        self.events.append(("datamodule", "load_state_dict", state))


for _name in ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader"):
    def _loader(self, _name=_name):
        self.events.append(("datamodule", _name))
        return getattr(Digits, _name)(self)

    setattr(RecordingDigits, _name, _loader)


class RecordingModule(Classifier):
    def __init__(self, events):
        super().__init__()
        object.__setattr__(self, "events", events)


class RecordingCallback(callbacks.Callback):
    def __init__(self, events):
        self.events = events


for _name in RECORDED:
    setattr(RecordingModule, _name,
            lambda self, *args, _name=_name: self.events.append(("module", _name, *args)))
    setattr(RecordingCallback, _name, lambda self, fit, module, *args, _name=_name:
            self.events.append(("callback", _name, *args)))


def test_hooks_run_once_in_lightnings_order(tmp_path):
    events = []
    dm, module = RecordingDigits(events), RecordingModule(events)
    ckpt = callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_steps=4, save_top_k=-1,
                                     async_save=False)
    fit = _fit(val_check_interval=4, callbacks=[RecordingCallback(events), ckpt])
    fit.fit(module, datamodule=dm)
    saved = complete_steps(str(tmp_path / "ckpt"))
    assert saved == [4, 8]
    assert events == [
        ("datamodule", "prepare_data"), ("datamodule", "setup", "fit"),
        ("callback", "setup", "fit"), ("module", "setup", "fit"),
        ("datamodule", "val_dataloader"), ("datamodule", "train_dataloader"),
        ("callback", "on_fit_start"), ("module", "on_fit_start"),
        ("callback", "on_validation_start"), ("module", "on_validation_start"),  # step 4
        ("datamodule", "state_dict"),
        ("callback", "on_validation_start"), ("module", "on_validation_start"),  # step 8
        ("datamodule", "state_dict"),
        ("callback", "on_fit_end"), ("module", "on_fit_end"),
        ("datamodule", "teardown", "fit"), ("callback", "teardown", "fit"),
        ("module", "teardown", "fit"),
    ]
    assert fit.datamodule is dm and fit.train_data is not None
    for stage, method, start in (("validate", "val_dataloader", "on_validation_start"),
                                 ("test", "test_dataloader", "on_test_start"),
                                 ("predict", "predict_dataloader", "on_predict_start")):
        events.clear()
        getattr(fit, stage)(module, datamodule=dm)
        assert events == [
            ("datamodule", "prepare_data"), ("datamodule", "setup", stage),
            ("callback", "setup", stage), ("module", "setup", stage),
            ("datamodule", method), ("callback", start), ("module", start),
            ("datamodule", "teardown", stage), ("callback", "teardown", stage),
            ("module", "teardown", stage),
        ], stage


def test_teardown_runs_after_an_error():
    events = []

    class Broken(RecordingDigits):
        def train_dataloader(self):
            raise RuntimeError("no disk")

    with pytest.raises(RuntimeError, match="no disk"):
        _fit().fit(RecordingModule(events), datamodule=Broken(events))
    assert events[-2:] == [("datamodule", "teardown", "fit"), ("module", "teardown", "fit")]


# -- the same training as with loaders ---------------------------------------------------------


def test_fit_with_a_datamodule_equals_fit_with_its_loaders():
    train, val, test = _direct_loaders()
    direct = _fit(val_check_interval=4)
    direct.fit(Classifier(), train, val)
    via_dm = _fit(val_check_interval=4)
    via_dm.fit(Classifier(), datamodule=Digits())
    for a, b in zip(_params(direct.session.module), _params(via_dm.session.module), strict=True):
        np.testing.assert_array_equal(a, b)
    assert via_dm.callback_metrics["val_loss"] == direct.callback_metrics["val_loss"]
    # Lightning's positional form: the DataModule in train_data's place.
    positional = _fit(val_check_interval=4)
    positional.fit(Classifier(), Digits())
    for a, b in zip(_params(direct.session.module), _params(positional.session.module),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    assert (direct.test(direct.session.module, test)
            == via_dm.test(via_dm.session.module, datamodule=Digits()))


def test_without_val_dataloader_fit_does_not_validate():
    class NoVal(jl.DataModule):
        def train_dataloader(self):
            return jl.data.ArrayLoader(classification_data(64), 16)

    fit = _fit(val_check_interval=4)
    fit.fit(Classifier(), datamodule=NoVal())
    assert fit.val_data is None
    assert not any(k.startswith("val_") for k in fit.callback_metrics)
    with pytest.raises(jl.ConfigurationError, match=r"NoVal does not define val_dataloader"):
        fit.validate(fit.session.module, datamodule=NoVal())


# -- ckpt_path="best" and predict ---------------------------------------------------------------


def test_test_and_predict_with_best_checkpoint_use_the_best_one(tmp_path):
    # mode="max" on the loss ranks the worst validation first, so the best checkpoint is an
    # early one and differs from the last (with "min" on this easy task they would coincide).
    ckpt = callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_steps=4, monitor="val_loss",
                                     mode="max", save_top_k=1, async_save=False)
    fit = _fit(max_steps=16, val_check_interval=4, callbacks=[ckpt])
    module = Classifier()
    dm = Digits()
    fit.fit(module, datamodule=dm)
    assert ckpt.best_model_path != ckpt.last_model_path
    assert ckpt.best_model_path == os.path.join(str(tmp_path / "ckpt"), str(ckpt.best_step))
    best = fit.test(module, datamodule=dm, ckpt_path="best")
    assert best == fit.test(module, datamodule=dm, ckpt_path=ckpt.best_model_path)
    last = fit.test(module, datamodule=dm, ckpt_path="last")
    assert best["test_loss"] != last["test_loss"]
    # the best checkpoint's validation loss is the score ModelCheckpoint ranked it by
    val = fit.validate(module, datamodule=dm, ckpt_path="best")
    assert val["val_loss"] == pytest.approx(ckpt.best_model_score, rel=1e-6)
    predicted = fit.predict(module, datamodule=dm, ckpt_path="best")
    model = jl.load_checkpoint(ckpt.best_model_path, Classifier())
    expected = np.asarray(model(_direct_loaders()[2].arrays["x"]))
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in predicted]), expected,
                               rtol=1e-6)


# -- exact resume of a stateful DataModule ----------------------------------------------------


_draws = itertools.count(1)


class RandomSubset(jl.DataModule):
    """Trains on a random 64 of 128 examples, drawn once per run in setup (its state)."""

    def __init__(self):
        super().__init__()
        self.subset_seed = None
        self.restored = []

    def setup(self, stage):
        self.subset_seed = next(_draws)  # a new draw every run, unless a checkpoint restores it

    def state_dict(self):
        return {"subset_seed": self.subset_seed}

    def load_state_dict(self, state):
        self.restored.append(dict(state))
        self.subset_seed = state["subset_seed"]

    def train_dataloader(self):
        data = classification_data(128)
        keep = np.random.default_rng(self.subset_seed).permutation(128)[:64]
        return jl.data.ArrayLoader({k: v[keep] for k, v in data.items()}, 16, seed=1)


def test_resume_restores_the_datamodule_state_from_the_checkpoint(tmp_path):
    ckpt_dir = tmp_path / "ckpt"
    first = RandomSubset()
    full = _fit(callbacks=[callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=4, save_top_k=-1,
                                                     async_save=False)])
    full.fit(Classifier(), datamodule=first)
    meta = read_meta(str(ckpt_dir / "4"))
    assert meta["datamodule"] == {"subset_seed": first.subset_seed}

    resumed_dm = RandomSubset()
    resumed = _fit(default_root_dir=str(tmp_path / "other"))
    resumed.fit(Classifier(), datamodule=resumed_dm, ckpt_path=str(ckpt_dir / "4"))
    assert resumed_dm.restored == [{"subset_seed": first.subset_seed}]
    for a, b in zip(_params(full.session.module), _params(resumed.session.module), strict=True):
        np.testing.assert_array_equal(a, b)

    class Forgetful(RandomSubset):  # the same run without the restore: other data, other params
        def load_state_dict(self, state):
            self.restored.append(dict(state))

    forgot = _fit(default_root_dir=str(tmp_path / "third"))
    forgot.fit(Classifier(), datamodule=Forgetful(), ckpt_path=str(ckpt_dir / "4"))
    assert any(not np.array_equal(a, b) for a, b in
               zip(_params(full.session.module), _params(forgot.session.module), strict=True))


# -- misuse ------------------------------------------------------------------------------------


class LightningDataModule:  # stands for lightning.LightningDataModule (matched by name)
    pass


class LitData(LightningDataModule):
    pass


class TrainOnlyData(jl.DataModule):
    def train_dataloader(self):
        return jl.data.ArrayLoader(classification_data(64), 16)


def _loader():
    return jl.data.ArrayLoader(classification_data(64), 16)


@pytest.mark.parametrize("call, message", [
    (lambda f, m: f.fit(m, _loader(), datamodule=Digits()),
     r"Fit.fit got both train_data and datamodule=; the DataModule's train_dataloader gives the "
     r"data: pass one, Fit.fit\(module, train_data, val_data\) or Fit.fit\(module, "
     r"datamodule=dm\). See docs/porting.md"),
    (lambda f, m: f.fit(m, val_data=_loader(), datamodule=Digits()),
     r"got both val_data and datamodule="),
    (lambda f, m: f.fit(m), r"Fit.fit got no data: call Fit.fit\(module, train_data, val_data\)"
     r" or Fit.fit\(module, datamodule=dm\)"),
    (lambda f, m: f.test(m), r"Fit.test got no data: call Fit.test\(module, data\)"),
    (lambda f, m: f.fit(m, Digits(), _loader()),
     r"got a DataModule as train_data and val_data as well; pass the DataModule alone"),
    (lambda f, m: f.fit(m, Digits(), datamodule=Digits()),
     r"got a DataModule as train_data and datamodule as well"),
    (lambda f, m: f.fit(m, _loader(), Digits()),
     r"Fit.fit got a Digits as val_data; a DataModule gives both splits: "
     r"Fit.fit\(module, datamodule=dm\). See docs/porting.md"),
    (lambda f, m: f.fit(m, datamodule=Digits),
     r"takes a jaxlight.DataModule, got Digits: it is the class; pass an instance: "
     r"datamodule=Digits\(...\). See docs/porting.md"),
    (lambda f, m: f.fit(m, datamodule=_loader()),
     r"Fit.fit\(datamodule=...\) takes a jaxlight.DataModule, got ArrayLoader: pass a "
     r"jaxlight.DataModule, or give the data itself: Fit.fit\(module, train_data, val_data\)"),
    (lambda f, m: f.test(m, datamodule=LitData()),
     r"got LitData: it is Lightning's LightningDataModule; subclass jaxlight.DataModule instead"),
    (lambda f, m: f.fit(m, LitData()), r"it is Lightning's LightningDataModule"),
    (lambda f, m: f.test(m, datamodule=TrainOnlyData()),
     r"TrainOnlyData does not define test_dataloader, which Fit.test\(datamodule=...\) reads "
     r"its data from: define TrainOnlyData.test_dataloader\(self\)"),
    (lambda f, m: f.predict(m, TrainOnlyData()),
     r"TrainOnlyData does not define predict_dataloader"),
    (lambda f, m: f.fit(m, jl.DataModule()), r"DataModule does not define train_dataloader"),
    (lambda f, m: f.fit(m, _loader(), train_dataloaders=_loader()),
     r"Fit.fit got both train_data= and train_dataloaders= \(Lightning's name"),
    (lambda f, m: f.test(m, _loader(), dataloaders=_loader()),
     r"Fit.test got both data= and dataloaders="),
    (lambda f, m: f.fit(m, datamodul=Digits()),
     r"Fit.fit got unknown keyword argument\(s\) \['datamodul'\]. Did you mean 'datamodule'\?"),
])
def test_misuse_is_refused_before_anything_runs(call, message):
    events = []
    with pytest.raises(jl.ConfigurationError, match=message):
        call(_fit(), RecordingModule(events))
    assert events == []  # refused before any hook


def test_a_loader_method_returning_none_is_refused():
    class Empty(Digits):
        def train_dataloader(self):
            return None

    with pytest.raises(jl.ConfigurationError,
                       match=r"Empty.train_dataloader\(\) returned None; return an iterable"):
        _fit().fit(Classifier(), datamodule=Empty())


def test_the_base_loaders_say_what_to_define():
    with pytest.raises(jl.ConfigurationError, match=r"DataModule does not define val_dataloader, "
                       r"which Fit.validate reads its data from: define DataModule.val_dataloader"):
        jl.DataModule().val_dataloader()


class Stateful(jl.DataModule):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def state_dict(self):
        return self.state


@pytest.mark.parametrize("state, message", [
    ([1, 2], r"Stateful.state_dict\(\) returned list; it must return a dict"),
    ({"rng": np.arange(3)}, r"returned a value JSON cannot hold \(Object of type ndarray"),
    ({"shape": (2, 3)}, r"returned \{'shape': \(2, 3\)\}, which does not come back from JSON "
                        r"unchanged \(tuples become lists"),
    ({1: "a"}, r"does not come back from JSON unchanged"),
])
def test_a_state_dict_json_cannot_keep_is_refused(state, message):
    with pytest.raises(jl.CheckpointError, match=message):
        datamodule_state(Stateful(state))
    assert datamodule_state(Stateful({"epoch": 3, "seen": [1, 2]})) == {"epoch": 3, "seen": [1, 2]}


def test_a_bad_state_dict_fails_the_checkpoint_save(tmp_path):
    class BadState(Digits):
        def state_dict(self):
            return {"order": np.arange(3)}

    fit = _fit(max_steps=2, num_sanity_val_steps=0, callbacks=[
        callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_steps=1, async_save=False)])
    with pytest.raises(jl.CheckpointError, match=r"BadState.state_dict\(\) returned a value"):
        fit.fit(Classifier(), datamodule=BadState())
    assert complete_steps(str(tmp_path / "ckpt")) == []


def test_hparams_are_recorded_as_on_a_train_module():
    assert Digits(batch_size=8).hparams == {"batch_size": 8}

    class Narrow(jl.DataModule):
        def __init__(self, path="data", batch_size=4):
            super().__init__()
            self.save_hyperparameters(ignore="path")

    assert Narrow("x", 2).hparams.batch_size == 2 and "path" not in Narrow().hparams
