"""What `configure_optimizers` may return, and the learning-rate schedulers of Lightning's dict.

`configure_optimizers` returns either an optax transformation (a schedule inside it, the optax
way), or Lightning's dict:

    {"optimizer": tx,
     "lr_scheduler": {"scheduler": s, "interval": "step" | "epoch", "frequency": 1,
                      "monitor": "val_loss", "strict": True, "name": None}}

`s` is either an optax schedule, read as the factor the optimizer's learning rate is multiplied
by (torch's `LambdaLR`: `optax.exponential_decay(1.0, 1, 0.5)` halves the rate every interval),
indexed by optimizer steps (`"step"`) or completed epochs (`"epoch"`), divided by `frequency`
(as in Lightning, a step schedule counts `frequency` within each epoch: it advances after the
epoch's batches `frequency`, 2 * `frequency`, ..., and an epoch's remainder is dropped);
or a plateau scheduler: `jaxlight.schedules.ReduceLROnPlateau(...)` (torch's arguments and
counting: lowers the rate after more than `patience` bad values) or
`optax.contrib.reduce_on_plateau(...)` (after `patience` bad values), which multiply the rate by
`factor` when the `monitor`ed validation metric stops improving.

The checked scheduler and its optimizer state are in `jaxlight.schedules._scheduler`;
`ScheduleUpdate` here runs the between-step updates the loop calls.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxlight._errors import (
    ConfigurationError,
    JaxlightWarning,
    PortingError,
    StepOutputError,
    suggest,
)
from jaxlight.schedules._scheduler import GUIDE, INTERVALS, Scheduler, is_plateau

#: Keys of Lightning's configure_optimizers dict that jaxlight reads.
OPTIMIZER_KEYS = ("optimizer", "lr_scheduler", "monitor")
#: Keys of its "lr_scheduler" dict.
SCHEDULER_KEYS = ("scheduler", "interval", "frequency", "monitor", "strict", "name")

# -- reading configure_optimizers ------------------------------------------------------------


def _unknown_keys(got, valid, where: str) -> None:
    bad = [k for k in got if k not in valid]
    if bad:
        hints = "".join(suggest(k, valid) for k in bad)
        raise ConfigurationError(
            f"{where} has unknown key(s) {bad}; valid keys are {list(valid)}.{hints} See "
            f"{GUIDE}."
        )


#: Steps at which a schedule in the "scheduler" slot is sampled to tell a rate from a factor.
_SAMPLES = (0, 1, 10, 100, 1_000, 10_000, 100_000)
#: A factor schedule that stays below this everywhere is almost surely a learning rate.
_RATE_LIKE = 0.05


def _warn_if_a_rate(sched: Callable, where: str) -> None:
    """Warns when the "scheduler" slot (a factor of the optimizer's rate) holds what looks like
    a learning-rate schedule: values far below 1 everywhere would multiply the rate twice."""
    try:
        values = [abs(float(sched(n))) for n in _SAMPLES]
    except Exception:  # noqa: BLE001 - a schedule that cannot be sampled is not judged
        return
    peak = max(values)
    if peak >= _RATE_LIKE:
        return
    warnings.warn(
        f"{where}['lr_scheduler']['scheduler'] gives values no larger than {peak:.3g} (steps "
        f"{_SAMPLES[0]}-{_SAMPLES[-1]}: {values[0]:.3g} at step 0), but that slot holds a factor "
        "the optimizer's learning rate is multiplied by (torch's LambdaLR): with "
        f"optax.adam(1e-3) the rate would be about {1e-3 * peak:.3g}. If it is the learning "
        "rate itself, give it to the optimizer and drop 'lr_scheduler': "
        "{'optimizer': optax.adam(schedule)} (or return optax.adam(schedule)); if it is a "
        "factor, make it peak at 1: e.g. optax.cosine_decay_schedule(1.0, steps) with "
        "optax.adam(1e-3).", JaxlightWarning, stacklevel=4)


def _scheduler(entry: Any, top_monitor: str | None, where: str) -> Scheduler:
    if callable(entry) and not isinstance(entry, dict):
        entry = {"scheduler": entry}
    if not isinstance(entry, dict):
        raise ConfigurationError(
            f"{where}['lr_scheduler'] is a {type(entry).__name__}; give a dict "
            "{'scheduler': ..., 'interval': 'step' | 'epoch', 'monitor': ...} or an optax "
            f"schedule. See {GUIDE}."
        )
    _unknown_keys(entry, SCHEDULER_KEYS, f"{where}['lr_scheduler']")
    if "scheduler" not in entry:
        raise ConfigurationError(
            f"{where}['lr_scheduler'] has no 'scheduler' key (it has {list(entry)}); give an "
            "optax schedule (the factor of the learning rate) or "
            f"optax.contrib.reduce_on_plateau(...). See {GUIDE}."
        )
    sched = entry["scheduler"]
    interval = entry.get("interval", "epoch")
    if interval not in INTERVALS:
        raise ConfigurationError(
            f"{where}['lr_scheduler']['interval'] = {interval!r}; it must be 'step' or "
            f"'epoch'.{suggest(interval, INTERVALS)}"
        )
    frequency = entry.get("frequency", 1)
    if not isinstance(frequency, int) or isinstance(frequency, bool) or frequency < 1:
        raise ConfigurationError(
            f"{where}['lr_scheduler']['frequency'] = {frequency!r}; it must be a positive "
            "integer (the scheduler advances every `frequency` intervals)."
        )
    monitor = entry.get("monitor", top_monitor)
    plateau = sched if is_plateau(sched) else None
    if plateau is None:
        if isinstance(sched, optax.GradientTransformation) or not callable(sched):
            raise ConfigurationError(
                f"{where}['lr_scheduler']['scheduler'] is a {type(sched).__name__}; give an "
                "optax schedule (count -> factor of the learning rate, e.g. "
                "optax.exponential_decay(1.0, 1, 0.5)) or optax.contrib.reduce_on_plateau(...)."
                f" See {GUIDE}."
            )
        _warn_if_a_rate(sched, where)
        if "monitor" in entry:
            raise ConfigurationError(
                f"{where}['lr_scheduler'] monitors {monitor!r}, but its scheduler is a fixed "
                "schedule, which reads no metric; use optax.contrib.reduce_on_plateau(...) to "
                "follow a metric, or drop 'monitor'."
            )
        monitor = None
    elif monitor is None:
        raise ConfigurationError(
            f"{where}['lr_scheduler'] uses reduce_on_plateau but names no metric to watch; "
            "add 'monitor': 'val_loss' (any validation metric, 'val_' prefixed)."
        )
    return Scheduler(schedule=None if plateau is not None else sched, plateau=plateau,
                     interval=interval, frequency=frequency, monitor=monitor,
                     strict=bool(entry.get("strict", True)), name=entry.get("name"))


def as_transformation(x: Any) -> Any:
    """`optax.MultiSteps(tx, k)` is a class around a transformation: its transformation."""
    return x.gradient_transformation() if isinstance(x, optax.MultiSteps) else x


def resolve(module: Any) -> tuple[optax.GradientTransformation, Scheduler | None]:
    """Calls `module.configure_optimizers()`; returns the optax transformation and scheduler.

    The transformation already includes the scheduler's factor (`Scheduler.wrap`).
    """
    where = f"{type(module).__name__}.configure_optimizers()"
    return resolve_output(module.configure_optimizers(), where)


def resolve_output(out: Any, where: str) -> tuple[optax.GradientTransformation, Scheduler | None]:
    """`resolve` for an output already read (`where` names configure_optimizers for messages)."""
    out = as_transformation(out)
    if isinstance(out, dict) and "optimizer" in out:
        out = {**out, "optimizer": as_transformation(out["optimizer"])}
    if isinstance(out, optax.GradientTransformation):
        return out, None
    if isinstance(out, tuple | list):
        # (An optax transformation is a NamedTuple: a tuple, but not a list of them.)
        pair = len(out) == 2 and all(isinstance(x, tuple | list)
                                     and not isinstance(x, optax.GradientTransformation)
                                     for x in out)
        form = ("Lightning's ([optimizers], [schedulers]) pair" if pair else
                f"{len(out)} optimizer{'s' if len(out) != 1 else ''}, Lightning's form for "
                "several optimizers")
        raise PortingError(
            f"{where} returned a {type(out).__name__} of {len(out)} items ({form}), which does "
            "not say which parameters each "
            "optimizer updates. Return a list of named optimizers, each bound to part of the "
            "model: [{'name': 'generator', 'params': 'generator', 'optimizer': tx_g}, "
            "{'name': 'discriminator', 'params': 'discriminator', 'optimizer': tx_d, "
            "'lr_scheduler': {...}}] ('params': a sub-module attribute, a path regex or an nnx "
            f"filter). See docs/models.md ('Several optimizers') and {GUIDE}."
        )
    if not isinstance(out, dict):
        torch_hint = (" A torch optimizer has no JAX counterpart: return optax.adam(lr) (no "
                      "parameter list)." if type(out).__module__.startswith("torch") else "")
        raise StepOutputError(
            f"{where} returned {type(out).__name__}; return an optax.GradientTransformation "
            f"such as optax.adamw(1e-3), or Lightning's dict {{'optimizer': tx, "
            f"'lr_scheduler': {{...}}}}.{torch_hint}"
        )
    _unknown_keys(out, OPTIMIZER_KEYS, where)
    if "optimizer" not in out:
        raise ConfigurationError(
            f"{where} returned a dict without 'optimizer' (keys: {list(out)}); the dict form is "
            "{'optimizer': tx, 'lr_scheduler': {...}}."
        )
    tx = out["optimizer"]
    if not isinstance(tx, optax.GradientTransformation):
        raise StepOutputError(
            f"{where}['optimizer'] is a {type(tx).__name__}; it must be an "
            "optax.GradientTransformation such as optax.adamw(1e-3)."
        )
    if out.get("lr_scheduler") is None:
        if out.get("monitor") is not None:
            warnings.warn(f"{where} names a 'monitor' but no 'lr_scheduler'; nothing reads it.",
                          stacklevel=2)
        return tx, None
    scheduler = _scheduler(out["lr_scheduler"], out.get("monitor"), where)
    return scheduler.wrap(tx), scheduler


# -- the loop's side -------------------------------------------------------------------------


class ScheduleUpdate:
    """Runs a scheduler's between-step updates on the train state, compiled once per fit.

    The loop calls `after_validation` right after a validation's metrics are known and before
    its end hooks (where checkpoints are saved), and `at_epoch_end` after an epoch's last
    batch, before `on_train_epoch_end`; both return the new state (the old one is donated).

    Args:
        scheduler: the module's scheduler.
        compile: `compile(fn, abstract_extra_args) -> callable(state, *extra)`, the core's way
            to compile a function of the train state with its shardings (donating the state).
    """

    def __init__(self, scheduler: Scheduler, compile: Callable):
        self.scheduler = scheduler
        self._compile = compile
        self._fn = None

    def _run(self, state, value: float, has_value: bool, feed: bool, advance: bool):
        if self._fn is None:
            sched = self.scheduler

            def fn(state, value, has_value, feed, advance):
                return state.replace(opt_state=sched.apply(state.opt_state, value, has_value,
                                                           feed, advance))

            scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)  # noqa: E731
            self._fn = self._compile(fn, (scalar(jnp.float32), scalar(jnp.bool_),
                                          scalar(jnp.bool_), scalar(jnp.bool_)))
        return self._fn(state, jnp.float32(value), jnp.bool_(has_value), jnp.bool_(feed),
                        jnp.bool_(advance))

    def needs_validation(self) -> bool:
        return self.scheduler.monitor is not None

    def check_monitor(self, metrics: dict[str, float], when: str = "") -> None:
        """Refuses (warns, with 'strict': False) a monitor the validation `metrics` lack; the
        sanity check calls it too, so the mistake shows before the first training step."""
        sched = self.scheduler
        if sched.monitor is None or sched.monitor in metrics:
            return
        names = sorted(metrics)
        message = (
            f"the lr_scheduler monitors {sched.monitor!r}, which validation did not "
            f"produce{when}; validation metrics: {names}.{suggest(sched.monitor, names)}")
        if sched.strict:
            raise ConfigurationError(message + " Fix 'monitor', or set 'strict': False "
                                               "to skip the update with a warning.")
        warnings.warn(message + " The learning rate is not updated ('strict': False).",
                      stacklevel=3)

    def after_validation(self, state, metrics: dict[str, float], epoch_batches: int,
                         epoch: int, epoch_end: bool):
        """Writes the monitored metric into the state; feeds the plateau when it is due."""
        sched = self.scheduler
        if sched.monitor is None:
            return state
        if sched.monitor not in metrics:
            self.check_monitor(metrics)
            return state
        if sched.interval == "step":
            # Lightning counts `frequency` in batches of the current epoch.
            feed = epoch_batches % sched.frequency == 0
        else:
            feed = epoch_end and (epoch + 1) % sched.frequency == 0
        return self._run(state, float(metrics[sched.monitor]), True, feed, False)

    def at_epoch_end(self, state, epoch: int, validation_follows: bool):
        """Advances epoch-interval schedules; feeds a plateau the epoch's last value.

        `validation_follows`: an end-of-epoch validation will run now (it feeds the plateau).
        """
        sched = self.scheduler
        if sched.interval != "epoch":
            if sched.plateau is None and sched.frequency > 1:
                return self._run(state, 0.0, False, False, True)  # drop the epoch's remainder
            return state
        feed = (sched.plateau is not None and not validation_follows
                and (epoch + 1) % sched.frequency == 0)
        if sched.plateau is not None and not feed:
            return state  # nothing to change: skip the call
        return self._run(state, 0.0, False, feed, sched.plateau is None)
