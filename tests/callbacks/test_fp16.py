"""precision="16-mixed": float16 compute with dynamic loss scaling (issue 15 item 9)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from jaxlight.callbacks._loss_scale import LossScaleState, find
from tests.models import Classifier, classification_data, saves_checkpoints

BATCH = 32


def _batches(n: int, seed: int = 0) -> list[dict]:
    data = classification_data(n * BATCH, seed=seed)
    return [{k: v[i * BATCH:(i + 1) * BATCH] for k, v in data.items()} for i in range(n)]


def _train(batches, cbs=(), strategy="single", ckpt_path=None, **kw):
    logs: list[dict] = []
    kw.setdefault("max_steps", len(batches))
    fit = jl.Fit(strategy, callbacks=[*cbs, callbacks.LambdaCallback(
        on_log=lambda fit, module, metrics, step: logs.append(dict(metrics)))],
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        logger=False, enable_checkpointing=saves_checkpoints(cbs), **kw)
    module = Classifier()
    fit.fit(module, batches, ckpt_path=ckpt_path)
    return module, fit, logs


def _params(module) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module.model, nnx.Param))]


def _scale(fit) -> LossScaleState:
    return jax.device_get(find(fit.strategy.to_canonical(fit.state).opt_state))


def _rel(a, b) -> float:
    num = sum(float(np.sum((x.astype(np.float64) - y) ** 2)) for x, y in zip(a, b, strict=True))
    return (num / sum(float(np.sum(y.astype(np.float64) ** 2)) for y in b)) ** 0.5


def test_16_mixed_matches_fp32_within_fp16_tolerance():
    batches = _batches(4)
    ref, _, ref_logs = _train(batches)
    mixed, fit, logs = _train(batches, [callbacks.MixedPrecision("16-mixed", init_scale=2.0**8)])
    assert fit.compile_counts["train"] == 1
    assert [m["overflow_skipped"] for m in logs] == [0.0] * 4
    # float16 keeps 11 significant bits (a loss rounds by up to 2**-11 ~ 5e-4 relative); after
    # four Adam steps the parameters differ by ~5e-5 (bfloat16's 8 bits: ~2e-3, which fails).
    assert _rel(_params(mixed), _params(ref)) < 5e-4
    for a, b in zip(logs, ref_logs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)
    assert {str(x.dtype) for x in _params(mixed)} == {"float32"}  # master weights


def test_16_mixed_dots_are_float16():
    from jaxlight.step._step import build_train_step

    fit = jl.Fit("single", max_steps=1, precision="16-mixed", enable_progress_bar=False,
                 logger=False)
    module = Classifier()
    fit.session.setup(module)
    step = build_train_step(module, fit.session.spec.graphdef, fit.session.optimizer,
                            fit.callbacks, fit.strategy)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batches(1)[0])
    text = jax.jit(step).lower(fit.session.spec.abstract_state, batch).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert dots and all(line.count("f16>") == 3 for line in dots), dots


def test_an_overflowing_step_is_skipped_and_the_scale_halved():
    good = _batches(2)
    bad = dict(good[1], x=np.where(np.arange(BATCH)[:, None] == 3, np.inf, good[1]["x"]))
    cbs = lambda: [callbacks.MixedPrecision("16-mixed", init_scale=2.0**8)]  # noqa: E731
    one, fit_one, _ = _train(good[:1], cbs())
    two, fit_two, logs = _train([good[0], bad], cbs())
    # Step 2's gradients are Inf/NaN: the parameters and optimizer state are step 1's, bit for bit.
    for a, b in zip(_params(two), _params(one), strict=True):
        np.testing.assert_array_equal(a, b)
    opt_one = jax.device_get(fit_one.state.opt_state)
    opt_two = jax.device_get(fit_two.state.opt_state)
    not_scale = lambda s: [x for x in jax.tree.leaves(  # noqa: E731
        jax.tree.map(lambda v: None if isinstance(v, LossScaleState) else v, s,
                     is_leaf=lambda v: isinstance(v, LossScaleState)))]
    for a, b in zip(not_scale(opt_two), not_scale(opt_one), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _scale(fit_one).scale == 2.0**8
    assert (_scale(fit_two).scale, _scale(fit_two).good_steps, _scale(fit_two).skipped) == \
        (2.0**7, 0, 1)
    assert [m["loss_scale"] for m in logs] == [2.0**8, 2.0**8]
    assert [m["overflow_skipped"] for m in logs] == [0.0, 1.0]


def test_the_default_scale_overflows_float16_then_backs_off():
    # 2**16 is beyond float16's largest value (65504): the loss's cotangent is Inf, as with
    # torch's GradScaler at its default, so the first step is skipped.
    _, fit, logs = _train(_batches(3), precision="16-mixed")
    assert [m["loss_scale"] for m in logs] == [2.0**16, 2.0**15, 2.0**15]
    assert [m["overflow_skipped"] for m in logs] == [1.0, 1.0, 1.0]


@pytest.mark.slow
def test_the_scale_grows_and_resumes_from_a_checkpoint(tmp_path):
    cbs = lambda: [callbacks.MixedPrecision("16-mixed", init_scale=1.0,  # noqa: E731
                                            growth_interval=2)]
    batches = _batches(5)
    whole, fit, logs = _train(batches, cbs())
    assert [m["loss_scale"] for m in logs] == [1.0, 1.0, 2.0, 2.0, 4.0]
    ckpt = str(tmp_path / "ckpt")
    _train(batches, [*cbs(), callbacks.ModelCheckpoint(ckpt, every_n_steps=3)], max_steps=3)
    resumed, fit_resumed, _ = _train(batches, cbs(), ckpt_path=ckpt)
    assert _scale(fit_resumed) == _scale(fit)
    for a, b in zip(_params(resumed), _params(whole), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [strategies.DDP, strategies.FSDP])
def test_skips_under_data_parallel_strategies(strategy):
    good = _batches(2)
    bad = dict(good[1], x=np.where(np.arange(BATCH)[:, None] == 3, np.inf, good[1]["x"]))
    cbs = [callbacks.MixedPrecision("16-mixed", init_scale=2.0**8),
           callbacks.Microbatches(2)]
    _, fit, logs = _train([good[0], bad], cbs, strategy=strategy())
    assert [m["overflow_skipped"] for m in logs] == [0.0, 1.0]
    assert _scale(fit).scale == 2.0**7


def test_bad_loss_scaling_arguments_are_refused():
    with pytest.raises(jl.ConfigurationError, match="backoff_factor=2"):
        callbacks.MixedPrecision("16-mixed", backoff_factor=2)
    with pytest.raises(jl.ConfigurationError, match="'16-mixed'"):
        callbacks.MixedPrecision("16-true")
    assert callbacks.MixedPrecision(16).precision == "16-mixed"


def test_the_optimizer_state_holds_one_loss_scale():
    tx = callbacks.MixedPrecision("16-mixed").transform_optimizer(optax.sgd(0.1))
    state = tx.init({"w": np.zeros(2, np.float32)})
    assert isinstance(find(state), LossScaleState)


# -- with NonFiniteGuard -------------------------------------------------------------------------


def test_overflows_while_the_scale_is_found_do_not_trip_the_guard():
    # 2**20 overflows float16 five times (2**20 .. 2**16) before 2**15 fits: the loss scale's
    # business, as with torch's GradScaler; a guard stopping after 2 must not count them.
    cbs = [callbacks.MixedPrecision("16-mixed", init_scale=2.0**20), callbacks.NonFiniteGuard(2)]
    _, fit, logs = _train(_batches(8), cbs)
    assert [m["loss_scale"] for m in logs] == [2.0**k for k in (20, 19, 18, 17, 16, 15, 15, 15)]
    assert logs[-1]["overflow_skipped"] == 5.0
    assert [m["nonfinite_skipped"] for m in logs] == [0.0] * 8
    assert [m["nonfinite_consecutive"] for m in logs] == [0.0] * 8
    assert int(fit.global_step) == 8


def test_a_loss_that_stays_nan_still_trips_the_guard_under_16_mixed():
    # NaN inputs: the gradients are NaN at every scale. The scale backs off 4 -> 2 -> 1 -> 0.5
    # (overflow handling); below 1 the guard counts: steps 4 and 5 trip max_consecutive=2.
    nan = [dict(b, x=np.full_like(b["x"], np.nan)) for b in _batches(6)]
    cbs = [callbacks.MixedPrecision("16-mixed", init_scale=4.0), callbacks.NonFiniteGuard(2)]
    with pytest.raises(jl.TrainingStopped, match=r"2 training steps in a row \(steps 4 to 5\)"):
        _train(nan, cbs)


def test_a_guard_inside_the_loss_scale_is_refused():
    cbs = [callbacks.NonFiniteGuard(2), callbacks.MixedPrecision("16-mixed")]
    with pytest.raises(jl.ConfigurationError,
                       match=r"NonFiniteGuard comes before MixedPrecision\('16-mixed'\)"):
        _train(_batches(1), cbs)
