"""Metrics inside steps: `self.log` collected while a step is traced (exact evaluation totals
built from them are in `jaxlight.metrics._eval_totals`).

What a step reports reaches the host in one of three forms:

- a scalar (returned in the step's metrics dict, or `self.log(name, value)`): in evaluation it is
  weighted by the batch's number of examples (its leading dimension), or by
  `self.log(..., batch_size=w)` (`w` may be traced, e.g. a token count), so the result is the
  exact mean over the dataset;
- a mergeable metric (a `clu.metrics.Metric` or `Collection`, or any pytree with `merge` and
  `compute`): merged on device across batches (and, under DDP, across replicas with `all_gather`
  and `reduce`), computed once on the host at the end;
- in training, `on_epoch=True` values are summed on device by `EpochAccumulator` (a tiny jitted
  add dispatched after each step, no host read) and read once at the epoch's end.

`self.log` writes to the `LogCollector` that `collecting` makes active while the step is traced;
every trace starts a fresh collector, so a retrace never sees values of an earlier one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlight._errors import ConfigurationError, JaxlightWarning, StepOutputError, user_frame
from jaxlight.metrics._host_logs import HostLogs, batch_collector, scoped

#: Where `self.log` inside a step writes (None outside a traced step).
_ACTIVE: contextvars.ContextVar[LogCollector | None] = contextvars.ContextVar(
    "jaxlight_log_collector", default=None
)

#: Key suffix under which a training metric's `batch_size` weight travels in the step's metrics.
WEIGHT = ":weight"

#: `reduce_fx` values a training `on_epoch` value takes, by the name they stand for.
REDUCTIONS = {"mean": "mean", None: "mean", jnp.mean: "mean", np.mean: "mean",
              "max": "max", jnp.max: "max", np.max: "max", max: "max",
              "min": "min", jnp.min: "min", np.min: "min", min: "min"}


def _reduction(reduce_fx: Any) -> str | None:
    try:
        return REDUCTIONS.get(reduce_fx)
    except TypeError:  # unhashable
        return None


def is_mergeable(value: Any) -> bool:
    """A clu-style metric: an object (a pytree) with `merge` and `compute`, not an array."""
    return (not isinstance(value, jax.Array | np.ndarray | int | float)
            and callable(getattr(value, "merge", None))
            and callable(getattr(value, "compute", None)))


@dataclasses.dataclass(frozen=True)
class LogOptions:
    """How one logged value is reported (`TrainModule.log`'s flags, defaults resolved)."""

    on_step: bool
    on_epoch: bool
    prog_bar: bool
    #: False: kept from the loggers and `logged_metrics` (`callback_metrics` and the progress
    #: bar still get it), as Lightning's `self.log(..., logger=False)`.
    logger: bool = True
    #: How `on_epoch` values of a training epoch combine: "mean" (batch-size weighted),
    #: "max" or "min" (Lightning's `reduce_fx`).
    reduce: str = "mean"


@dataclasses.dataclass
class Logged:
    value: Any
    options: LogOptions
    batch_size: Any = None


class LogCollector:
    """What `self.log` recorded during one trace of one step.

    Args:
        kind: "train" (defaults `on_step=True, on_epoch=False`, as in Lightning's training_step)
            or "eval" (`on_step=False, on_epoch=True`: the aggregate over the whole evaluation).
        where: the step's name, for messages.
    """

    def __init__(self, kind: str, where: str):
        self.kind, self.where = kind, where
        self.entries: dict[str, Logged] = {}

    def add(self, name: str, value: Any, *, prog_bar: bool, on_step: bool | None,
            on_epoch: bool | None, batch_size: Any, reduce_fx: Any, logger: bool = True) -> None:
        where = f"{self.where}: self.log({name!r}, ...)"
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"{self.where}: self.log needs a non-empty str name, got "
                                     f"{name!r}.")
        if name in self.entries:
            raise ConfigurationError(
                f"{where} logs {name!r} a second time in one step; log each name once (use "
                "distinct names, or combine the values before logging)."
            )
        reduce = _reduction(reduce_fx)
        if reduce is None or (reduce != "mean" and self.kind != "train"):
            raise ConfigurationError(
                f"{where}: reduce_fx={reduce_fx!r} is not supported "
                + ("in training (use 'mean', 'max' or 'min')" if reduce is None else
                   "in an evaluation step, which reports exact (batch-size weighted) means")
                + ". For another aggregation log a clu.metrics.Metric (e.g. a max or a "
                "collecting metric) from an evaluation step."
            )
        train = self.kind == "train"
        on_step = train if on_step is None else bool(on_step)
        on_epoch = (not train) if on_epoch is None else bool(on_epoch)
        if not train and on_step:
            raise ConfigurationError(
                f"{where} sets on_step=True in an evaluation step: evaluation reports one exact "
                "value over the whole dataset, not per batch. Drop on_step (the default "
                "on_epoch=True is what evaluation logs)."
            )
        if not on_step and not on_epoch:
            raise ConfigurationError(
                f"{where} sets on_step=False and on_epoch=False, so the value would go nowhere; "
                "set one of them."
            )
        if is_mergeable(value):
            if train:
                raise ConfigurationError(
                    f"{where} logs a {type(value).__name__} (a mergeable metric) from "
                    "training_step; training logs scalars. Log the metric from validation_step "
                    "or test_step, where it is merged over the whole dataset."
                )
            if batch_size is not None:
                raise ConfigurationError(
                    f"{where}: batch_size weights scalar means; a {type(value).__name__} "
                    "carries its own counts. Drop batch_size."
                )
        else:
            if not isinstance(value, jax.core.Tracer):
                _warn_host_constant(where, value, train)
            value = as_scalar(value, f"{self.where} logged value {name!r}")
            if batch_size is not None:
                batch_size = as_scalar(batch_size, f"{self.where} batch_size of {name!r}")
        self.entries[name] = Logged(
            value, LogOptions(on_step, on_epoch, bool(prog_bar), bool(logger), reduce),
            batch_size)


