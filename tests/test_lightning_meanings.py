"""Names jaxlight shares with Lightning mean what they mean in Lightning 2.6 (issue 25, items 1-14).

Each test pins one behaviour that PyTorch Lightning 2.6.6 shows (checked by running it) and that
jaxlight once did differently; tests/conformance/ compares against Lightning itself.
"""

from __future__ import annotations

import jax.numpy as jnp
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
    # The default checkpoint's saves only where a test gives a ModelCheckpoint.
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, callbacks.ModelCheckpoint) for cb in kw.get("callbacks", ())))
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


# -- item 1: accumulate_grad_batches=k is k loader batches per optimizer step --------------------


class FixedRegression(Regression):
    """Starts from w = 0.1, b = 0, as the Lightning run this test mirrors."""

    def configure_model(self, rngs):
        model = nnx.Linear(3, 1, rngs=rngs)
        model.kernel[...] = np.full((3, 1), 0.1, np.float32)
        model.bias[...] = np.zeros(1, np.float32)
        return model


def _lightning_accumulation(x, y, batch, k, epochs, max_steps=None, lr=0.1):
    """SGD as Lightning 2.6 runs accumulate_grad_batches=k: each batch's loss divided by k, a
    step every k batches and at an epoch's last batch (r < k left: still divided by k)."""
    w, b, steps = np.full((3, 1), 0.1), 0.0, 0
    n = len(x) // batch
    for _ in range(epochs):
        for start in range(0, n, k):
            gw, gb = np.zeros_like(w), 0.0
            for i in range(start, min(start + k, n)):
                xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
                r = xb @ w + b - yb
                gw, gb = gw + 2 * xb.T @ r / len(xb), gb + 2 * r.mean()
            w, b, steps = w - lr * gw / k, b - lr * gb / k, steps + 1
            if steps == max_steps:
                return w, b, steps
    return w, b, steps


@pytest.mark.parametrize("strategy", ["single", "dp", "ddp"])
@pytest.mark.parametrize("limits", [{"max_epochs": 2}, {"max_steps": 3, "max_epochs": 5}],
                         ids=["epochs", "max_steps"])
def test_accumulate_grad_batches_counts_loader_batches(strategy, limits):
    # 9 batches of 4 per epoch, k = 4: steps after batches 4, 8 and 9 (Lightning 2.6: 3 steps
    # per epoch, 6 in 2 epochs, weights equal to this replay to 1e-7).
    arrays = _arrays(36)
    module = FixedRegression()
    fit = _fit(strategy, accumulate_grad_batches=4, devices=1 if strategy == "single" else 4,
               **limits)
    fit.fit(module, jl.data.ArrayLoader(arrays, 4, shuffle=False))
    x, y = arrays["x"].astype(np.float64), arrays["y"].astype(np.float64)
    w, b, steps = _lightning_accumulation(x, y, 4, 4, 2, limits.get("max_steps"))
    assert fit.global_step == steps == (6 if "max_steps" not in limits else 3)
    np.testing.assert_allclose(np.asarray(module.model.kernel[...]), w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(module.model.bias[...]), [b], rtol=1e-5, atol=1e-6)
    assert fit.compile_counts["train"] == 1  # the short last group too


# -- item 10: Lightning's trainer.test(dataloaders=..., ckpt_path="best") after a fit -----------


def test_test_after_fit_takes_lightnings_form(tmp_path):
    ckpt = callbacks.ModelCheckpoint(tmp_path / "ckpt", monitor="val_loss", save_top_k=1,
                                     async_save=False)
    module = Regression()
    fit = _fit(max_epochs=3, callbacks=[ckpt])
    fit.fit(module, train_dataloaders=_loader(), val_dataloaders=_loader(seed=1))
    best = fit.test(dataloaders=_loader(seed=1), ckpt_path="best")["test_loss"]
    assert best == pytest.approx(ckpt.best_model_score, rel=1e-5)  # the best epoch's weights
    # A Fit that only evaluates needs no max_steps/max_epochs, as a Lightning Trainer.
    again = _fit().validate(module, dataloaders=_loader(seed=1), ckpt_path=ckpt.best_model_path)
    assert again["val_loss"] == pytest.approx(ckpt.best_model_score, rel=1e-5)
    with pytest.raises(jl.ConfigurationError, match=r"Fit.test\(\) got no module"):
        _fit().test(dataloaders=_loader())


# -- item 4: ModelCheckpoint with ties keeps what Lightning keeps --------------------------------


class Scored(Regression):
    """Validation reports a fixed score per epoch (read from the epoch's data)."""

    def validation_step(self, model, batch):
        return {"score": batch["score"].mean()}

    test_step = validation_step


