"""Fit holds what a hand-written `jax.jit` loop holds: the train state, donated to each step.

An H200 run of benchmarks/moe_mfu.py --fit-first (a 3.96 B-parameter MoE, AdamW, bf16-mixed)
ran out of memory allocating its first step's 49 GiB of temporaries, where the hand loop peaked
at state + those temporaries. On CPU the steady state is at parity (live bytes during training,
the compiled step's aliasing: the second test). What differed is the initialization: one
compiled call built the model and the optimizer state, holding 47.5 GB of state and 25.8 GB of
the parameters' initialization temporaries at once (73.3 GB, compiled on CPU at that size; the
freed temporaries likely left the GPU allocator no contiguous 49 GiB). It now takes two calls,
the model then `tx.init`, whose peak is the state (47.5 GB), as the hand loop's.
"""

from __future__ import annotations

import functools
import gc

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.state._state import make_init_fn
from tests.strategies.lm import token_batches
from tests.strategies.moe_lm import TinyMoELM


def _module():
    # Experts large beside the rest: their random initialization's temporaries are too.
    return TinyMoELM(vocab=64, embed=32, layers=2, experts=8, expert_dim=64)


def _fit(precision: str, **kw) -> jl.Fit:
    kw.setdefault("max_steps", 3)
    return jl.Fit("single", precision=precision, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, logger=False, **kw)


def _bytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


@functools.cache
def _trained(precision: str):
    """A 3-step fit at `precision`, the live device bytes before it and at each batch's start
    and end; both tests read the bf16-mixed one (one compile of its step, not two)."""
    seen = []

    def record(fit, *_):
        seen.append(sum(a.nbytes for a in jax.live_arrays()))

    fit = _fit(precision, callbacks=[callbacks.LambdaCallback(
        on_train_batch_start=record, on_train_batch_end=record)])
    module = _module()
    gc.collect()
    before = sum(a.nbytes for a in jax.live_arrays())
    fit.fit(module, token_batches(3, batch=2))
    return fit, module, before, seen


@pytest.mark.slow  # a full-size initialization compiled twice
def test_initialization_holds_at_most_the_state_and_builds_the_same_state():
    fit, module, _, _ = _trained("bf16-mixed")
    state_bytes = _bytes(fit.state)
    # The outputs so far plus a call's temporaries, at most: the state (+ the step counter's
    # and optimizer counts' few bytes). One call held the state plus the parameters'
    # initialization temporaries (+54% here).
    assert fit.strategy.init_peak_bytes is not None
    assert fit.strategy.init_peak_bytes <= state_bytes + 1024, (
        fit.strategy.init_peak_bytes, state_bytes)
    # The same values as one call building all of it.
    session = fit.session
    init = make_init_fn(module, session.optimizer, session.seed)
    split = session.init_state()
    whole = jax.jit(init)()
    for a, b in zip(jax.tree.leaves(split), jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # a second MoE step compile (32-true); the fast tier: the test above
def test_training_holds_the_state_and_the_step_aliases_all_of_it():
    """Live device bytes while training, beside what lived before the fit: the state and a
    batch's few bytes (no copy of the initial weights for `module.model`), as a hand loop."""
    for precision in ("bf16-mixed", "32-true"):
        fit, module, before, seen = _trained(precision)
        state_bytes = _bytes(fit.state)
        # Per batch: its tokens (2 x 17 int32) and metrics, kept two steps in flight.
        assert max(seen) - before <= state_bytes + 4096, (precision, max(seen) - before,
                                                         state_bytes)
        memory = fit.compiled_train_step.memory_analysis()
        assert memory.alias_size_in_bytes == state_bytes, precision
        assert _bytes(module.model) > 0  # the trained model, read after the fit
