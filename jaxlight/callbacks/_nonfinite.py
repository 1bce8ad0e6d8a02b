"""NonFiniteGuard: skip steps whose gradients hold NaN or Inf; stop after too many in a row."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback
from jaxlight.callbacks._loss_scale import LossScaleState, ScaledState
from jaxlight.schedules._scheduler import one_state_of, states_of


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


class GuardedState(NamedTuple):
    """The optax state of `skip_nonfinite(inner)`: its counters and `inner`'s own state."""

    counters: NonFiniteState
    inner: Any


def all_finite(tree: Any) -> jax.Array:
    """Whether every value of every leaf is finite (one boolean, on device)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(tree)]))


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner`, except that it skips non-finite gradients, counting them (optax style).

    A step whose gradients hold NaN or Inf, or any step once `tripped_step` is set, applies a
    zero update and keeps `inner`'s state as it was; `NonFiniteState` counts such steps. The
    step wrapper of `NonFiniteGuard` sets `tripped_step` (it knows the step number) and keeps
    the parameters and other variables bit for bit on a skipped step.

    When `inner` holds a dynamic loss scale (`MixedPrecision("16-mixed")`), a non-finite step
    at a scale of 1 or more is float16 overflow of the scaled loss: it is the loss scale's to
    handle (it skips the update and backs off), so the guard lets `inner` run and neither
    counts nor resets the streak. At a scale below 1 the gradients are not finite even
    unscaled: the guard counts and skips the step as it would in float32.
    """

    def init(params):
        zero = jnp.zeros((), jnp.int32)
        return GuardedState(NonFiniteState(zero, zero, jnp.full((), -1, jnp.int32)),
                            inner.init(params))

    def update(grads, state, params=None):
        finite = all_finite(grads)
        counters = state.counters
        scaler = _loss_scale_in(state.inner)
        counted = jnp.logical_not(finite)
        if scaler is not None:
            counted = jnp.logical_and(counted, scaler.scale < 1)
        apply = jnp.logical_and(jnp.logical_not(counted), counters.tripped_step < 0)
        updates, inner_state = inner.update(grads, state.inner, params)
        inner_state = jax.tree.map(lambda new, old: jax.lax.select(apply, new, old),
                                   inner_state, state.inner)
        # -0.0, not 0.0: p + (-0.0) is p bit for bit (p + 0.0 turns -0.0 into 0.0), so a
        # skipped optimizer of several named ones keeps its parameters exactly.
        updates = jax.tree.map(lambda u: jnp.where(apply, u, jnp.full_like(u, -0.0)), updates)
        # An overflow the loss scale handles neither counts nor ends a streak.
        consecutive = jnp.where(counted, counters.consecutive + 1,
                                jnp.where(finite, 0, counters.consecutive))
        counters = NonFiniteState(
            consecutive=consecutive.astype(jnp.int32),
            skipped=(counters.skipped + jnp.logical_not(apply)).astype(jnp.int32),
            tripped_step=counters.tripped_step,
        )
        return updates, GuardedState(counters, inner_state)

    return optax.GradientTransformation(init, update)


def _is_state(x) -> bool:
    return isinstance(x, GuardedState)


def _loss_scale_in(inner_state) -> LossScaleState | None:
    found = states_of(inner_state, LossScaleState)
    return found[0] if found else None


def _check_nesting(opt_state) -> None:
    """Refuses a loss scale wrapping the guard: the guard would never see an overflow."""
    if any(states_of(s.inner, GuardedState) for s in states_of(opt_state, ScaledState)):
        raise ConfigurationError(
            "NonFiniteGuard comes before MixedPrecision('16-mixed') in callbacks, so the loss "
            "scale wraps the guard: the guard would never see a non-finite step, and a run "
            "whose loss stays NaN would skip steps forever. List MixedPrecision first and "
            "NonFiniteGuard after it (Fit(precision='16-mixed') already adds MixedPrecision "
            "first)."
        )


def _find_all(opt_state) -> list[GuardedState]:
    """The guard's states: one, or one per named optimizer (inside their optax.partition)."""
    found = states_of(opt_state, GuardedState)
    if not found:
        one_state_of(opt_state, GuardedState, "NonFiniteGuard", "counter states")  # raises
    return found