def _warn_host_constant(where: str, value: Any, train: bool) -> None:
    """A logged value that is not traced is a constant of the compiled step: the value it had
    at the trace is logged at every step (a host counter, an episode's reward)."""
    shown = (f"the {type(value).__name__} {value!r}" if isinstance(value, int | float | bool)
             else f"a {type(value).__name__} that is not computed from the step's inputs")
    fix = ("compute it inside the step from the model and the batch, or log a host value from "
           "a hook: self.log(name, value) in on_train_batch_start / on_train_batch_end logs it "
           "with that step's metrics, as Lightning does" if train else
           "compute it inside the step from the model and the batch")
    message = (f"{where} logs {shown}, a host value: the step is traced once and compiled, so "
               f"this value, as it was at the trace, is logged at every step. To log what "
               f"changes, {fix}.")
    found = user_frame()
    if found is None:
        warnings.warn(message, JaxlightWarning, stacklevel=4)
    else:
        warnings.warn_explicit(message, JaxlightWarning, found[0], found[1])


def as_scalar(value: Any, what: str) -> jax.Array:
    shape = getattr(value, "shape", None)
    if shape is None and not isinstance(value, int | float | bool | np.number):
        raise StepOutputError(f"{what} is a {type(value).__name__}; log a scalar (or, in an "
                              "evaluation step, a clu.metrics.Metric).")
    if shape not in (None, ()):
        raise StepOutputError(f"{what} has shape {tuple(shape)}; log a scalar (reduce it over "
                              "the batch, for example with .mean()).")
    return jnp.asarray(value, jnp.float32)


def collecting(kind: str, where: str) -> contextlib.AbstractContextManager[LogCollector]:
    """Makes `self.log` inside the block write to a fresh collector."""
    return scoped(_ACTIVE, LogCollector(kind, where))


def in_step() -> bool:
    """Whether a step (training, validation, test) is being traced now."""
    return _ACTIVE.get() is not None


def active(module_name: str) -> LogCollector | HostLogs:
    """The collector of the step being traced, or of the training batch whose hooks run;
    refuses `self.log` anywhere else."""
    collector = _ACTIVE.get() or batch_collector()
    if collector is None:
        raise ConfigurationError(
            f"{module_name}.log(...) was called outside a step and outside the training batch "
            "hooks. self.log / self.log_dict record values while training_step, "
            "validation_step or test_step is traced, and host values in on_train_batch_start / "
            "on_train_batch_end (logged with that step's metrics); from another hook send host "
            "values with fit.log_metrics({...}). See docs/porting.md."
        )
    return collector


# -- training --------------------------------------------------------------------------------


class LogSpec:
    """How a step's metrics reach the host, filled while the step is traced.

    `options` holds the logged names (returned metrics are step values, like `on_step=True`).
    The loop reads it after compiling: `step_values` at log intervals, `EpochAccumulator` for
    `on_epoch` names, `prog_bar` for the progress bar.
    """

    def __init__(self) -> None:
        self.options: dict[str, LogOptions] = {}

    @property
    def prog_bar(self) -> set[str]:
        """Names as the loggers see them (`name`, `name_step`, `name_epoch`) for the bar."""
        names = set()
        for name, opt in self.options.items():
            if opt.prog_bar:
                names.update(self._logged_names(name, opt))
        return names

    @property
    def hidden(self) -> set[str]:
        """Names as the loggers would see them of values logged with `logger=False`."""
        names = set()
        for name, opt in self.options.items():
            if not opt.logger:
                names.update(self._logged_names(name, opt))
        return names

    @staticmethod
    def _logged_names(name: str, opt: LogOptions) -> list[str]:
        if opt.on_step and opt.on_epoch:
            return [f"{name}_step", f"{name}_epoch"]
        return [name]

    @property
    def epoch_names(self) -> list[str]:
        return [n for n, opt in self.options.items() if opt.on_epoch]

    def step_values(self, host: dict[str, Any]) -> dict[str, Any]:
        """The metrics logged at a step: on_step names (`name_step` when also on_epoch)."""
        out = {}
        for key, value in host.items():
            if key.endswith(WEIGHT):
                continue
            opt = self.options.get(key)
            if opt is None:
                out[key] = value
            elif opt.on_step:
                out[f"{key}_step" if opt.on_epoch else key] = value
        return out

    def with_bare_names(self, values: dict[str, Any]) -> dict[str, Any]:
        """`values` plus, for each name logged with both `on_step` and `on_epoch`, the bare
        name holding its `_step` or `_epoch` value: Lightning's `callback_metrics` (what
        monitors read) has all three, its loggers only the suffixed two."""
        out = dict(values)
        for name, opt in self.options.items():
            if opt.on_step and opt.on_epoch:
                for shown in (f"{name}_step", f"{name}_epoch"):
                    if shown in values:
                        out[name] = values[shown]
        return out

    def epoch_name(self, name: str) -> str:
        opt = self.options[name]
        return f"{name}_epoch" if opt.on_step else name


