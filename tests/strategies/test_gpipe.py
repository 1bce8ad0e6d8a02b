"""GPipe and pipelined Hybrid meshes: equivalence, schedule, layout, callbacks, bad input."""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, strategies
from jaxlight.nn._pipeline import bubble_fraction
from jaxlight.strategies._pipelined import schedule_stats
from tests.models import Classifier, classification_data, saves_checkpoints
from tests.strategies.lm import TinyLM, token_batches

STEPS, BATCH, LENGTH, EMBED, LAYERS = 10, 16, 9, 32, 4  # sequences of 8 tokens after the shift


def _fit(strategy, steps=STEPS, cbs=(), val=None, batch=BATCH):
    losses = []
    log = callbacks.LambdaCallback(on_log=lambda fit, m, metrics, step: losses.append(
        metrics["loss"]) if "loss" in metrics else None)
    fit = jl.Fit(strategy=strategy, max_steps=steps, log_every_n_steps=1,
                 callbacks=[log, *cbs], enable_progress_bar=False, enable_model_summary=False,
                 logger=False,  # a run saves only where its callbacks ask
                 enable_checkpointing=saves_checkpoints(cbs))
    module = TinyLM(layers=LAYERS, embed=EMBED, mlp=64)
    fit.fit(module, token_batches(steps, batch=batch, length=LENGTH), val)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return {"fit": fit, "module": module, "losses": np.asarray(losses), "params": params}


def _close(run, ref, tol=1e-4):
    rel = np.abs(run["losses"] - ref["losses"]) / np.abs(ref["losses"])
    assert rel.max() < tol, (run["losses"], ref["losses"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(run["params"]),
                            jax.tree.leaves(ref["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("gpipe_ckpt"))
    val = token_batches(2, batch=BATCH, length=LENGTH, seed=1)
    return {
        "single": _fit(strategies.SingleDevice(), val=val),
        "gpipe": _fit(strategies.GPipe(stages=4, microbatches=8), val=val,
                      cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)]),
        "hybrid": _fit(strategies.Hybrid({"data": 2, "pipe": 4}, microbatches=8)),
        "ckpt": ckpt,
        "val": val,
    }


@pytest.mark.slow
def test_gpipe_and_hybrid_match_single_device(runs):
    assert len(runs["single"]["losses"]) == STEPS
    _close(runs["gpipe"], runs["single"])
    _close(runs["hybrid"], runs["single"])
    for name in ("gpipe", "hybrid"):
        assert runs[name]["fit"].compile_counts["train"] == 1


@pytest.mark.slow
def test_validation_under_gpipe_matches(runs):
    # Evaluation vmaps single examples through the model: the schedule as one microbatch.
    gpipe, single = runs["gpipe"]["fit"], runs["single"]["fit"]
    assert gpipe.callback_metrics["val_loss"] == pytest.approx(
        single.callback_metrics["val_loss"], rel=1e-4)


@pytest.mark.slow
def test_schedule_iterations_and_permute_bytes(runs):
    fit = runs["gpipe"]["fit"]
    p, m = 4, 8
    assert fit.strategy.describe()["pipeline"]["iterations"] == m + p - 1
    stats = schedule_stats(fit.compiled_train_step.as_text())
    # One permute in the forward and one in the backward loop body, each loop running
    # m + p − 1 iterations (the trip counts XLA recorded in the compiled HLO).
    assert stats["iterations"] == [m + p - 1] * 2
    b = BATCH // (m * 2)  # microbatch per device: data degree 2
    assert stats["collective_permute_bytes"] == 2 * (m + p - 1) * b * (LENGTH - 1) * EMBED * 4


@pytest.mark.slow
def test_each_device_holds_only_its_stage(runs):
    state = runs["gpipe"]["fit"].state
    stacked = state.params["blocks"]["layers"]
    leaves = jax.tree.leaves(stacked)
    total = sum(x.nbytes for x in leaves)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
    assert per_device <= 1.05 * total / 4
    for x in leaves:
        assert x.sharding.spec[0] == "pipe"
    # The optimizer slots of the stacked layers are split the same way.
    mu = state.opt_state[0].mu["blocks"]["layers"]
    for x in jax.tree.leaves(mu):
        assert x.addressable_shards[0].data.shape[0] == x.shape[0] // 4


@pytest.mark.slow
def test_gpipe_checkpoint_restores_under_other_strategies(runs):
    expected = runs["gpipe"]["params"]
    for strategy in ("single", strategies.FSDP(), strategies.GPipe(4, 8)):
        model = jl.load_checkpoint(os.path.join(runs["ckpt"], str(STEPS)),
                                   TinyLM(layers=LAYERS, embed=EMBED, mlp=64), strategy=strategy)
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.slow
def test_gradient_accumulation_under_gpipe_is_exact(runs):
    # k = 2 equal microbatches give the full-batch mean gradient: the plain SingleDevice run.
    run = _fit(strategies.GPipe(4, 4), cbs=[callbacks.Microbatches(2)], steps=5)
    ref = {"losses": runs["single"]["losses"][:5]}
    rel = np.abs(run["losses"] - ref["losses"]) / ref["losses"]
    assert rel.max() < 1e-4


# -- a tiny stacked model for the cheap cases -------------------------------------------------


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.dense = nn.Dense(8, 8, axes=("embed", "mlp"), use_bias=True, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x))


class _StackNet(nnx.Module):
    def __init__(self, layers, rngs, call_stack=True):
        self.inp = nnx.Linear(4, 8, rngs=rngs)
        self.blocks = nn.Stacked(_Block, layers, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)
        self.call_stack = call_stack

    def __call__(self, x):
        h = self.inp(x)
        if self.call_stack:
            h = self.blocks(h)
        else:  # loops over the stacked layers itself: nothing for a pipeline to run
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(block, carry):
                return block(carry)

            h = body(self.blocks.layers, h)
        return self.out(h)


class _Regression(jl.TrainModule):
    def __init__(self, layers=4, call_stack=True):
        super().__init__()
        self.layers, self.call_stack = layers, call_stack

    def configure_model(self, rngs):
        return _StackNet(self.layers, rngs, self.call_stack)

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def training_step(self, model, batch):
        return ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean()


def _regression_data(steps, batch):
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(batch, 4)).astype(np.float32),
             "y": rng.normal(size=(batch,)).astype(np.float32)} for _ in range(steps)]


