"""LearningRateMonitor: the learning rate of each step, computed inside the step (no host sync)."""

from __future__ import annotations

import inspect
import numbers
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxlight._errors import JaxlightWarning
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


def constant_rates(tx: Any) -> list[float]:
    """The constant learning rates of `tx`: optax writes `optax.sgd(0.1)` as `scale(-0.1)`, whose
    update function keeps `step_size` in its closure."""
    found: list[float] = []

    def on_value(obj: Any) -> None:
        if inspect.isfunction(obj) and obj.__qualname__.startswith("scale.") \
                and "step_size" in obj.__code__.co_freevars:
            cells = dict(zip(obj.__code__.co_freevars, obj.__closure__, strict=True))
            size = cells["step_size"].cell_contents
            if isinstance(size, numbers.Real) and size < 0:
                found.append(-float(size))

    visit_closures(tx, on_value)
    return found


#: optax pieces that name the torch optimizer in a LearningRateMonitor key (`lr-Adam`).
OPTIMIZER_NAMES = (("scale_by_adam", "Adam"), ("scale_by_rms", "RMSprop"),
                   ("scale_by_rss", "Adagrad"), ("trace", "SGD"), ("scale_by_learning_rate", "SGD"),
                   ("scale", "SGD"))


def optimizer_name(tx: Any) -> str | None:
    """torch's class name for an optax optimizer (`optax.adam`: "Adam", `optax.adamw`:
    "AdamW", a decay after Adam's scaling), or None."""
    pieces: list[str] = []
    visit_closures(tx, lambda obj: pieces.append(obj.__qualname__.split(".")[0])
                   if inspect.isfunction(obj) else None)
    for piece, name in OPTIMIZER_NAMES:
        if piece in pieces:
            decayed = "add_decayed_weights" in pieces[pieces.index(piece):]
            return "AdamW" if name == "Adam" and decayed else name
    return None


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

    - a constant rate passed as a number (`optax.adam(1e-3)`): that number, read from the
      optimizer's closures (optax scales by `-1e-3`). An optimizer that hides its rate
      otherwise logs nothing, with a warning at `configure_optimizers`; wrap it in
      `optax.inject_hyperparams`.

    With BaseFinetuning's parameter groups, each group's effective rate, as Lightning names it:
    `lr-Adam/pg1`, `lr-Adam/pg2`, ... (see `_group_step`).

    With `configure_optimizers`' dict (`{"optimizer": tx, "lr_scheduler": {...}}`) the logged
    rate is the effective one: the optimizer's rate times the scheduler's factor (a plateau's
    reductions included), under the scheduler's `name` if it has one. Where the optimizer's
    own rate is hidden, the factor alone is logged as `lr_scale`.

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
        self.optimizer_name: str | None = None
        #: The optimizer's constant rates (`optax.adam(1e-3)`: [1e-3]), read from its closures.
        self.constants: list[float] = []
        self._where: tuple[str, int] | None = None
        #: A BaseFinetuning of the fit (its parameter groups are logged), found at fit start.
        self.finetuning: Any = None
        #: Metric names this monitor adds to the step, known once the step is traced.
        self.names: list[str] = []

    def transform_optimizer(self, tx):
        self.schedules = find_schedules(tx)
        self.schedulers = find_schedulers(tx)
        self.named = named_optimizers(tx)
        self.optimizer_name = optimizer_name(tx)
        self.constants = constant_rates(tx)
        return tx  # observed only

    def _warn(self, message: str) -> None:
        """Warns at the module's `configure_optimizers` (where the fix goes), not at the JAX
        frame tracing the step."""
        if self._where is None:
            warnings.warn(message, JaxlightWarning, stacklevel=3)
        else:
            warnings.warn_explicit(message, JaxlightWarning, *self._where)

    def setup(self, fit, module, stage: str) -> None:
        method = getattr(type(module), "configure_optimizers", None)
        try:
            self._where = (inspect.getsourcefile(method), inspect.getsourcelines(method)[1])
        except (TypeError, OSError):  # defined where no source is (a REPL, built by jaxlight)
            self._where = None
        # Parameter groups (BaseFinetuning's) are logged per group; found by what they offer,
        # as the finetuning callbacks import this module.
        self.finetuning = next((cb for cb in fit.callbacks
                                if callable(getattr(cb, "group_rates", None))), None)

    def transform_step(self, step_fn):
        schedules = self.schedules
        monitor = self
        if self.named is not None:
            return self._named_step(step_fn, self.named)

        def step_with_lr(state, batch):
            if monitor.finetuning is not None:
                return monitor._group_step(step_fn, state, batch)
            new_state, metrics = step_fn(state, batch)
            values = [fn(state.step) for fn in schedules]
            for hyper in _injected(new_state.opt_state):
                values += [hyper[k] for k in LR_NAMES if k in hyper]
            if not values and len(monitor.constants) == 1:
                # optax keeps a constant rate in a closure (optax.adam(1e-3) scales by -1e-3).
                values = [jnp.float32(monitor.constants[0])]
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
                monitor._warn(
                    "LearningRateMonitor: the optimizer's own learning rate is a constant optax "
                    "does not expose, so only the lr_scheduler's factor is logged, as "
                    "'lr_scale'. Wrap the optimizer, e.g. optax.inject_hyperparams(optax.adam)("
                    "learning_rate=1e-3), to log the effective rate.")
            if not values and factor is None:
                monitor._warn(
                    "LearningRateMonitor found no learning-rate schedule and no "
                    "optax.inject_hyperparams state in the optimizer, so it logs nothing. A "
                    "constant learning rate is not visible in an optax transformation: wrap "
                    "the optimizer, e.g. optax.inject_hyperparams(optax.adamw)(learning_rate="
                    "1e-3), to log it.")
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

    def _group_step(self, step_fn, state, batch):
        """Parameter groups (BaseFinetuning): each group's effective rate, named as Lightning
        names them, `lr-Adam/pg1`, `lr-Adam/pg2`, ... (the lr_scheduler's `name` in place of
        `lr-Adam` if it has one). The names are those of every group the fit will have from its
        first step; a group not yet added logs 0 (Lightning logs `lr-Adam` until a second
        group exists)."""
        new_state, metrics = step_fn(state, batch)
        rates = self.finetuning.group_rates(state.opt_state)
        factors = current_factor(new_state.opt_state)
        if factors:
            rates = rates * factors[0]
        prefix = "lr" if self.optimizer_name is None else f"lr-{self.optimizer_name}"
        if self.schedulers and self.schedulers[0].name:
            prefix = self.schedulers[0].name
        n = rates.shape[0]
        extra = {(f"{prefix}/pg{g + 1}" if n > 1 else prefix): rates[g] for g in range(n)}
        self.names = list(extra)
        return new_state, {**metrics, **extra}

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
                monitor._warn(
                    "LearningRateMonitor found no learning-rate schedule and no "
                    "optax.inject_hyperparams state in any named optimizer, so it logs nothing. "
                    "Wrap an optimizer, e.g. optax.inject_hyperparams(optax.adam)(learning_rate="
                    "1e-3), to log its rate as 'lr-<name>'.")
            monitor.names = list(extra)
            return new_state, {**metrics, **extra}

        return step_with_lr
