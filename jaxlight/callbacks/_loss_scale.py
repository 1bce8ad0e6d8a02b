"""Dynamic loss scaling for float16 training ("16-mixed"): one optax transformation and the loss
piece that reads its scale.

float16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss's
cotangent by a large scale S lifts the backward pass into range; the gradients are divided by
S as they leave it, before anything reads them. When S is too large the backward pass
overflows (Inf or NaN): that step is skipped (parameters and optimizer state kept bit for bit)
and S is halved; after `growth_interval` finite steps in a row S doubles. These are torch's
`GradScaler` rules and defaults.

The scale, its growth counter and the skip decision live in the state of one optax
transformation, `dynamic_loss_scale(inner)` (`ScaledState`), so they are sharded, donated,
checkpointed and resumed with everything else, and the host never reads them except as logged
metrics. The loss piece (`scaled_loss`) takes the scale as an argument: the step reads it from
the optimizer state it starts from (`find`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight.schedules._scheduler import one_state_of, states_of


class LossScaleState(NamedTuple):
    """Attributes:
        scale: the loss scale the next step multiplies the loss by (float32).
        good_steps: finite steps since the scale last changed (int32).
        skipped: steps skipped for overflow so far (int32).
    """

    scale: jax.Array
    good_steps: jax.Array
    skipped: jax.Array


class ScaledState(NamedTuple):
    """The optax state of `dynamic_loss_scale(inner)`: the scaler and `inner`'s own state."""

    scaler: LossScaleState
    inner: Any


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


def dynamic_loss_scale(inner: optax.GradientTransformation, init_scale: float,
                       growth_interval: int, growth_factor: float,
                       backoff_factor: float) -> optax.GradientTransformation:
    """`inner`, skipping overflowing steps and adjusting the loss scale it keeps (optax style).

    The gradients it receives are already unscaled (`scaled_loss` divides them by the scale in
    the backward pass, so clipping and metrics read true gradients). A step whose gradients
    hold Inf or NaN applies a zero update, keeps `inner`'s state as it was and backs the scale
    off; a finite step applies `inner` and may grow the scale (`next_state`).
    """

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        scaler = LossScaleState(jnp.asarray(init_scale, jnp.float32), zero, zero)
        return ScaledState(scaler, inner.init(params))

    def update(grads, state, params=None):
        finite = all_finite(grads)
        updates, inner_state = inner.update(grads, state.inner, params)
        inner_state = jax.tree.map(lambda new, old: jax.lax.select(finite, new, old),
                                   inner_state, state.inner)
        # -0.0: p + (-0.0) is p bit for bit, so a skipped optimizer of several named ones
        # keeps its parameters exactly.
        updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.full_like(u, -0.0)), updates)
        scaler = next_state(state.scaler, finite, growth_interval, growth_factor,
                            backoff_factor)
        return updates, ScaledState(scaler, inner_state)

    return optax.GradientTransformation(init, update)


def find(opt_state: Any) -> LossScaleState:
    """The loss scaler in an optimizer state holding one `dynamic_loss_scale` (with named
    optimizers, one per optimizer: their scale and growth counter are equal, see `find_all`)."""
    return find_all(opt_state)[0]


def find_all(opt_state: Any) -> list[LossScaleState]:
    """The loss scalers: one, or one per named optimizer (inside their optax.partition)."""
    found = [s.scaler for s in states_of(opt_state, ScaledState)]
    if not found:
        one_state_of(opt_state, LossScaleState, "MixedPrecision", "loss scales")  # raises
    return found


def replace_all(opt_state: Any, scalers: list[LossScaleState]) -> Any:
    """`opt_state` with its scalers replaced, in the order `find_all` gives them."""
    def is_state(x) -> bool:
        return isinstance(x, ScaledState)

    new = iter(scalers)
    return jax.tree.map(lambda x: x._replace(scaler=next(new)) if is_state(x) else x,
                        opt_state, is_leaf=is_state)


@jax.custom_vjp
def _scale_cotangent(x: Any, factor: jax.Array) -> Any:
    """The identity on `x`, whose cotangent is multiplied by `factor` on the way back."""
    del factor
    return x


def _scale_cotangent_fwd(x, factor):
    return x, factor


def _scale_cotangent_bwd(factor, cotangent):
    scaled = jax.tree.map(lambda c: (c * factor).astype(c.dtype), cotangent)
    return scaled, jnp.zeros_like(factor)


_scale_cotangent.defvjp(_scale_cotangent_fwd, _scale_cotangent_bwd)


def scaled_loss(loss_fn: Callable, scale: jax.Array) -> Callable:
    """`loss_fn` whose backward pass runs `scale` times larger, its gradients unscaled.

    The loss value is unchanged; its cotangent starts at `scale` (float32), flows through the
    float16 backward pass, and the parameters' cotangents are multiplied by `1 / scale` as they
    leave it, in the parameters' dtype (float32 master weights).
    """
    inverse = 1.0 / scale

    def loss_scaled_backward(params, rest, batch):
        loss, aux = loss_fn(_scale_cotangent(params, inverse), rest, batch)
        return _scale_cotangent(loss, scale), aux

    return loss_scaled_backward
