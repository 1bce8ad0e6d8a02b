"""The fit core's parts through their public names (issue 14 items 1, 2, 6): the frozen config,
the loop state, checkpoint restore that returns what Fit adopts, the properties callbacks read,
and step transforms composed in one place (gradient computation, the guard's optax state,
loggers by type, preemption outside the hook dispatch)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight._fit import FitConfig, LoopState
from jaxlight._fit._preemption import PreemptionHandler
from jaxlight.callbacks._base import Callback, Logger
from jaxlight.callbacks._nonfinite import GuardedState, NonFiniteState, skip_nonfinite
from jaxlight.checkpoint._restore import restore_training
from tests.models import Classifier, classification_data


def _fit(**kw):
    kw.setdefault("max_steps", 4)
    # The default checkpoint's saves only where a test gives a ModelCheckpoint.
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, callbacks.ModelCheckpoint) for cb in kw.get("callbacks", ())))
    return jl.Fit("single", enable_progress_bar=False, enable_model_summary=False,
                  logger=False, log_every_n_steps=1, **kw)


def _data(n=128, batch=16):
    return jl.data.ArrayLoader(classification_data(n), batch)


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_config_is_validated_once_and_frozen():
    config = FitConfig.create(max_steps=3, fast_dev_run=2)
    assert (config.max_steps, config.max_epochs, config.limit_val_batches) == (2, 1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_steps = 5
    fit = _fit()
    with pytest.raises(AttributeError):
        fit.max_steps = 10  # read-only: settings are the frozen config's
    with pytest.raises(jl.ConfigurationError, match="prefetch_batches must be an integer >= 0"):
        FitConfig.create(max_steps=1, prefetch_batches=-1)


def test_max_steps_minus_one_is_no_limit():
    """Lightning's -1: `Fit.max_steps` reads -1 when not given, and max_steps=-1 is no limit
    (the epoch count decides; the progress bar's total comes from the epochs)."""
    from jaxlight.callbacks._progress import total_steps

    fit = _fit(max_steps=None, max_epochs=1)
    assert fit.max_steps == -1 and _fit(max_steps=-1, max_epochs=1).max_steps == -1
    fit.fit(Classifier(), _data())
    assert fit.global_step == 8 and total_steps(fit) == 8
    with pytest.raises(jl.ConfigurationError, match="max_steps must be a positive integer"):
        FitConfig.create(max_steps=-2)


def test_loop_state_keeps_the_first_stop_reason():
    state = LoopState()
    state.request_stop("first")
    state.request_stop("second")
    assert state.should_stop and state.stop_reason == "first"
    state.start(multi_process=False)
    assert state.stop_reason is None and not state.should_stop


def test_restore_returns_state_and_position_and_only_the_fit_adopts_them():
    module = Classifier()
    _fit(callbacks=[callbacks.ModelCheckpoint("ckpt", every_n_steps=2)]).fit(module, _data())
    other = _fit(max_steps=6)
    other.session.setup(Classifier())
    restored = restore_training(other.session, "ckpt/4")
    assert restored.position == (4, 0, 4)
    assert other.global_step == 0 and other.session.state is None  # nothing was assigned
    for a, b in zip(jax.tree.leaves(restored.state.params), _params(module.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other.fit(Classifier(), _data(), ckpt_path="ckpt/4")
    assert other.global_step == 6


def test_callbacks_read_validation_data_and_interval_through_properties():
    seen = []
    val = _data(32)
    probe = callbacks.LambdaCallback(
        on_train_start=lambda fit, module: seen.append((fit.val_data, fit.val_every_n_steps)))
    _fit(max_steps=8, val_check_interval=0.5, callbacks=[probe]).fit(Classifier(), _data(), val)
    assert seen == [(val, 4)]  # 8 batches per epoch, half an epoch


def test_a_custom_gradient_computation_replaces_the_strategy_layout():
    class TwoMicrobatches(Callback):
        def gradient_computation(self, compute, strategy):
            return lambda grad_fn: strategy.accumulate_gradients(grad_fn, 2)

    custom, builtin = Classifier(), Classifier()
    _fit(callbacks=[TwoMicrobatches()]).fit(custom, _data())
    _fit(callbacks=[callbacks.Microbatches(2)]).fit(builtin, _data())
    for a, b in zip(_params(custom.model), _params(builtin.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_skip_nonfinite_is_an_optax_transformation_that_holds_its_counters():
    tx = skip_nonfinite(optax.adam(0.1))
    params = {"w": np.ones(3, np.float32)}
    state = tx.init(params)
    assert isinstance(state, GuardedState) and isinstance(state.counters, NonFiniteState)
    # Compiled, as a step runs them (one compile each; run op by op, each operation compiled).
    update, adam_update = jax.jit(tx.update), jax.jit(optax.adam(0.1).update)
    good = {"w": np.full(3, 0.5, np.float32)}
    updates, after_good = update(good, state, params)
    reference, _ = adam_update(good, optax.adam(0.1).init(params), params)
    np.testing.assert_array_equal(updates["w"], reference["w"])
    bad = {"w": np.array([1.0, np.nan, 0.0], np.float32)}
    updates, after_bad = update(bad, after_good, params)
    np.testing.assert_array_equal(updates["w"], np.zeros(3, np.float32))
    for a, b in zip(jax.tree.leaves(after_bad.inner), jax.tree.leaves(after_good.inner),
                    strict=True):
        np.testing.assert_array_equal(a, b)  # the inner optimizer's state did not move
    assert (int(after_bad.counters.skipped), int(after_bad.counters.consecutive)) == (1, 1)


def test_the_guard_keeps_its_counters_in_the_train_state_and_no_private_metric():
    keys = []
    probe = callbacks.LambdaCallback(
        on_train_batch_end=lambda fit, module, out, batch, i: keys.append(set(out.metrics)))
    fit = _fit(callbacks=[callbacks.NonFiniteGuard(2), probe])
    fit.fit(Classifier(), _data())
    found = [x for x in jax.tree.leaves(fit.state.opt_state,
                                        is_leaf=lambda x: isinstance(x, GuardedState))
             if isinstance(x, GuardedState)]
    assert len(found) == 1 and int(found[0].counters.skipped) == 0
    assert all(not any(k.startswith("_") for k in step) for step in keys), keys
    assert "nonfinite_skipped" in keys[0]


def test_a_logger_is_known_by_its_type():
    class Collect(Logger):
        def __init__(self):
            self.rows = []

        def on_log(self, fit, module, metrics, step):
            self.rows.append(step)

    mine = Collect()
    fit = jl.Fit("single", max_steps=2, enable_progress_bar=False, enable_model_summary=False,
                 log_every_n_steps=1, callbacks=[mine], enable_checkpointing=False)
    assert not any(isinstance(cb, callbacks.CSVLogger) for cb in fit.callbacks)
    fit.fit(Classifier(), _data())
    assert mine.rows[:2] == [1, 2]


def test_preemption_is_the_loops_not_a_callback():
    assert not isinstance(PreemptionHandler(), Callback)
    fit = _fit()
    assert all(isinstance(cb, Callback) for cb in fit.callbacks)
    assert not any(isinstance(cb, PreemptionHandler) for cb in fit.callbacks)
