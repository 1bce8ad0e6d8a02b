"""A scheduler of Lightning's `lr_scheduler` dict, checked, and its part of the optimizer state.

Everything a scheduler keeps lives in the optimizer state (`ScheduleState`), so it is sharded,
donated and checkpointed with the train state and resumes bit for bit. The training step only
multiplies the optimizer's updates by the current factor (for Adam, SGD and AdamW, whose
updates are linear in the learning rate, that is the same as scaling the rate). Between steps,
at validation and at epoch ends, the loop runs one small compiled function, `ScheduleUpdate`,
that writes the monitored value into the state and advances epoch counters: the host reads no
device value for it beyond the validation metrics it already has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight._errors import (
    ConfigurationError,
)

GUIDE = "docs/porting.md"

INTERVALS = ("step", "epoch")


class ScheduleState(NamedTuple):
    """A scheduler's part of the optimizer state (scalars; the optimizer's own state inside).

    Attributes:
        inner: the optimizer's state.
        count: intervals completed (optimizer steps for "step", epochs for "epoch"; int32).
        factor: the learning-rate factor the last update applied (float32; for
            `LearningRateMonitor`).
        plateau: the `reduce_on_plateau` state, or () for a schedule.
        pending: the latest monitored value not yet given to the plateau (float32).
        has_pending: whether `pending` holds one (bool).
    """

    inner: Any
    count: jax.Array
    factor: jax.Array
    plateau: Any
    pending: jax.Array
    has_pending: jax.Array


def _is_schedule_state(x) -> bool:
    return isinstance(x, ScheduleState)


def is_plateau(transform: Any) -> bool:
    """An optax transformation whose state carries a `scale` and whose update takes `value`."""
    if not isinstance(transform, optax.GradientTransformation):
        return False
    try:
        state = jax.eval_shape(transform.init, {"x": jax.ShapeDtypeStruct((), jnp.float32)})
    except Exception:  # noqa: BLE001 - any init that cannot run on a scalar is not a plateau
        return False
    return hasattr(state, "scale") and isinstance(
        transform, optax.GradientTransformationExtraArgs)


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """One `lr_scheduler` entry of configure_optimizers' dict, checked."""

    schedule: Callable[[jax.Array], jax.Array] | None
    plateau: optax.GradientTransformationExtraArgs | None
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None

    def wrap(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """`tx` with its updates multiplied by this scheduler's current factor."""
        sched = self

        def init(params):
            # The plateau's state in float32 whatever the parameters' dtype: its best value and
            # scale must not round in bfloat16.
            plateau = (() if sched.plateau is None
                       else sched.plateau.init({"x": jnp.zeros((), jnp.float32)}))
            return ScheduleState(inner=tx.init(params), count=jnp.zeros((), jnp.int32),
                                 factor=jnp.ones((), jnp.float32), plateau=plateau,
                                 pending=jnp.zeros((), jnp.float32),
                                 has_pending=jnp.zeros((), jnp.bool_))

        def update(updates, state, params=None, **extra):
            updates, inner = tx.update(updates, state.inner, params, **extra)
            factor = sched.factor(state)
            updates = jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates)
            count = state.count + 1 if sched.interval == "step" else state.count
            return updates, state._replace(inner=inner, count=count, factor=factor)

        return optax.GradientTransformationExtraArgs(init, update)

    def factor(self, state: ScheduleState) -> jax.Array:
        """The learning-rate factor for the next update."""
        if self.plateau is not None:
            return jnp.asarray(state.plateau.scale, jnp.float32)
        return jnp.asarray(self.schedule(state.count // self.frequency), jnp.float32)

    # -- between steps -------------------------------------------------------------------------

    def apply(self, opt_state: Any, value: jax.Array, has_value: jax.Array,
              feed: jax.Array, advance: jax.Array) -> Any:
        """Writes a monitored value, feeds the pending one to the plateau, advances epochs.

        Pure (compiled by `ScheduleUpdate`); every argument but `opt_state` is a scalar.
        """
        def one(state: ScheduleState) -> ScheduleState:
            pending = jnp.where(has_value, jnp.asarray(value, jnp.float32), state.pending)
            has_pending = state.has_pending | has_value
            plateau = state.plateau
            if self.plateau is not None:
                _, fed = self.plateau.update({}, plateau, value=pending)
                go = feed & has_pending
                plateau = jax.tree.map(lambda new, old: jnp.where(go, new, old), fed, plateau)
                has_pending = has_pending & ~go
            if self.interval == "epoch":
                count = state.count + advance.astype(jnp.int32)
            else:
                # A step schedule's count is frequency * (its steps in earlier epochs) + this
                # epoch's batches; at an epoch's end the batches short of a full `frequency`
                # are dropped, as Lightning counts `frequency` within each epoch.
                count = jnp.where(advance, state.count // self.frequency * self.frequency,
                                  state.count)
            return state._replace(count=count, plateau=plateau, pending=pending,
                                  has_pending=has_pending)

        return jax.tree.map(lambda s: one(s) if _is_schedule_state(s) else s, opt_state,
                            is_leaf=_is_schedule_state)


def current_factor(opt_state: Any) -> list[jax.Array]:
    """The factors the last update applied, one per scheduler in `opt_state` (traceable)."""
    return [s.factor for s in jax.tree.leaves(opt_state, is_leaf=_is_schedule_state)
            if _is_schedule_state(s)]


def states_of(tree: Any, state_type: type) -> list:
    """Every sub-state of type `state_type` in `tree` (an optimizer state or part of one)."""
    def is_state(x) -> bool:
        return isinstance(x, state_type)

    return [x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]


def one_state_of(opt_state: Any, state_type: type, callback: str, what: str) -> Any:
    """The one sub-state of type `state_type` in an optimizer state: how a step piece finds the
    state of its own optax transformation wherever the chain put it.

    Args:
        callback: the callback whose transformation it is, for the error (`"NonFiniteGuard"`).
        what: what the state is, plural, for the error (`"counter states"`).
    """
    found = states_of(opt_state, state_type)
    if len(found) != 1:
        raise ConfigurationError(
            f"{callback} found {len(found)} {what} in the optimizer state (expected 1); use one "
            f"{callback} per Fit."
        )
    return found[0]


def scheduler_state(opt_state: Any) -> ScheduleState | None:
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_schedule_state)
             if _is_schedule_state(s)]
    return found[0] if found else None
