"""LearningRateMonitor: the learning rate of each step, computed inside the step (no host sync)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxlight.callbacks._base import Callback
from jaxlight.optim._named import NamedOptimizers, named_optimizers
from jaxlight.schedules._scheduler import Scheduler, current_factor, states_of

#: Hyperparameter names read from `optax.inject_hyperparams` states.
LR_NAMES = ("learning_rate", "lr", "step_size")
MOMENTUM_NAMES = ("b1", "momentum", "beta1")


def find_schedulers(tx: Any) -> list[Scheduler]:
    """The `configure_optimizers` dict's schedulers inside an optax transformation."""
    found: list[Scheduler] = []
    visit_closures(tx, lambda obj: found.append(obj) if isinstance(obj, Scheduler)
           and all(obj is not f for f in found) else None)
    return found


def visit_closures(tx: Any, on_value: Callable[[Any], None]) -> None:
    """Calls `on_value` on every object reachable through the closures of `tx`'s functions."""
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > 40 or id(obj) in seen:
            return
        seen.add(id(obj))
        on_value(obj)
        if isinstance(obj, optax.GradientTransformation):
            visit(obj.update, depth + 1)
        elif inspect.isfunction(obj):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    continue
        elif isinstance(obj, list | tuple):
            for item in obj:
                visit(item, depth + 1)

    visit(tx, 0)


def find_schedules(tx: Any) -> list[Callable]:
    """The learning-rate schedules inside an optax transformation, in the order they apply.

    optax keeps a schedule only in closures (`scale_by_learning_rate(schedule)` wraps it in
    `scale_by_schedule`), so this walks the update function's closures: a function of
    `scale_by_learning_rate` gives the schedule itself; any other `scale_by_schedule` gives
    the magnitude of its step size. Constant learning rates are not schedules and are not
    returned.

    Example:
        >>> import optax
        >>> sched = optax.linear_schedule(1.0, 0.0, 10)
        >>> find_schedules(optax.chain(optax.clip(1.0), optax.adam(sched)))[0] is sched
        True
    """
    found: list[Callable] = []
    seen: set[int] = set()

    def add(fn: Callable) -> None:
        if all(fn is not f for f in found):
            found.append(fn)

    def visit(obj: Any, depth: int) -> None:
        if depth > 40 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, optax.GradientTransformation):
            visit(obj.update, depth + 1)
        elif inspect.isfunction(obj):
            cells = dict(zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=True))
            values = {}
            for name, cell in cells.items():
                try:
                    values[name] = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
            qual = obj.__qualname__
            if qual.startswith("scale_by_learning_rate.") and callable(
                    values.get("learning_rate")):
                add(values["learning_rate"])
                return
            if qual.startswith("scale_by_schedule.") and callable(values.get("step_size_fn")):
                fn = values["step_size_fn"]
                if getattr(fn, "__qualname__", "").startswith("scale_by_learning_rate."):
                    visit(fn, depth + 1)
                else:
                    add(lambda count, fn=fn: jnp.abs(fn(count)))
                return
            for value in values.values():
                visit(value, depth + 1)
        elif isinstance(obj, list | tuple):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif hasattr(obj, "func") and hasattr(obj, "keywords"):  # functools.partial
            visit(obj.func, depth + 1)
            visit(list(obj.args) + list(obj.keywords.values()), depth + 1)

    visit(tx, 0)
    return found


def _injected(opt_state: Any) -> list[dict]:
    """The hyperparameter dicts of every `inject_hyperparams` state in `opt_state`."""
    is_injected = lambda x: isinstance(getattr(x, "hyperparams", None), dict)  # noqa: E731
    return [leaf.hyperparams for leaf in jax.tree.leaves(opt_state, is_leaf=is_injected)
            if is_injected(leaf)]