def _replace_all(opt_state, new: list[GuardedState]):
    """`opt_state` with its guard states replaced, in the order `_find_all` gives them."""
    replacements = iter(new)
    return jax.tree.map(lambda x: next(replacements) if _is_state(x) else x, opt_state,
                        is_leaf=_is_state)


class NonFiniteGuard(Callback):
    """Skips steps whose gradients hold NaN or Inf; stops the fit after `max_consecutive` in a row.

    On device, with no host synchronization: the step's global gradients (after the
    cross-replica reduction and any clipping) are tested with `isfinite`; a non-finite step
    keeps the previous parameters, optimizer state and other variables bit for bit (a select,
    not an update by zero). The counters (`NonFiniteState`) live in the optimizer state of the
    guard's own optax transformation (`skip_nonfinite`, which wraps the optimizer and skips the
    update), so checkpoints carry them; they reach the host as metrics: `nonfinite_skipped`
    (steps skipped so far), `nonfinite_consecutive` and `nonfinite_tripped_step`.

    When `max_consecutive` non-finite steps occur in a row, the device records that step and
    freezes the state from then on (every later step is skipped too). The host sees it at the
    next log interval, or at the latest when the epoch or the fit ends, and stops the fit with
    `jaxlight.TrainingStopped`. Because the record is sticky and the state frozen, a host that
    only looks every `log_every_n_steps` steps cannot miss a streak, and the parameters the fit
    ends with (`module.model`) are those from before the streak, whenever the host noticed.

    With `precision="16-mixed"`, an overflowing step is the loss scale's, as with PyTorch's
    GradScaler: it skips the step and lowers the scale (`overflow_skipped` counts it), and the
    guard does not count it, so the overflows with which dynamic loss scaling finds its scale
    at the start of training never stop a run. Once the scale is below 1, non-finite gradients
    are not overflow of the scaled loss, and the guard counts them as in float32. List
    `NonFiniteGuard` after `MixedPrecision` (the other order is refused).

    With named optimizers (automatic optimization) the guard wraps each optimizer inside their
    optax.partition: one whose gradients are non-finite skips only its own update (its
    parameters and state kept bit for bit); `rest` is kept unless every optimizer applied its
    update; one optimizer's streak reaching `max_consecutive` freezes them all and stops the fit.

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
        return skip_nonfinite(tx)

    def transform_step(self, step_fn: Callable) -> Callable:
        limit = self.max_consecutive

        def guarded_step(state, batch):
            _check_nesting(state.opt_state)
            new_state, metrics = step_fn(state, batch)
            olds, news = _find_all(state.opt_state), _find_all(new_state.opt_state)
            # Each optimizer skipped this step exactly when it counted one more skip.
            applied = [n.counters.skipped == o.counters.skipped
                       for o, n in zip(olds, news, strict=True)]
            all_applied = jnp.all(jnp.stack(applied))
            frozen = olds[0].counters.tripped_step >= 0
            streak = jnp.max(jnp.stack([n.counters.consecutive for n in news]))
            tripped = jnp.where(
                frozen, olds[0].counters.tripped_step,
                jnp.where(streak >= limit, new_state.step, -1),
            ).astype(jnp.int32)
            counters = [n.counters._replace(tripped_step=tripped) for n in news]

            def keep(new_value, prev):
                return jax.lax.select(all_applied, new_value, prev)

            if len(news) == 1:
                params = jax.tree.map(keep, new_state.params, state.params)
                opt_state = jax.tree.map(keep, new_state.opt_state, state.opt_state)
            else:
                # Named optimizers: each skipped one already kept its parameters (an update of
                # -0.0) and its optimizer state; the others were applied.
                params, opt_state = new_state.params, new_state.opt_state
            opt_state = _replace_all(
                opt_state, [n._replace(counters=c) for n, c in zip(news, counters, strict=True)])
            # The model's other variables (batch statistics) advance only when every
            # optimizer applied its update.
            rest = jax.tree.map(keep, new_state.rest, state.rest)
            skipped = sum(c.skipped for c in counters)
            metrics = {
                **metrics,
                "nonfinite_skipped": skipped.astype(jnp.float32),
                "nonfinite_consecutive": streak.astype(jnp.float32),
                "nonfinite_tripped_step": tripped.astype(jnp.float32),
            }
            return new_state.replace(params=params, opt_state=opt_state, rest=rest), metrics

        return guarded_step

    #: Also read the newest step's metrics between log intervals (the fit's last step).
    reads_every_step = True

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
