"""NonFiniteGuard: skip steps whose gradients hold NaN or Inf; stop after too many in a row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback

#: Private metric carrying this step's verdict from `process_gradients` to `transform_step`.
_FINITE = "__nonfinite_guard_finite__"


class NonFiniteState(NamedTuple):
    """The guard's counters, kept on device in the optimizer state (so checkpoints carry them).

    Attributes:
        consecutive: non-finite steps in a row, up to the latest step (int32).
        skipped: steps skipped so far (int32).
        tripped_step: the step at which `consecutive` reached the limit, or -1 (int32).
    """

    consecutive: jax.Array
    skipped: jax.Array
    tripped_step: jax.Array


def _counters() -> optax.GradientTransformation:
    """An optax piece that only holds `NonFiniteState`; the guard's step wrapper updates it."""

    def init(params):
        del params
        zero = jnp.zeros((), jnp.int32)
        return NonFiniteState(zero, zero, jnp.full((), -1, jnp.int32))

    def update(updates, state, params=None):
        del params
        return updates, state

    return optax.GradientTransformation(init, update)


def _is_state(x) -> bool:
    return isinstance(x, NonFiniteState)


def _find(opt_state) -> NonFiniteState:
    found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_state) if _is_state(x)]
    if len(found) != 1:
        raise ConfigurationError(
            f"NonFiniteGuard found {len(found)} counter states in the optimizer state (expected "
            "1); use one NonFiniteGuard per Fit."
        )
    return found[0]


def _replace(opt_state, new: NonFiniteState):
    return jax.tree.map(lambda x: new if _is_state(x) else x, opt_state, is_leaf=_is_state)


class NonFiniteGuard(Callback):
    """Skips steps whose gradients hold NaN or Inf; stops the fit after `max_consecutive` in a row.

    On device, with no host synchronization: the step's global gradients (after the
    cross-replica reduction and any clipping) are tested with `isfinite`; a non-finite step
    keeps the previous parameters, optimizer state and other variables bit for bit (a select,
    not an update by zero). Counters live in the optimizer state (`NonFiniteState`) and reach the
    host as metrics: `nonfinite_skipped` (steps skipped so far), `nonfinite_consecutive` and
    `nonfinite_tripped_step`.

    When `max_consecutive` non-finite steps occur in a row, the device records that step and
    freezes the state from then on (every later step is skipped too). The host sees it at the
    next log interval, or at the latest when the epoch or the fit ends, and stops the fit with
    `jaxlight.TrainingStopped`. Because the record is sticky and the state frozen, a host that
    only looks every `log_every_n_steps` steps cannot miss a streak, and the parameters the fit
    ends with (`module.model`) are those from before the streak, whenever the host noticed.

    Args:
        max_consecutive: non-finite steps in a row that stop the fit (>= 1).

    Example:
        >>> from jaxlight import callbacks
        >>> guard = callbacks.NonFiniteGuard(max_consecutive=3)
    """

    def __init__(self, max_consecutive: int = 5):
        if isinstance(max_consecutive, bool) or not isinstance(max_consecutive, int) \
                or max_consecutive < 1:
            raise ConfigurationError(
                f"NonFiniteGuard(max_consecutive) needs a positive integer, got "
                f"{max_consecutive!r}."
            )
        self.max_consecutive = max_consecutive

    def transform_optimizer(self, tx):
        return optax.chain(tx, _counters())

    def process_gradients(self, grads: Any, metrics: dict) -> tuple[Any, dict]:
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        return grads, {**metrics, _FINITE: finite}

    def transform_step(self, step_fn: Callable) -> Callable:
        limit = self.max_consecutive

        def guarded_step(state, batch):
            new_state, metrics = step_fn(state, batch)
            metrics = dict(metrics)
            finite = metrics.pop(_FINITE)
            old = _find(state.opt_state)
            frozen = old.tripped_step >= 0
            apply = jnp.logical_and(finite, jnp.logical_not(frozen))
            consecutive = jnp.where(finite, 0, old.consecutive + 1).astype(jnp.int32)
            skipped = (old.skipped + jnp.logical_not(apply)).astype(jnp.int32)
            tripped = jnp.where(
                frozen, old.tripped_step, jnp.where(consecutive >= limit, new_state.step, -1)
            ).astype(jnp.int32)

            def keep(new, prev):
                return jax.lax.select(apply, new, prev)

            params = jax.tree.map(keep, new_state.params, state.params)
            opt_state = jax.tree.map(keep, new_state.opt_state, state.opt_state)
            opt_state = _replace(opt_state, NonFiniteState(consecutive, skipped, tripped))
            rest = jax.tree.map(keep, new_state.rest, state.rest)
            metrics.update(
                nonfinite_skipped=skipped.astype(jnp.float32),
                nonfinite_consecutive=consecutive.astype(jnp.float32),
                nonfinite_tripped_step=tripped.astype(jnp.float32),
            )
            return new_state.replace(params=params, opt_state=opt_state, rest=rest), metrics

        return guarded_step

    def on_log(self, fit, module, metrics: dict[str, float], step: int) -> None:
        tripped = int(metrics.get("nonfinite_tripped_step", -1))
        if tripped < 0:
            return
        first = tripped - self.max_consecutive + 1
        fit.request_stop(
            f"error: NonFiniteGuard: {self.max_consecutive} training steps in a row (steps "
            f"{first} to {tripped}) had NaN or Inf gradients (max_consecutive="
            f"{self.max_consecutive}). They were skipped, and so was every later step: the "
            f"parameters and optimizer state are those after step {first - 1}. The host noticed "
            f"at step {step}. Lower the learning rate, add GradientClipping, check the data for "
            "NaN/Inf, or raise max_consecutive."
        )

    def __repr__(self) -> str:
        return f"NonFiniteGuard(max_consecutive={self.max_consecutive})"