class LearningRateMonitor(Callback):
    """Logs the learning rate of every step as `lr` (`lr/0`, `lr/1`, ... for several).

    The value is computed inside the compiled step and travels with the step's metrics, so it
    costs no device sync and reaches the loggers at log intervals like the loss. It reads:

    - `optax.inject_hyperparams` optimizers: the learning rate (and with `log_momentum`, b1 or
      momentum) stored in the optimizer state by this step;
    - optax schedules (`optax.adamw(optax.cosine_decay_schedule(...))`): the schedule at the
      step's optimizer count (the train state's step before the update).

    A constant learning rate passed as a number is neither; wrap the optimizer in
    `optax.inject_hyperparams` to log it (a warning says so).

    With `configure_optimizers`' dict (`{"optimizer": tx, "lr_scheduler": {...}}`) the logged
    rate is the effective one: the optimizer's rate times the scheduler's factor (a plateau's
    reductions included), under the scheduler's `name` if it has one. Where the optimizer's
    own rate is a hidden constant, the factor alone is logged as `lr_scale`.

    With named optimizers (configure_optimizers returning several, see docs/models.md) each is
    logged as `lr-<name>` (its scheduler's `name` if it has one; `lr_scale-<name>` for a
    factor alone), its schedule read at its own update count.

    Args:
        log_momentum: also log the momentum (`b1`/`momentum`) of inject_hyperparams optimizers.

    Example:
        >>> import optax
        >>> tx = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)  # logged as "lr"
        >>> monitor = LearningRateMonitor()
    """

    #: Its transform_optimizer only looks (manual optimization accepts it).
    observes_optimizer_only = True

    def __init__(self, log_momentum: bool = False):
        self.log_momentum = log_momentum
        self.schedules: list[Callable] = []
        self.schedulers: list[Scheduler] = []
        self.named: NamedOptimizers | None = None
        #: Metric names this monitor adds to the step, known once the step is traced.
        self.names: list[str] = []

    def transform_optimizer(self, tx):
        self.schedules = find_schedules(tx)
        self.schedulers = find_schedulers(tx)
        self.named = named_optimizers(tx)
        return tx  # observed only

    def transform_step(self, step_fn):
        schedules = self.schedules
        monitor = self
        if self.named is not None:
            return self._named_step(step_fn, self.named)

        def step_with_lr(state, batch):
            new_state, metrics = step_fn(state, batch)
            values = [fn(state.step) for fn in schedules]
            for hyper in _injected(new_state.opt_state):
                values += [hyper[k] for k in LR_NAMES if k in hyper]
            momenta = []
            if monitor.log_momentum:
                for hyper in _injected(new_state.opt_state):
                    momenta += [hyper[k] for k in MOMENTUM_NAMES if k in hyper]
            # The factor of configure_optimizers' lr_scheduler that this step applied.
            factors = current_factor(new_state.opt_state)
            factor = factors[0] if factors else None
            prefix = "lr"
            if monitor.schedulers and monitor.schedulers[0].name:
                prefix = monitor.schedulers[0].name
            if factor is not None and values:
                values = [v * factor for v in values]
            elif factor is not None:
                warnings.warn(
                    "LearningRateMonitor: the optimizer's own learning rate is a constant optax "
                    "does not expose, so only the lr_scheduler's factor is logged, as "
                    "'lr_scale'. Wrap the optimizer, e.g. optax.inject_hyperparams(optax.adam)("
                    "learning_rate=1e-3), to log the effective rate.", stacklevel=2)
            if not values and factor is None:
                warnings.warn(
                    "LearningRateMonitor found no learning-rate schedule and no "
                    "optax.inject_hyperparams state in the optimizer, so it logs nothing. A "
                    "constant learning rate is not visible in an optax transformation: wrap "
                    "the optimizer, e.g. optax.inject_hyperparams(optax.adamw)(learning_rate="
                    "1e-3), to log it.", stacklevel=2)
            extra = {}
            if factor is not None and not values:
                extra["lr_scale"] = jnp.asarray(factor, jnp.float32)
            for name, vals in ((prefix, values), ("momentum", momenta)):
                for i, value in enumerate(vals):
                    extra[name if len(vals) == 1 else f"{name}/{i}"] = jnp.asarray(
                        value, jnp.float32)
            monitor.names = list(extra)
            return new_state, {**metrics, **extra}

        return step_with_lr

    def _named_step(self, step_fn, named: NamedOptimizers):
        """Named optimizers: `lr-<name>` (or the scheduler's `name`) per optimizer, each read
        from its own part of the optimizer state (its own update count)."""
        monitor = self
        schedules = {name: find_schedules(named.txs[name]) for name in named.names}

        def step_with_lr(state, batch):
            new_state, metrics = step_fn(state, batch)
            old = states_of(state.opt_state, optax.PartitionState)[0].inner_states
            new = states_of(new_state.opt_state, optax.PartitionState)[0].inner_states
            extra = {}
            for name in named.names:
                counts = optax.tree_utils.tree_get_all_with_path(old[name], "count")
                count = counts[0][1] if counts else state.step
                values = [fn(count) for fn in schedules[name]]
                values += [h[k] for h in _injected(new[name]) for k in LR_NAMES if k in h]
                if monitor.log_momentum:
                    momenta = [h[k] for h in _injected(new[name]) for k in MOMENTUM_NAMES
                               if k in h]
                    if momenta:
                        extra[f"momentum-{name}"] = jnp.asarray(momenta[0], jnp.float32)
                factors = current_factor(new[name])
                scheduler = named.schedulers.get(name)
                key = scheduler.name if scheduler is not None and scheduler.name else f"lr-{name}"
                if values:
                    factor = factors[0] if factors else 1.0
                    extra[key] = jnp.asarray(values[0] * factor, jnp.float32)
                elif factors:
                    extra[f"lr_scale-{name}"] = jnp.asarray(factors[0], jnp.float32)
            if not extra:
                warnings.warn(
                    "LearningRateMonitor found no learning-rate schedule and no "
                    "optax.inject_hyperparams state in any named optimizer, so it logs nothing. "
                    "Wrap an optimizer, e.g. optax.inject_hyperparams(optax.adam)(learning_rate="
                    "1e-3), to log its rate as 'lr-<name>'.", stacklevel=2)
            monitor.names = list(extra)
            return new_state, {**metrics, **extra}

        return step_with_lr
