"""The interleaved (circular) pipeline schedule: GPipe and Hybrid with repeats=v."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, strategies
from jaxlight.nn._pipeline import bubble_fraction, schedule_iterations
from jaxlight.strategies._pipelined import schedule_stats

WIDTH, LAYERS, STEPS, BATCH = 8, 8, 5, 16


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.dense = nn.Dense(WIDTH, WIDTH, axes=("embed", "mlp"), use_bias=True, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x))


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(4, WIDTH, rngs=rngs)
        self.blocks = nn.Stacked(_Block, LAYERS, rngs=rngs)
        self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.blocks(self.inp(x)))


class _Regression(jl.TrainModule):
    def configure_model(self, rngs):
        return _Net(rngs)

    def configure_optimizers(self):
        return optax.adam(1e-2)

    def training_step(self, model, batch):
        return ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean()

    def validation_step(self, model, batch):
        return {"loss": ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean()}


def _data(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(BATCH, 4)).astype(np.float32),
             "y": rng.normal(size=(BATCH,)).astype(np.float32)} for _ in range(steps)]


def _fit(strategy, val=None):
    losses = []
    log = callbacks.LambdaCallback(on_log=lambda fit, m, metrics, step: losses.append(
        metrics["loss"]) if "loss" in metrics else None)
    fit = jl.Fit(strategy=strategy, max_steps=STEPS, log_every_n_steps=1, callbacks=[log],
                 enable_progress_bar=False, enable_model_summary=False, logger=False)
    module = _Regression()
    fit.fit(module, _data(STEPS), val)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return {"fit": fit, "losses": np.asarray(losses), "params": params}


@pytest.fixture(scope="module")
def runs():
    val = _data(1, seed=1)
    return {
        "single": _fit("single", val),
        # 8 layers as 4 stages × 2 chunks: stage s runs layers {s, s + 4}.
        "gpipe": _fit(strategies.GPipe(4, 4, repeats=2, devices=jax.devices()[:4]), val),
        # data 2 × pipe 2, 4 chunks per stage.
        "hybrid": _fit(strategies.Hybrid({"data": 2, "pipe": 2}, microbatches=2, repeats=4,
                                         devices=jax.devices()[:4])),
    }


def test_interleaved_matches_single_device(runs):
    ref = runs["single"]
    assert len(ref["losses"]) == STEPS
    for name in ("gpipe", "hybrid"):
        run = runs[name]
        np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(run["params"]), jax.tree.leaves(ref["params"]),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert run["fit"].compile_counts["train"] == 1
    # Evaluation runs single examples: one microbatch, padded to p slots of the ring.
    assert runs["gpipe"]["fit"].callback_metrics["val_loss"] == pytest.approx(
        runs["single"]["fit"].callback_metrics["val_loss"], rel=1e-5)


def test_schedule_iterations_bubble_and_permute_bytes(runs):
    p, m, v = 4, 4, 2
    info = runs["gpipe"]["fit"].strategy.describe()["pipeline"]
    assert info["schedule"] == "interleaved" and info["repeats"] == v
    assert info["iterations"] == v * m + p - 1 == 11
    assert info["bubble_fraction"] == pytest.approx(3 / 11)
    stats = schedule_stats(runs["gpipe"]["fit"].compiled_train_step.as_text())
    # The forward and backward schedule loops each run v·m + p − 1 permutes of one (b, h)
    # activation; the other permutes run once (the stack's relayout into chunks).
    assert sorted(stats["iterations"])[-2:] == [v * m + p - 1] * 2
    assert [n for n in stats["iterations"] if n > 1] == [v * m + p - 1] * 2
    b = BATCH // m
    assert stats["schedule_permute_bytes"] == 2 * (v * m + p - 1) * b * WIDTH * 4


def test_bubble_formula():
    assert [bubble_fraction(4, 8, v) for v in (1, 2, 4)] == pytest.approx(
        [3 / 11, 3 / 19, 3 / 35])
    assert [schedule_iterations(4, 8, v) for v in (1, 2, 4)] == [11, 19, 35]
    # Fewer microbatches than stages: the ring still runs p slots.
    assert schedule_iterations(4, 2, 2) == 11
    assert bubble_fraction(4, 2, 2) == pytest.approx(1 - 4 / 11)


def test_layers_not_divisible_by_stages_times_repeats():
    strategy = strategies.GPipe(4, 4, repeats=4, devices=jax.devices()[:4])
    fit = jl.Fit(strategy=strategy, max_steps=1, enable_progress_bar=False, logger=False)
    with pytest.raises(jl.ConfigurationError, match=r"8 layers .* do not split into 4 stages "
                                                    r"× 4 repeats = 16 chunks.*\[1, 2, 4, 8\]"):
        fit.fit(_Regression(), _data(1))


def test_bad_repeats_and_stages_with_repeats():
    with pytest.raises(jl.ConfigurationError, match=r"repeats .* must be a positive int, got 0"):
        strategies.GPipe(4, 4, repeats=0)
    with pytest.raises(jl.ConfigurationError, match=r"repeats .* must be a positive int"):
        strategies.Hybrid({"pipe": 4}, repeats=1.5)
    from tests.nn.stages_mlp import StageMLP, stage_data

    fit = jl.Fit(strategies.GPipe(2, 2, repeats=2, devices=jax.devices()[:2]), max_steps=1,
                 enable_progress_bar=False, logger=False)
    with pytest.raises(jl.ConfigurationError, match=r"Stages runs the GPipe schedule only "
                                                    r"\(repeats=1\), got repeats=2"):
        fit.fit(StageMLP(stages=4), jl.data.ArrayLoader(stage_data(8), 8))
