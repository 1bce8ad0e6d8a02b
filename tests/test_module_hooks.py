"""Module hooks run like Lightning's, and `module.model` works in every hook (issue 15 items 3, 4).

Lightning's order (trainer/call.py and the loops): the callbacks' hook first, then the
module's; at `on_train_epoch_end` the monitoring callbacks (checkpoint, early stopping) after
the module's; at `on_load_checkpoint` the module first.
"""

from __future__ import annotations

import inspect

import jax
import numpy as np
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.callbacks._base import HostHooks
from jaxlight.module._hooks import ModuleHooks
from tests.models import Classifier, classification_data

HOOKS = sorted(n for n, f in inspect.getmembers(HostHooks, inspect.isfunction)
               if not n.startswith("_"))


def _data(n=64, batch=16):
    return jl.data.ArrayLoader(classification_data(n), batch)


def _fit(**kw):
    kw.setdefault("max_steps", 8)
    # The default checkpoint's saves only where a test gives a ModelCheckpoint.
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, callbacks.ModelCheckpoint) for cb in kw.get("callbacks", ())))
    return jl.Fit("single", enable_progress_bar=False, enable_model_summary=False,
                  logger=False, log_every_n_steps=2, **kw)


class Recording(Classifier):
    """Records every module hook it gets and runs `self.model` in each."""

    def __init__(self, log):
        super().__init__()
        object.__setattr__(self, "log", log)


def _module_hook(name):
    def hook(self, *args):
        x = classification_data(2)["x"]
        self.log.append(("module", name, np.asarray(self.model(x)).shape))

    return hook


for _name in HOOKS:
    setattr(Recording, _name, _module_hook(_name))


class Probe(callbacks.Callback):
    def __init__(self, log, tag="callback"):
        self.log, self.tag = log, tag


def _callback_hook(name):
    def hook(self, fit, module, *args):
        x = classification_data(2)["x"]
        self.log.append((self.tag, name, np.asarray(module.model(x)).shape))
        if name == "on_train_batch_end":  # the model is the state's, not a copy of an old one
            for a, b in zip(jax.tree.leaves(fit.state.params),
                            jax.tree.leaves(nnx.state(module.model, nnx.Param)), strict=True):
                assert a is b

    return hook


for _name in HOOKS:
    setattr(Probe, _name, _callback_hook(_name))


class MonitorProbe(callbacks.EarlyStopping):
    def __init__(self, log):
        super().__init__(monitor="loss", patience=1000)
        self.log = log

    def on_train_epoch_end(self, fit, module):
        self.log.append(("monitor", "on_train_epoch_end", None))
        super().on_train_epoch_end(fit, module)


def _order(log, hook):
    return [who for who, name, _ in log if name == hook]


def test_module_hooks_cover_every_callback_hook():
    module_hooks = {n for n, f in inspect.getmembers(ModuleHooks, inspect.isfunction)
                    if not n.startswith("_")}
    assert module_hooks == set(HOOKS)


def test_module_hooks_run_in_lightnings_order_and_module_model_works_in_each():
    log = []
    module = Recording(log)
    fit = _fit(max_epochs=2, max_steps=None,
               callbacks=[Probe(log), MonitorProbe(log),
                          callbacks.ModelCheckpoint("ckpt", every_n_steps=4)])
    fit.fit(module, _data(), _data(32))
    ran = {name for _, name, _ in log}
    assert {"setup", "on_fit_start", "on_train_start", "on_train_epoch_start",
            "on_train_batch_start", "on_train_batch_end", "on_log", "on_train_epoch_end",
            "on_validation_start", "on_validation_epoch_start", "on_validation_batch_end",
            "on_validation_epoch_end", "on_validation_end", "on_save_checkpoint", "on_train_end",
            "on_fit_end", "teardown"} <= ran
    for hook in ran - {"on_train_epoch_end"}:
        order = _order(log, hook)
        assert order == ["callback", "module"] * (len(order) // 2), (hook, order)
    assert _order(log, "on_train_epoch_end") == ["callback", "module", "monitor"] * 2
    # Every hook ran the current model (the shapes of a forward pass on 2 examples).
    assert {shape for who, _, shape in log if who != "monitor"} == {(2, 4)}
    assert fit.compile_counts["init"] == 1  # setup's module.model created the fit's state

    log.clear()
    resumed = _fit(max_steps=10, callbacks=[Probe(log),
                                            callbacks.ModelCheckpoint("ckpt", every_n_steps=4)])
    resumed.fit(Recording(log), _data(), ckpt_path="last")
    assert _order(log, "on_load_checkpoint") == ["module", "callback"]


def test_module_model_works_in_hooks_of_validate_test_and_predict():
    log = []
    module = Recording(log)
    _fit(max_steps=2).fit(module, _data())
    trained = jax.tree.leaves(nnx.state(module.model, nnx.Param))
    log.clear()
    fit = _fit(callbacks=[Probe(log)])
    fit.validate(module, _data(32))
    fit.test(module, _data(32))
    fit.predict(module, _data(32))
    # Three stages, each with set-up and teardown, the model working in every hook.
    assert _order(log, "setup") == _order(log, "teardown") == ["callback", "module"] * 3
    assert {shape for _, _, shape in log} == {(2, 4)}
    assert {name for _, name, _ in log} >= {"on_validation_start", "on_test_start",
                                            "on_predict_start", "on_predict_end"}
    after = jax.tree.leaves(nnx.state(module.model, nnx.Param))
    for a, b in zip(trained, after, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
