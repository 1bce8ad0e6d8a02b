"""Names jaxlight shares with Lightning mean what they mean in Lightning 2.6 (issue 25, items 1-14).

Each test pins one behaviour that PyTorch Lightning 2.6.6 shows (checked by running it) and that
jaxlight once did differently; tests/conformance/ compares against Lightning itself.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks


class Regression(jl.TrainModule):
    """A linear regression: the smallest model every behaviour here needs."""

    def __init__(self, lr: float = 0.1):
        super().__init__()
        self.lr = lr

    def configure_model(self, rngs):
        return nnx.Linear(3, 1, rngs=rngs)

    def configure_optimizers(self):
        return optax.sgd(self.lr)

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    def validation_step(self, model, batch):
        return {"loss": ((model(batch["x"]) - batch["y"]) ** 2).mean()}

    test_step = validation_step


def _arrays(n: int = 32, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 3)).astype(np.float32),
            "y": rng.normal(size=(n, 1)).astype(np.float32)}


def _loader(n: int = 32, batch: int = 4, seed: int = 0, **kw) -> jl.data.ArrayLoader:
    return jl.data.ArrayLoader(_arrays(n, seed), batch, shuffle=False, **kw)


def _fit(strategy="single", **kw) -> jl.Fit:
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("logger", False)
    kw.setdefault("enable_model_summary", False)
    kw.setdefault("num_sanity_val_steps", 0)
    return jl.Fit(strategy, **kw)


# -- item 3: the epoch's validation runs before on_train_epoch_end ------------------------------


class EpochEndProbe(callbacks.Callback):
    def __init__(self):
        self.at_validation_end, self.at_epoch_end = [], []

    def on_validation_end(self, fit, module):
        self.at_validation_end.append(fit.callback_metrics["val_loss"])

    def on_train_epoch_end(self, fit, module):
        self.at_epoch_end.append(fit.callback_metrics.get("val_loss"))


def test_epoch_end_hooks_see_this_epochs_validation(tmp_path):
    probe = EpochEndProbe()
    ckpt = callbacks.ModelCheckpoint(tmp_path / "ckpt", monitor="val_loss", save_top_k=-1,
                                     save_last=False, async_save=False)
    fit = _fit(max_epochs=3, callbacks=[probe, ckpt])
    fit.fit(Regression(), _loader(), _loader(seed=1))
    assert len(probe.at_validation_end) == 3
    assert probe.at_epoch_end == probe.at_validation_end
    # The epoch's checkpoint is ranked by the epoch's own validation.
    assert ckpt.best_model_score == min(probe.at_validation_end)


# -- item 5: every iter() of an ArrayLoader is a fresh pass --------------------------------------


def test_each_iter_of_an_array_loader_starts_a_fresh_pass():
    loader = _loader(n=12, batch=4)
    first = next(iter(loader))
    again = next(iter(loader))
    np.testing.assert_array_equal(first["x"], again["x"])
    assert len(list(loader)) == 3  # the peeks above do not shorten a pass
    shuffled = jl.data.ArrayLoader(_arrays(12), 4, shuffle=True)
    one, two = iter(shuffled), iter(shuffled)
    np.testing.assert_array_equal(next(one)["x"], next(two)["x"])


def test_a_peeked_loader_is_evaluated_and_trained_whole():
    module, train, val = Regression(), _loader(), _loader(seed=1)
    fit = _fit(max_epochs=2)
    next(iter(train)), next(iter(val))  # a user's look at the data
    fit.fit(module, train, val)
    assert fit.global_step == 16  # 2 epochs x 8 batches
    next(iter(val))
    peeked = fit.validate(module, val)["val_loss"]
    x, y = _arrays(seed=1).values()
    expected = float(((np.asarray(module.model(x)) - y) ** 2).mean())
    assert peeked == pytest.approx(expected, rel=1e-5)


# -- item 6: resuming a finished run returns without training ------------------------------------


class HookNames(callbacks.Callback):
    def __init__(self):
        self.calls = []

    def on_fit_start(self, fit, module):
        self.calls.append("on_fit_start")

    def on_train_start(self, fit, module):
        self.calls.append("on_train_start")

    def on_train_batch_start(self, fit, module, batch, batch_idx):
        self.calls.append("on_train_batch_start")

    def on_fit_end(self, fit, module):
        self.calls.append("on_fit_end")


@pytest.mark.parametrize("limits", [{"max_steps": 6}, {"max_epochs": 2}])
def test_resuming_a_finished_run_trains_nothing(tmp_path, limits):
    ckpt = lambda: callbacks.ModelCheckpoint(tmp_path / "ckpt", async_save=False)  # noqa: E731
    first = Regression()
    _fit(callbacks=[ckpt()], **limits).fit(first, _loader())
    hooks = HookNames()
    again = _fit(callbacks=[ckpt(), hooks], **limits)
    resumed = Regression()
    again.fit(resumed, _loader(), ckpt_path="last")
    assert again.global_step == (6 if "max_steps" in limits else 16)
    assert hooks.calls == ["on_fit_start", "on_fit_end"]  # Lightning 2.6's calls
    np.testing.assert_array_equal(np.asarray(resumed.model.kernel[...]),
                                  np.asarray(first.model.kernel[...]))


# -- item 7: load_from_checkpoint returns an eval-mode model -------------------------------------


class NoisyRegression(Regression):
    def configure_model(self, rngs):
        return nnx.Sequential(nnx.Dropout(0.5, rngs=rngs), nnx.Linear(3, 1, rngs=rngs))


def test_load_from_checkpoint_returns_an_eval_mode_model(tmp_path):
    ckpt = callbacks.ModelCheckpoint(tmp_path / "ckpt", async_save=False)
    module = NoisyRegression()
    _fit(max_steps=2, callbacks=[ckpt]).fit(module, _loader())
    x = _arrays(8)["x"]
    # After fit, module.model is the trained model as training ran it (train mode, dropout on),
    # as a Lightning module is after Trainer.fit.
    assert not np.array_equal(np.asarray(module.model(x)), np.asarray(module.model(x)))
    loaded = NoisyRegression.load_from_checkpoint(ckpt.last_model_path)
    np.testing.assert_array_equal(np.asarray(loaded.model(x)), np.asarray(loaded.model(x)))
    loaded.model.train()
    assert not np.array_equal(np.asarray(loaded.model(x)), np.asarray(loaded.model(x)))