def _quick_fit(strategy, module, data, cbs=()):
    logged = []
    log = callbacks.LambdaCallback(on_log=lambda fit, m, metrics, step: logged.append(metrics))
    fit = jl.Fit(strategy=strategy, max_steps=len(data), log_every_n_steps=1,
                 callbacks=[log, *cbs], enable_progress_bar=False, enable_model_summary=False,
                 logger=False, enable_checkpointing=False)
    fit.fit(module, data)
    fit.history = {k: np.asarray([m[k] for m in logged]) for k in logged[0] if k != "epoch"}
    return fit


@pytest.mark.slow
def test_mixed_precision_and_clipping_under_gpipe():
    data = _regression_data(3, 16)
    cbs = lambda: [callbacks.MixedPrecision("bf16-mixed"), callbacks.GradientClipping(0.05)]  # noqa: E731
    ref = _quick_fit("single", _Regression(), data, cbs()).history
    fit = _quick_fit(strategies.GPipe(4, 4), _Regression(), data, cbs())
    assert (fit.history["grad_norm"] > 0.05).all()  # the clipping is active
    # bf16 compute: the two layouts round differently, so bf16-level agreement.
    np.testing.assert_allclose(fit.history["grad_norm"], ref["grad_norm"], rtol=1e-2)
    np.testing.assert_allclose(fit.history["loss"], ref["loss"], rtol=1e-2)
    for x in jax.tree.leaves(fit.state.params):
        assert x.dtype == jnp.float32  # bf16-mixed keeps fp32 master weights


@pytest.mark.slow
def test_fewer_microbatches_than_stages_warns_and_trains_with_remat():
    data = _regression_data(3, 8)
    ref = _quick_fit("single", _Regression(), data).history["loss"]
    with pytest.warns(UserWarning, match=r"idle 60% .*bubble \(p−1\)/\(m\+p−1\) = 3/5"):
        fit = _quick_fit(strategies.GPipe(4, 2, remat=True), _Regression(), data)
    # Rematerialized stages recompute the same activations: the same trajectory.
    np.testing.assert_allclose(fit.history["loss"], ref, rtol=1e-5)


def test_layers_not_divisible_by_stages():
    strategy = strategies.GPipe(stages=3, microbatches=4, devices=jax.devices()[:6])
    with pytest.raises(jl.ConfigurationError, match=r"4 layers .* do not split into 3 pipeline "
                                                    r"stages. Use a stage count dividing 4 "
                                                    r"\(\[1, 2, 4\]\)"):
        _quick_fit(strategy, _Regression(layers=4), _regression_data(1, 12))


def test_batch_not_divisible_by_microbatches_times_data():
    with pytest.raises(jl.DataError, match=r"global batch size 12 .* microbatches 4 × "
                                           r"data-parallel degree 2 = 8 .* \(for example 8 or "
                                           r"16\)"):
        _quick_fit(strategies.GPipe(4, 4), _Regression(), _regression_data(1, 12))


def test_accumulation_split_too_small_for_microbatches():
    # 16 rows pass the global check (16 = 4 × 2 × 2), but k = 4 leaves 2 rows per replica
    # and accumulation step, which cannot feed 4 microbatches.
    with pytest.raises(jl.DataError, match=r"Stacked block has 2 examples, which do not split "
                                           r"into 4 microbatches"):
        _quick_fit(strategies.GPipe(4, 4), _Regression(), _regression_data(1, 16),
                   cbs=[callbacks.Microbatches(4)])


def test_model_without_stacked_block():
    module = Classifier()
    data = [classification_data(16)]
    with pytest.raises(jl.ConfigurationError, match=r"no parameter has the logical axis "
                                                    r"'layers'.*jaxlight.nn.Stacked"):
        _quick_fit(strategies.GPipe(4, 4), module, data)


def test_stacked_block_not_called_as_a_module():
    with pytest.raises(jl.ConfigurationError, match=r"ran no jaxlight.nn.Stacked block.*"
                                                    r"x = self.blocks\(x, ...\)"):
        _quick_fit(strategies.GPipe(4, 4), _Regression(call_stack=False),
                   _regression_data(1, 8))


@pytest.mark.parametrize("kwargs, match", [
    ({"stages": 0}, r"stages must be a positive int"),
    ({"stages": 4, "microbatches": 0}, r"microbatches must be a positive int"),
    ({"stages": 4, "rules": {"layers": None}}, r"'layers' axis .* always maps to the 'pipe'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(jl.ConfigurationError, match=match):
        strategies.GPipe(**kwargs)


def test_alias_and_defaults():
    strategy = strategies.resolve("gpipe")
    assert isinstance(strategy, strategies.GPipe)
    strategy.setup(None)
    assert dict(strategy.mesh.shape) == {"pipe": jax.device_count()}
    info = strategy.describe()["pipeline"]
    p = jax.device_count()
    assert info["microbatches"] == 2 * p
    assert info["bubble_fraction"] == pytest.approx((p - 1) / (3 * p - 1))
    assert math.isclose(bubble_fraction(4, 8), 3 / 11)
