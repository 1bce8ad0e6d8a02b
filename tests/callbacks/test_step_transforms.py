"""Step-transforming callbacks: GradientAccumulation, MixedPrecision, GradientClipping, guard.

Tolerances (never loosened to pass), as relative L2 over all parameters and relative per-step
loss against SingleDevice running the same callbacks:
- float32 steps: 1e-5 (observed <= 1e-6: summation order only);
- bfloat16 compute: 1e-2, about 2.5 bfloat16 units in the last place (2**-8); observed ~2e-3.
Accumulation against one full-batch step: 1e-6 after 10 steps (the issue's target).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, strategies
from jaxlight.analysis._hlo import summarize
from jaxlight.step._microbatch import accumulate_locally
from tests.models import Classifier, classification_data

FP32_RTOL = 1e-5
BF16_RTOL = 1e-2
STEPS = 4
BATCH = 64  # divisible by k=4 × 8 devices


class AnnotatedMLP(nnx.Module):
    """Column- then row-parallel MLP: shards under FSDP ("embed"), TP ("mlp") and Hybrid."""

    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.l1 = nn.Dense(din, hidden, axes=("embed", "mlp"), use_bias=True, rngs=rngs)
        self.l2 = nn.Dense(hidden, dout, axes=("mlp", "embed"), use_bias=True, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class Net(jl.TrainModule):
    def __init__(self, hidden: int = 32, lr: float = 1e-2):
        super().__init__()
        self.hidden, self.lr = hidden, lr

    def configure_model(self, rngs):
        return AnnotatedMLP(16, self.hidden, 8, rngs=rngs)

    def configure_optimizers(self):
        return optax.adam(self.lr)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}


def _batches(n: int, size: int = BATCH, seed: int = 0) -> list[dict]:
    data = classification_data(n * size, din=16, classes=8, seed=seed)
    return [{k: v[i * size:(i + 1) * size] for k, v in data.items()} for i in range(n)]


def _fit(strategy, cbs=(), **kw) -> tuple[jl.Fit, list[dict]]:
    logs: list[dict] = []
    kw.setdefault("max_steps", STEPS)
    kw.setdefault("log_every_n_steps", 1)
    fit = jl.Fit(strategy, callbacks=[*cbs, callbacks.LambdaCallback(
        on_log=lambda fit, module, metrics, step: logs.append(dict(metrics)))],
        enable_progress_bar=False, enable_model_summary=False, logger=False,
        enable_checkpointing=False, **kw)
    return fit, logs


def _train(strategy, cbs, module=None, batches=None, **kw):
    module = module or Net()
    fit, logs = _fit(strategy, cbs, **kw)
    fit.fit(module, batches if batches is not None else _batches(STEPS))
    return module, fit, logs


def _params(module) -> dict:
    return nnx.to_pure_dict(nnx.state(module.model, nnx.Param))


def _rel(a, b) -> float:
    """Relative L2 distance of two parameter trees (float64 on the host)."""
    la = [np.asarray(x, np.float64) for x in _leaves(a)]
    lb = [np.asarray(x, np.float64) for x in _leaves(b)]
    num = sum(float(np.sum((x - y) ** 2)) for x, y in zip(la, lb, strict=True))
    return (num / sum(float(np.sum(y**2)) for y in lb)) ** 0.5


def _leaves(tree):
    import jax

    return jax.tree.leaves(jax.device_get(tree))


# -- the strategy × callback matrix --------------------------------------------------------------

CONFIGS = {
    "accumulate4": (lambda: [callbacks.Microbatches(4)], FP32_RTOL),
    "bf16-mixed": (lambda: [callbacks.MixedPrecision("bf16-mixed")], BF16_RTOL),
    "clip1": (lambda: [callbacks.GradientClipping(1.0)], FP32_RTOL),
    "all": (lambda: [callbacks.Microbatches(4), callbacks.MixedPrecision("bf16-mixed"),
                     callbacks.GradientClipping(1.0), callbacks.NonFiniteGuard(3)], BF16_RTOL),
}

STRATEGIES = {
    "ddp": strategies.DDP,
    "dp": strategies.DataParallel,
    "fsdp": strategies.FSDP,
    "tp2": lambda: strategies.TensorParallel(2),
    "hybrid": lambda: strategies.Hybrid({"data": 2, "fsdp": 2, "tp": 2}),
}


@pytest.fixture(scope="module")
def reference():
    """SingleDevice runs of each callback configuration, computed once."""
    cache: dict[str, tuple] = {}

    def get(config: str):
        if config not in cache:
            module, _, logs = _train(strategies.SingleDevice(), CONFIGS[config][0]())
            cache[config] = (_params(module), logs)
        return cache[config]

    return get


# The fast tier runs every strategy but DDP with all the transforms at once (DDP's equivalence
# with one device is in tests/strategies/test_tiny_equivalence.py); each alone, and DDP, the
# whole suite.
@pytest.mark.parametrize("config", [c if c == "all" else pytest.param(c, marks=pytest.mark.slow)
                                    for c in CONFIGS])
@pytest.mark.parametrize("strategy", [s if s != "ddp" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in STRATEGIES])
def test_matches_single_device(strategy, config, reference):
    make_cbs, rtol = CONFIGS[config]
    module, fit, logs = _train(STRATEGIES[strategy](), make_cbs())
    ref_params, ref_logs = reference(config)
    assert fit.compile_counts["train"] == 1
    assert _rel(_params(module), ref_params) < rtol
    assert len(logs) == len(ref_logs) == STEPS
    for got, want in zip(logs, ref_logs, strict=True):
        assert abs(got["loss"] - want["loss"]) <= rtol * abs(want["loss"])
        if "grad_norm" in want:
            assert abs(got["grad_norm"] - want["grad_norm"]) <= rtol * want["grad_norm"]
    if config == "clip1":
        # The first step starts from the same parameters everywhere: the global norm over all
        # shards (FSDP, TP, Hybrid) equals SingleDevice's to 1e-6, and it exceeds max_norm, so
        # clipping really acted.
        first, want = logs[0]["grad_norm"], ref_logs[0]["grad_norm"]
        assert want > 1.0
        assert abs(first - want) <= 1e-6 * want
    if config == "all":
        assert logs[-1]["nonfinite_skipped"] == 0.0


def test_clip_by_value_bounds_every_element():
    cb = callbacks.GradientClipping(0.5, algorithm="value")
    grads = {"a": np.array([-2.0, 0.1, 3.0], np.float32)}
    clipped, metrics = cb.process_gradients(grads, {})
    np.testing.assert_allclose(np.asarray(clipped["a"]), [-0.5, 0.1, 0.5])
    np.testing.assert_allclose(float(metrics["grad_norm"]), np.sqrt(4 + 0.01 + 9), rtol=1e-6)


# -- accumulation ----------------------------------------------------------------------------------


def test_accumulation_equals_full_batch_after_10_steps():
    batches = _batches(10)
    full, _, full_logs = _train(strategies.SingleDevice(), [], batches=batches, max_steps=10)
    acc, fit, logs = _train(strategies.SingleDevice(), [callbacks.Microbatches(4)],
                            batches=batches, max_steps=10)
    assert _rel(_params(acc), _params(full)) < 1e-6
    np.testing.assert_allclose([m["loss"] for m in logs], [m["loss"] for m in full_logs],
                               rtol=1e-6)
    assert fit.compile_counts["train"] == 1


class _NaiveAccumulation(callbacks.Callback):
    """A plain scan under SPMD jit: what GradientAccumulation must not compile to."""

    def __init__(self, k):
        self.k = k

    def transform_grad(self, grad_fn):
        return accumulate_locally(grad_fn, self.k)


def _plan(strategy, cbs, module=None, batch=None):
    fit, _ = _fit(strategy, cbs, max_steps=1)
    return fit.plan(module or Net(), batch or _batches(1)[0], verbose=False)


def _bytes_by_kind(plan) -> dict[str, int]:
    return {k: v["buffer_bytes"] for k, v in summarize(plan.collectives).items() if v["count"]}


@pytest.mark.slow
@pytest.mark.parametrize("make", [strategies.DataParallel, strategies.FSDP, strategies.DDP],
                         ids=["dp", "fsdp", "ddp"])
def test_collective_bytes_do_not_grow_with_k(make):
    one = _plan(make(), [callbacks.Microbatches(1)])
    eight = _plan(make(), [callbacks.Microbatches(8)])
    assert _bytes_by_kind(one) == _bytes_by_kind(eight)
    assert _bytes_by_kind(eight)["all-reduce"] > 0
    assert not [c for c in eight.collectives if c.in_loop], "a collective runs per microbatch"
    if make is not strategies.FSDP:
        # Replicated parameters: the same all-reduce as the step without accumulation. (FSDP
        # gathers the parameters once per step at the loop's boundary instead.)
        assert _bytes_by_kind(_plan(make(), [])) == _bytes_by_kind(eight)


def test_naive_scan_would_all_reduce_inside_the_loop():
    """The control: a plain scan under DataParallel puts the gradient all-reduce in the loop."""
    naive = _plan(strategies.DataParallel(), [_NaiveAccumulation(8)])
    looped = [c for c in naive.collectives if c.kind == "all-reduce" and c.in_loop]
    assert looped and all(c.executions == 8 for c in looped)
    good = _plan(strategies.DataParallel(), [callbacks.Microbatches(8)])
    assert _bytes_by_kind(naive)["all-reduce"] > 4 * _bytes_by_kind(good)["all-reduce"]


def test_tensor_parallel_loop_holds_only_tp_collectives():
    """Under TP(2) x data(4) only the tp activation all-reduce (group of 2) runs per
    microbatch; the gradient all-reduce over the 4 data replicas runs once."""
    plan = _plan(strategies.TensorParallel(2), [callbacks.Microbatches(8)])
    assert {c.group_size for c in plan.collectives if c.in_loop} == {2}
    outside = [c for c in plan.collectives if not c.in_loop and c.kind == "all-reduce"]
    assert any(c.group_size == 4 for c in outside)


class WideNet(Net):
    """Parameter-heavy (a 512 x 512 middle layer), so per-device parameter copies dominate."""

    def configure_model(self, rngs):
        return nnx.Sequential(
            nn.Dense(16, 512, axes=("embed", "mlp"), rngs=rngs), nnx.relu,
            nn.Dense(512, 512, axes=("mlp", "embed"), rngs=rngs), nnx.relu,
            nn.Dense(512, 8, axes=("embed", "mlp"), rngs=rngs))


@pytest.mark.slow
def test_fsdp_sync_every_microbatch_keeps_state_sharded(reference):
    """The opt-in alternative for models too large to gather whole: collectives inside the
    loop, less temporary memory than reducing once per step, the same result."""
    per_step = _plan(strategies.FSDP(), [callbacks.Microbatches(8)], module=WideNet())
    per_micro = _plan(strategies.FSDP(), [
        callbacks.Microbatches(8, sync_every_microbatch=True)], module=WideNet())
    assert [c for c in per_micro.collectives if c.in_loop and c.executions == 8]
    assert per_micro.memory["temp"] < per_step.memory["temp"] / 2
    module, _, _ = _train(strategies.FSDP(), [
        callbacks.Microbatches(4, sync_every_microbatch=True)])
    ref_params, _ = reference("accumulate4")
    assert _rel(_params(module), ref_params) < FP32_RTOL


@pytest.mark.slow
def test_temp_memory_falls_as_k_grows():
    batch = _batches(1, size=1024)[0]
    temps = [_plan(strategies.DataParallel(), [callbacks.Microbatches(k)],
                   module=Net(hidden=256), batch=batch).memory["temp"] for k in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(temps[:-1], temps[1:], strict=True)), temps
    assert temps[-1] < temps[0] / 2, temps


@pytest.mark.slow  # accumulation against one device is in the fast tier above
def test_accumulation_threads_batch_stats_and_rngs():
    """BatchNorm statistics and dropout RNG state (`rest`) go through the microbatch scan and
    the per-replica shard_map, keeping their dtypes; the guard selects them too."""

    class BNNet(Classifier):
        def configure_model(self, rngs):
            return nnx.Sequential(nnx.Linear(16, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs),
                                  nnx.Dropout(0.1, rngs=rngs), nnx.Linear(32, 4, rngs=rngs))

    data = classification_data(128)
    batches = [{k: v[i * 64:(i + 1) * 64] for k, v in data.items()} for i in range(2)]
    module = BNNet()
    fit, logs = _fit(strategies.DataParallel(), [
        callbacks.Microbatches(4), callbacks.MixedPrecision("bf16-mixed"),
        callbacks.NonFiniteGuard(2)], max_steps=2)
    fit.fit(module, batches)
    mean = np.asarray(module.model.layers[1].mean[...])
    assert mean.dtype == np.float32 and np.abs(mean).sum() > 0  # statistics were updated
    assert np.isfinite(logs[-1]["loss"])


# -- mixed precision -------------------------------------------------------------------------------


def _lowered_text(strategy, cbs) -> str:
    """The step as traced (pre-optimization StableHLO). XLA:CPU upcasts bf16 dots when it
    optimizes, so the dtype policy is checked where it is decided; accelerators keep it."""
    import jax

    from jaxlight.step._step import build_train_step

    fit, _ = _fit(strategy, cbs)
    module = Net()
    fit.session.setup(module)
    spec = fit.session.spec
    step = build_train_step(module, spec.graphdef, fit.session.optimizer, fit.callbacks,
                            fit.strategy)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batches(1)[0])
    with fit.strategy.trace_context():
        return jax.jit(step).lower(spec.abstract_state, batch).as_text()


def test_bf16_mixed_dots_are_bf16_and_master_params_fp32():
    text = _lowered_text(strategies.DataParallel(), [callbacks.MixedPrecision("bf16-mixed"),
                                                     callbacks.Microbatches(2)])
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 5  # 2 forward, 3 backward (no input gradient for the first layer)
    assert all(line.count("bf16>") == 3 for line in dots), dots
    fp32 = _lowered_text(strategies.DataParallel(), [])
    assert not [line for line in fp32.splitlines() if "dot_general" in line and "bf16" in line]

    plan = _plan(strategies.DataParallel(), [callbacks.MixedPrecision("bf16-mixed"),
                                             callbacks.Microbatches(2)])
    reduced = [dtype for c in plan.collectives for dtype, _ in c.shapes]
    assert reduced and set(reduced) == {"f32"}  # gradients and loss all-reduced in float32

    module, fit, logs = _train(strategies.DataParallel(), [callbacks.MixedPrecision("bf16-mixed")],
                               max_steps=2)
    assert {str(x.dtype) for x in _leaves(_params(module))} == {"float32"}
    assert {str(x.dtype) for x in _leaves(fit.state.opt_state)} <= {"float32", "int32"}


def test_bf16_true_stores_bf16_params_and_trains():
    module, fit, logs = _train(strategies.DataParallel(), [callbacks.MixedPrecision("bf16-true")],
                               max_steps=3)
    assert {str(x.dtype) for x in _leaves(_params(module))} == {"bfloat16"}
    assert "bfloat16" in {str(x.dtype) for x in _leaves(fit.state.opt_state)}
    assert fit.compile_counts["train"] == 1
    assert logs[-1]["loss"] < logs[0]["loss"]


# -- non-finite guard --------------------------------------------------------------------------


def _with_nan(batch: dict) -> dict:
    bad = {k: v.copy() for k, v in batch.items()}
    bad["x"][3, 2] = np.nan
    return bad


def test_guard_skips_a_nan_step_exactly():
    b = _batches(3)
    guard = [callbacks.NonFiniteGuard(2)]
    skipped, fit, logs = _train(strategies.SingleDevice(), guard,
                                batches=[b[0], b[1], _with_nan(b[0]), b[2]], max_steps=4)
    clean, clean_fit, _ = _train(strategies.SingleDevice(), [callbacks.NonFiniteGuard(2)],
                                 batches=[b[0], b[1], b[2]], max_steps=3)
    # Bit-identical: the NaN step changed neither parameters nor optimizer state.
    for x, y in zip(_leaves(_params(skipped)), _leaves(_params(clean)), strict=True):
        np.testing.assert_array_equal(x, y)
    assert [m["nonfinite_skipped"] for m in logs] == [0.0, 0.0, 1.0, 1.0]
    assert [m["nonfinite_consecutive"] for m in logs] == [0.0, 0.0, 1.0, 0.0]


def test_guard_stops_after_consecutive_nans_even_between_log_intervals():
    """Two NaN steps in a row (limit 2), then finite ones, with the host looking only at the
    end: the sticky device-side record still stops the fit, and the parameters are those from
    before the streak."""
    b = _batches(3)
    stream = [b[0], _with_nan(b[1]), _with_nan(b[1]), b[1], b[2]]
    module = Net()
    fit, _ = _fit(strategies.DataParallel(), [callbacks.NonFiniteGuard(2)], max_steps=5,
                  log_every_n_steps=100)
    with pytest.raises(jl.TrainingStopped, match=r"2 training steps in a row \(steps 2 to 3\)"):
        fit.fit(module, stream)
    before, _, _ = _train(strategies.DataParallel(), [callbacks.NonFiniteGuard(2)],
                          batches=[b[0]], max_steps=1)
    for x, y in zip(_leaves(_params(module)), _leaves(_params(before)), strict=True):
        np.testing.assert_array_equal(x, y)
    assert fit.logged_metrics["nonfinite_skipped"] == 4.0


# -- bad input and shortcuts -------------------------------------------------------------------


@pytest.mark.parametrize("make", [strategies.DataParallel, strategies.DDP], ids=["dp", "ddp"])
def test_batch_not_divisible_by_k_times_dp(make):
    fit, _ = _fit(make(), [callbacks.Microbatches(4)], max_steps=1)
    with pytest.raises(jl.DataError, match=r"global batch size 48 .* k=4 × data-parallel "
                                           r"degree 8 = 32.*multiple of 32"):
        fit.fit(Net(), _batches(1, size=48))


def test_unknown_precision_lists_valid_values():
    with pytest.raises(jl.ConfigurationError, match=r"unknown precision 'fp16'.*'32-true'.*"
                                                    r"'bf16-mixed'.*'bf16-true'"):
        jl.Fit("single", max_steps=1, precision="fp16")
    with pytest.raises(jl.ConfigurationError, match="Did you mean 'bf16-mixed'"):
        callbacks.MixedPrecision("bf16-mix")


@pytest.mark.parametrize("value", [0, 0.0, -1.0, float("nan")])
def test_max_norm_must_be_positive(value):
    with pytest.raises(jl.ConfigurationError, match=r"finite max_norm > 0, got"):
        jl.Fit("single", max_steps=1, gradient_clip_val=value)


def test_other_bad_arguments():
    with pytest.raises(jl.ConfigurationError, match="unknown gradient clipping algorithm 'nrm'"):
        callbacks.GradientClipping(1.0, algorithm="nrm")
    with pytest.raises(jl.ConfigurationError, match="positive integer number of loader batches"):
        jl.Fit("single", max_steps=1, accumulate_grad_batches=0)
    with pytest.raises(jl.ConfigurationError, match="max_consecutive.*positive integer"):
        callbacks.NonFiniteGuard(0)


@pytest.mark.parametrize("kwargs, cb", [
    ({"precision": "bf16-mixed"}, lambda: callbacks.MixedPrecision("bf16-true")),
    ({"accumulate_grad_batches": 4}, lambda: callbacks.GradientAccumulation(2)),
    ({"gradient_clip_val": 1.0}, lambda: callbacks.GradientClipping(2.0)),
], ids=["precision", "accumulate", "clip"])
def test_shortcut_and_same_callback_is_an_error(kwargs, cb):
    (arg, value), = kwargs.items()
    with pytest.raises(jl.ConfigurationError, match=rf"Fit\({arg}={value!r}\) and callbacks\."):
        jl.Fit("single", max_steps=1, callbacks=[cb()], **kwargs)


def test_shortcuts_add_the_callbacks():
    fit = jl.Fit("single", max_steps=1, precision="bf16-true", accumulate_grad_batches=2,
                 gradient_clip_val=0.5, gradient_clip_algorithm="value")
    by_type = {type(cb): cb for cb in fit.callbacks}
    assert by_type[callbacks.MixedPrecision].precision == "bf16-true"
    assert by_type[callbacks.GradientAccumulation].k == 2
    clip = by_type[callbacks.GradientClipping]
    assert (clip.max_norm, clip.algorithm) == (0.5, "value")
    plain = jl.Fit("single", max_steps=1, precision="32-true", accumulate_grad_batches=1)
    assert not any(isinstance(cb, callbacks.MixedPrecision | callbacks.GradientAccumulation)
                   for cb in plain.callbacks)