def _refuse_suffix_collisions(metrics: dict, entries: dict[str, Logged], where: str) -> None:
    """Refuses two training values that would reach the loggers under one name: a name logged
    with `on_step=True, on_epoch=True` becomes `name_step` and `name_epoch`, so another value
    named `name_epoch` (logged or returned) would overwrite, or be overwritten by, its mean."""
    owner: dict[str, str] = {}
    for key in metrics:
        owner[key] = f"the returned metric {key!r}"
    for name, entry in entries.items():
        mine = f"self.log({name!r}, on_step={entry.options.on_step}, " \
               f"on_epoch={entry.options.on_epoch})"
        names = {name, *LogSpec._logged_names(name, entry.options)}
        for shown in sorted(names):
            other = owner.get(shown)
            if other is not None and not other.startswith(f"the returned metric {name!r}") \
                    and not other.startswith(f"self.log({name!r},"):
                raise ConfigurationError(
                    f"{where}: {mine} and {other} both reach the loggers as {shown!r} (a name "
                    "logged with on_step=True and on_epoch=True is logged as '<name>_step' and "
                    "'<name>_epoch'), so one value would silently replace the other. Rename "
                    "one of them."
                )
            owner[shown] = mine


def merge_training_logs(metrics: dict, logs: LogCollector, spec: LogSpec | None,
                        where: str) -> dict:
    """Adds `self.log`ged values to a training step's metrics; records their options in `spec`.

    Logging "loss" replaces the returned loss's metric entry (the same value in Lightning ports,
    now with the logged flags); any other name a returned metric already has is refused.
    """
    _refuse_suffix_collisions(metrics, logs.entries, where)
    out = dict(metrics)
    for name, entry in logs.entries.items():
        if name in metrics:
            raise ConfigurationError(
                f"{where} both returns metric {name!r} and logs it with self.log; keep one."
            )
        out[name] = entry.value
        if entry.batch_size is not None:
            out[name + WEIGHT] = entry.batch_size
        if spec is not None:
            spec.options[name] = entry.options
    return out


class EpochAccumulator:
    """Sums a training epoch's `on_epoch` values on device; `compute()` reads them once.

    `add` dispatches one tiny jitted sum per step (asynchronous, no host read); modules that log
    nothing with `on_epoch=True` never call it.
    """

    def __init__(self, spec: LogSpec):
        self.spec = spec
        self.names = list(spec.epoch_names)
        reduce = {n: spec.options[n].reduce for n in self.names}
        self._reduce = reduce
        self._acc = None

        def pick(metrics, rows):
            # Without batch_size=, a value weighs as many as its batch's examples, as
            # Lightning's inferred batch size does (a short last batch weighs less). A max or
            # min keeps the value itself (Lightning's max / min ignore the weights).
            out = {}
            for n in self.names:
                w = jnp.asarray(metrics.get(n + WEIGHT, rows), jnp.float32)
                out[n] = (metrics[n] if reduce[n] != "mean" else metrics[n] * w, w)
            return out

        def combine(acc, new):
            ops = {"mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum}
            return {n: (ops[reduce[n]](acc[n][0], new[n][0]), acc[n][1] + new[n][1])
                    for n in self.names}

        # `rows` is static: one trace per batch size (the full batches and a last partial one).
        self._start = jax.jit(pick, static_argnums=1)
        self._add = jax.jit(lambda acc, metrics, rows: combine(acc, pick(metrics, rows)),
                            donate_argnums=0, static_argnums=2)

    def __bool__(self) -> bool:
        return bool(self.names)

    def add(self, metrics: dict, rows: int = 1) -> None:
        """Adds one step's values; `rows`: the batch's examples (its leading dimension)."""
        if not self.names:
            return
        rows = float(rows)
        self._acc = (self._start(metrics, rows) if self._acc is None
                     else self._add(self._acc, metrics, rows))

    def compute(self) -> dict[str, float]:
        """The epoch's weighted means (or max / min), named as logged; resets for the next
        epoch."""
        if self._acc is None:
            return {}
        host = jax.device_get(self._acc)
        self._acc = None
        return {self.spec.epoch_name(n): float(s) / float(w) if self._reduce[n] == "mean"
                else float(s) for n, (s, w) in host.items()}
