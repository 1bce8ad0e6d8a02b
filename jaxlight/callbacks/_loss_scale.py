"""Dynamic loss scaling for float16 training ("16-mixed"), kept on device in the train state.

float16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a
large scale S before the backward pass lifts them into range; gradients are divided by S
before anything reads them. When S is too large the backward pass overflows (Inf or NaN): that
step is skipped (parameters and optimizer state kept bit for bit) and S is halved; after
`growth_interval` finite steps in a row S doubles. These are torch's `GradScaler` rules and
defaults.

The scale and its counter live in the optimizer state (`LossScaleState`, via an optax piece
that only holds it), so they are sharded, donated, checkpointed and resumed with everything
else, and the host never reads them except as logged metrics.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

#: Private metric carrying the step's verdict from `process_gradients` to `transform_step`.
FINITE = "__loss_scale_finite__"


class LossScaleState(NamedTuple):
    """Attributes:
        scale: the loss scale the next step multiplies the loss by (float32).
        good_steps: finite steps since the scale last changed (int32).
        skipped: steps skipped for overflow so far (int32).
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array


def holder(init_scale: float) -> optax.GradientTransformation:
    """An optax piece that only holds `LossScaleState`; the step wrapper updates it."""

    def init(params):
        del params
        zero = jnp.zeros((), jnp.int32)
        return LossScaleState(jnp.asarray(init_scale, jnp.float32), zero, zero)

    def update(updates, state, params=None):
        del params
        return updates, state

    return optax.GradientTransformation(init, update)


def _is_state(x) -> bool:
    return isinstance(x, LossScaleState)


def find(opt_state: Any) -> LossScaleState:
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
    if len(found) != 1:
        raise ValueError(f"expected one LossScaleState in the optimizer state, found {len(found)}")
    return found[0]


def replace(opt_state: Any, new: LossScaleState) -> Any:
    return jax.tree.map(lambda x: new if _is_state(x) else x, opt_state, is_leaf=_is_state)


def all_finite(tree: Any) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def next_state(old: LossScaleState, finite: jax.Array, growth_interval: int,
               growth_factor: float, backoff_factor: float) -> LossScaleState:
    """GradScaler's rule: back off on overflow, grow after `growth_interval` finite steps."""
    good = jnp.where(finite, old.good_steps + 1, 0).astype(jnp.int32)
    grow = good >= growth_interval
    scale = jnp.where(finite, jnp.where(grow, old.scale * growth_factor, old.scale),
                      old.scale * backoff_factor)
    # A scale that overflows float32 stops growing (float16's range is far below it anyway).
    scale = jnp.where(jnp.isfinite(scale), scale, old.scale).astype(jnp.float32)
    good = jnp.where(grow, 0, good).astype(jnp.int32)
    skipped = (old.skipped + jnp.logical_not(finite)).astype(jnp.int32)
    return LossScaleState(scale, good, skipped)
