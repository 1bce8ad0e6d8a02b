"""Logged names and values: `self.log`'s on_step / on_epoch / prog_bar / batch_size, epoch means
weighted by batch size, several validation loaders, what validate and test return."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlight as jl
from tests.conformance._cases import case, claim, covers, departure
from tests.conformance._jaxlight import RTOL, Batches, Reg, _mse, batches, make_fit

G = "metrics"
#: The key jaxlight's logged_metrics / callback_metrics hold that Lightning's do not: the training
#: loss a step returns (a pinned departure). The other cases compare the rest; test_same_keys
#: the keys.
EXTRA = {"loss"}


class Logs(Reg):
    def __init__(self, train_kw=None, val_kw=None):
        super().__init__(G, log_train=False)
        object.__setattr__(self, "train_kw", train_kw)
        object.__setattr__(self, "val_kw", val_kw)

    def training_step(self, model, batch):
        loss = _mse(model, batch)
        if self.train_kw is not None:
            self.log("train_loss", loss, **self.train_kw)
        return loss

    def validation_step(self, model, batch):
        self.log("val_loss", _mse(model, batch), **(self.val_kw or {}))
        self.log("val_abs", jnp.abs(model(batch["x"]) - batch["y"]).mean(), prog_bar=True)


def _val():
    return batches(G, "val", batch_size=5)


def _assert_metrics(got: dict, expected: dict, what: str):
    assert sorted(set(got) - EXTRA) == sorted(expected), what
    for k, v in expected.items():
        np.testing.assert_allclose(got[k], v, rtol=RTOL, err_msg=f"{what}[{k!r}]")


def _run(name, module, val=None):
    fit = make_fit(max_epochs=2)
    fit.fit(module, batches(G), val if val is not None else _val())
    expected = case(G, name)
    _assert_metrics(fit.logged_metrics, expected["logged"], "logged_metrics")
    _assert_metrics(fit.callback_metrics, expected["callback"], "callback_metrics")
    assert sorted(fit.progress_bar_metrics) == expected["prog_bar"]
    return fit


@departure("logged_metrics and callback_metrics hold Lightning's names and also 'loss', the loss "
           "training_step returns (Lightning logs only what self.log names)",
           section="Deliberate departures")
def test_same_keys():
    fit = make_fit(max_epochs=2)
    fit.fit(Logs({}), batches(G), _val())
    expected = case(G, "train_default")
    assert "loss" not in expected["logged"] and "loss" not in expected["callback"]
    assert sorted(fit.logged_metrics) == sorted([*expected["logged"], "loss"])
    assert sorted(fit.callback_metrics) == sorted([*expected["callback"], "loss"])


LOGS = {
    "train_default": ({}, None),
    "train_on_step_and_epoch": ({"on_step": True, "on_epoch": True}, None),
    "train_on_epoch_only": ({"on_step": False, "on_epoch": True}, None),
    "train_prog_bar": ({"on_step": True, "on_epoch": True, "prog_bar": True}, None),
    "val_weighted_by_batch_size": (None, None),
    "val_batch_size_argument": (None, {"batch_size": 2}),
}


@pytest.mark.parametrize("name", sorted(LOGS))
@claim("self.log's on_step / on_epoch / prog_bar / batch_size give Lightning's metric names "
       "(_step / _epoch) and values (epoch means weighted by batch size)")
@covers("TrainModule.log",
        "TrainModule.log(name)",
        "TrainModule.log(value)",
        "TrainModule.log(on_step)",
        "TrainModule.log(on_epoch)",
        "TrainModule.log(prog_bar)",
        "TrainModule.log(batch_size)",
        "Fit.logged_metrics",
        "Fit.callback_metrics",
        "Fit.progress_bar_metrics")
def test_logged(name):
    _run(name, Logs(*LOGS[name]))


@claim("several validation loaders: each is evaluated and its metrics are suffixed "
       "/dataloader_idx_N")
def test_val_two_loaders():
    _run("val_two_loaders", Logs(), [_val(), Batches(_val().items[:2])])


@claim("validate and test return Lightning's values (one dict per loader in Lightning; "
       "jaxlight returns that dict)")
@covers("TrainModule.validation_step", "TrainModule.test_step", "Fit.validate", "Fit.test")
def test_validate_and_test_return():
    module = Logs()
    fit = _run("validate_and_test_return", module)
    expected = case(G, "validate_and_test_return")
    for verb in ("validate", "test"):
        got = getattr(fit, verb)(module, _val())
        _assert_metrics(got, expected[verb][0], verb)


@departure("self.log(..., on_step=True) in validation_step is refused (evaluation logs one "
           "exact value over the whole dataset); Lightning logs val_loss_step per batch too",
           section="Deliberate departures")
def test_val_on_step():
    lightning = case(G, "val_on_step")["logged"]
    assert "val_loss_step" in lightning
    with pytest.raises(jl.ConfigurationError, match="on_step=True in an evaluation step"):
        make_fit(max_epochs=2).fit(Logs(None, {"on_step": True, "on_epoch": True}),
                                   batches(G), _val())