@pytest.mark.parametrize("scores, kept, best", [
    # Lightning 2.6.6 (run with the same scores, save_top_k=2, 4 epochs; there of 4 steps,
    # kept steps 4, 8 and 8, 12; here of 2 steps):
    ([1.0, 1.0, 1.0, 1.0], [2, 4], 2),  # ties: the first two stay, best is the first
    ([2.0, 2.0, 1.0, 3.0], [4, 6], 6),  # the first of equally worst ones is replaced
], ids=["ties", "worst_ties"])
def test_model_checkpoint_ties_keep_lightnings_checkpoints(tmp_path, scores, kept, best):
    class PerEpoch(callbacks.Callback):
        def on_validation_start(self, fit, module):
            val.arrays["score"][:] = scores[fit.current_epoch]

    val = jl.data.ArrayLoader({"score": np.zeros(8, np.float32)}, 8, shuffle=False)
    ckpt = callbacks.ModelCheckpoint(tmp_path / "ckpt", monitor="val_score", save_top_k=2,
                                     save_last=False, async_save=False)
    fit = _fit("fsdp", max_epochs=4, callbacks=[PerEpoch(), ckpt])
    fit.fit(Scored(), _loader(16, batch=8), val)
    on_disk = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert on_disk == kept
    assert ckpt.best_model_path == str(tmp_path / "ckpt" / str(best))
    assert ckpt.best_k_models == {str(tmp_path / "ckpt" / str(s)): scores[s // 2 - 1]
                                  for s in kept}
    assert ckpt.last_model_path is None  # save_last=False, as Lightning's ""
    Scored.load_from_checkpoint(ckpt.best_model_path)
    assert fit.test(dataloaders=val, ckpt_path="best")["test_score"] == scores[-1]  # it loads


# -- item 9: Lightning's training_step_outputs.append(loss) pattern is refused before training ---


class CollectsOutputs(Regression):
    def __init__(self):
        super().__init__()
        self.training_step_outputs = []

    def training_step(self, model, batch):
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        self.training_step_outputs.append(loss)
        return loss

    def on_train_epoch_end(self):
        self.epoch_mean = sum(self.training_step_outputs) / len(self.training_step_outputs)


def test_collecting_step_outputs_on_self_is_refused_with_the_jaxlight_way():
    steps = []
    fit = _fit(max_epochs=1, callbacks=[callbacks.LambdaCallback(
        on_train_batch_start=lambda *a: steps.append(1))])
    with pytest.raises(jl.PortingError,
                       match=r"CollectsOutputs.training_step uses "
                             r"self.training_step_outputs.append\(...\) \(line \d+\).*"
                             r"self.log\('name', value, on_epoch=True\)"):
        fit.fit(CollectsOutputs(), _loader())
    assert steps == []  # before any training


# -- item 11: module hooks reach the run ---------------------------------------------------------


class ReadsTheRun(Regression):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_epoch_end(self):
        self.seen.append((self.trainer.current_epoch, self.current_epoch, self.global_step,
                          self.trainer.callback_metrics["val_loss"], type(self.logger).__name__))


class StepReadsGlobalStep(Regression):
    def training_step(self, model, batch):
        return super().training_step(model, batch) * (self.global_step + 1)


def test_module_hooks_reach_the_run(tmp_path):
    module = ReadsTheRun()
    fit = _fit(max_epochs=2, logger=callbacks.CSVLogger(tmp_path))
    fit.fit(module, _loader(), _loader(seed=1))
    assert [s[:3] for s in module.seen] == [(0, 0, 8), (1, 1, 16)]
    assert all(np.isfinite(s[3]) and s[4] == "CSVLogger" for s in module.seen)
    assert module.trainer is fit and module.global_step == 16
    with pytest.raises(jl.PortingError, match="global_step was read inside a step"):
        _fit(max_steps=1).fit(StepReadsGlobalStep(), _loader())


# -- item 13: *_dataloader methods on the module give the data -----------------------------------


class OwnLoaders(Regression):
    def setup(self, stage):
        self.stage_set_up = stage

    def train_dataloader(self):
        return _loader()

    def val_dataloader(self):
        return _loader(seed=1)

    def test_dataloader(self):
        return _loader(seed=2)


def test_loaders_defined_on_the_module_are_used():
    module = OwnLoaders()
    fit = _fit(max_epochs=1)
    fit.fit(module)
    assert fit.global_step == 8 and "val_loss" in fit.callback_metrics
    assert module.stage_set_up == "fit"
    tested = fit.test(module)["test_loss"]
    x, y = _arrays(seed=2).values()
    assert tested == pytest.approx(float(((np.asarray(module.model(x)) - y) ** 2).mean()),
                                   rel=1e-5)
    with pytest.raises(jl.ConfigurationError, match="or define predict_dataloader"):
        fit.predict(module)


# -- item 14: the tuple-of-optimizers message says what was returned -----------------------------


class TwoOptimizers(Regression):
    def configure_optimizers(self):
        return optax.sgd(0.1), optax.adam(0.1)


class OptimizersAndSchedulers(Regression):
    def configure_optimizers(self):
        return [optax.sgd(0.1)], [optax.constant_schedule(1.0)]


def test_a_tuple_of_optimizers_is_named_for_what_it_is():
    with pytest.raises(jl.PortingError, match=r"a tuple of 2 items \(2 optimizers, Lightning's "
                                              r"form for several optimizers\)"):
        _fit(max_steps=1).fit(TwoOptimizers(), _loader())
    with pytest.raises(jl.PortingError, match=r"\(Lightning's \(\[optimizers\], \[schedulers\]\) "
                                              r"pair\)"):
        _fit(max_steps=1).fit(OptimizersAndSchedulers(), _loader())


# -- item 12: several validation/test loaders ----------------------------------------------------


class KnowsItsLoader(Regression):
    def validation_step(self, model, batch, dataloader_idx=0):
        loss = ((model(batch["x"]) - batch["y"]) ** 2).mean()
        return {"loss": loss, "idx": jnp.float32(dataloader_idx)}

    test_step = validation_step


def test_several_validation_loaders_are_each_evaluated_with_their_index():
    module = KnowsItsLoader()
    fit = _fit(max_epochs=1)
    fit.fit(module, _loader(), [_loader(8, seed=1), _loader(16, seed=2)])
    names = {k for k in fit.callback_metrics if k.startswith("val_")}
    # Lightning 2.6.6's names for self.log("val_loss") with two loaders.
    assert names == {"val_loss/dataloader_idx_0", "val_loss/dataloader_idx_1",
                     "val_idx/dataloader_idx_0", "val_idx/dataloader_idx_1"}
    tested = fit.test(module, [_loader(8, seed=1), _loader(16, seed=2)])
    for i, (n, seed) in enumerate([(8, 1), (16, 2)]):
        x, y = _arrays(n, seed).values()
        expected = float(((np.asarray(module.model(x)) - y) ** 2).mean())
        assert tested[f"test_loss/dataloader_idx_{i}"] == pytest.approx(expected, rel=1e-5)
        assert tested[f"test_idx/dataloader_idx_{i}"] == i
    # One loader in a list: no suffix, as in Lightning; a list of batches is one loader.
    assert set(fit.validate(module, [_loader(8)])) == {"val_loss", "val_idx"}
    batches = list(_loader(8))
    assert set(fit.validate(module, batches)) == {"val_loss", "val_idx"}


# -- differences the conformance suite found (notes/findings-conf.md) ----------------------------


class ValidationHooks(callbacks.Callback):
    def __init__(self):
        self.calls = []

    def on_validation_start(self, fit, module):
        self.calls.append("on_validation_start")

    def on_validation_epoch_start(self, fit, module):
        self.calls.append("on_validation_epoch_start")

    def on_validation_epoch_end(self, fit, module):
        self.calls.append("on_validation_epoch_end")

    def on_validation_end(self, fit, module):
        self.calls.append("on_validation_end")


def test_conformance_findings_checkpoint_names_and_validate_hooks(tmp_path):
    # Lightning's every_n_train_steps; without a monitor best_model_path is the newest save.
    ckpt = callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=1,
                                     save_last=False, async_save=False)
    hooks = ValidationHooks()
    fit = _fit(max_steps=6, callbacks=[ckpt, hooks])
    module = Regression()
    fit.fit(module, _loader())
    assert ckpt.every_n_steps == 3
    assert ckpt.best_model_path == str(tmp_path / "ckpt" / "6")
    # Fit.validate runs the validation epoch hooks, as Trainer.validate does.
    hooks.calls.clear()
    fit.validate(module, _loader(seed=1))
    assert hooks.calls == ["on_validation_start", "on_validation_epoch_start",
                           "on_validation_epoch_end", "on_validation_end"]


def test_throughput_counts_every_loader_batch_of_an_accumulated_step():
    rates = {}

    class Rates(callbacks.Callback):
        def on_log(self, fit, module, metrics, step):
            if "throughput/samples_per_sec" in metrics:
                rates[step] = (metrics["throughput/samples_per_sec"],
                               metrics["throughput/steps_per_sec"])

    monitor = callbacks.ThroughputMonitor()
    _fit(max_steps=8, accumulate_grad_batches=2, log_every_n_steps=4,
         callbacks=[monitor, Rates()]).fit(Regression(), _loader(64))
    assert rates
    for samples, steps in rates.values():  # 2 loader batches of 4 per optimizer step
        assert samples == pytest.approx(8 * steps, rel=1e-6)
