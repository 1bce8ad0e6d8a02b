"""Fit: the training loop.

The loop's performance contract (DESIGN.md):
- the train step is compiled once per fit, ahead of time, with shardings fixed before the call;
- the state is donated to every step;
- at most two steps are in flight: after dispatching step t the loop waits for step t-1 to finish
  (unbounded queues deadlock XLA's CPU collectives, and a bounded queue costs nothing on an
  accelerator as long as one step stays queued);
- metrics reach the host only at log intervals, and then those of an already finished step.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlight import _batch
from jaxlight import distributed as _distributed
from jaxlight import strategies as _strategies
from jaxlight._devices import check_strategy_devices, select_devices
from jaxlight._errors import ConfigurationError, DataError, TrainingStopped
from jaxlight._module import TrainModule
from jaxlight._optim import ScheduleUpdate
from jaxlight._porting import check_module
from jaxlight._state import TrainState, make_init_fn, model_spec, split_model
from jaxlight._step import (
    build_eval_step,
    build_optimizer,
    build_params_transform,
    build_predict_step,
    build_train_step,
)
from jaxlight._user_step import tracing_for
from jaxlight.callbacks._base import Callback
from jaxlight.data._convert import check_iterable, numpy_batches
from jaxlight.data._feed import TrainFeed
from jaxlight.data._prefetch import Prefetcher

#: Steps the host may run ahead of the device (see the module docstring).
MAX_IN_FLIGHT = 2


def _len_or_none(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None


def _abstract_global_batch(batch: Any) -> Any:
    """The global batch's shapes, from this process's share (equal shares per process)."""
    n = jax.process_count()

    def one(x):
        x = np.asarray(x)
        return jax.ShapeDtypeStruct((x.shape[0] * n, *x.shape[1:]) if x.ndim else (), x.dtype)

    return jax.tree.map(one, batch)


class _Pending:
    """A dispatched step whose metrics the host has not looked at yet."""

    __slots__ = ("step", "metrics", "log")

    def __init__(self, step: int, metrics: dict, log: bool):
        self.step, self.metrics, self.log = step, metrics, log


class StepOutput:
    """What `on_train_batch_end` receives: the step number and its metrics (device arrays)."""

    __slots__ = ("step", "metrics")

    def __init__(self, step: int, metrics: dict):
        self.step, self.metrics = step, metrics

    def __getitem__(self, key):
        return self.metrics[key]



def _check_batch_limit(name: str, value: Any, verb: str) -> None:
    """A batch limit is None, a positive int (batches) or a float fraction in (0, 1]."""
    if value is None:
        return
    bad = (isinstance(value, bool) or not isinstance(value, int | float)
           or (isinstance(value, int) and value < 1)
           or (isinstance(value, float) and not 0.0 < value <= 1.0))
    if bad:
        skip = ("pass no validation data to skip validation" if "val" in name
                else "set max_steps or max_epochs to train less")
        raise ConfigurationError(
            f"{name}={value!r} would {verb} no batch (or is not a batch count): give a positive "
            f"int (batches per epoch), a float fraction of an epoch in (0, 1], or None for "
            f"every batch; {skip}. (On the command line: --{name.replace('_', '-')}.)"
        )


class Fit:
    """Trains a `TrainModule` with a strategy and callbacks, Lightning's `Trainer` for JAX.

    Args:
        strategy: a `jaxlight.strategies` object or alias (`"auto"`, `"single"`, `"dp"`, ...).
        devices: which devices to use (`jaxlight._devices`): None / "auto" / -1 for all, N for
            the first N of each process, a list of device indices or `jax.Device`s; the rest
            stay idle.
        max_steps: optimizer steps to take; None means "until max_epochs".
        max_epochs: passes over the training data; None means "until max_steps".
        callbacks: `jaxlight.callbacks` objects (host hooks and step transforms).
        precision: shortcut for `callbacks.MixedPrecision(precision)`.
        accumulate_grad_batches: shortcut for `callbacks.GradientAccumulation(k)` when k > 1.
        gradient_clip_val, gradient_clip_algorithm: shortcut for `callbacks.GradientClipping`.
        val_check_interval: validate every this many training steps (int), or this fraction of
            an epoch (float); None validates at the end of every `check_val_every_n_epoch` epoch.
        check_val_every_n_epoch: epochs between end-of-epoch validations.
        limit_train_batches, limit_val_batches: batches per epoch (int) or fraction (float).
        log_every_n_steps: how often training metrics reach loggers (the only host reads).
        enable_progress_bar: add a `TQDMProgressBar` unless one is given.
        enable_model_summary: add a `ModelSummary` unless one is given.
        logger: add a `CSVLogger` under `default_root_dir` unless a logger is given.
        default_root_dir: where default loggers and checkpoints write.
        seed: seeds parameter initialization and every `nnx.Rngs` stream.
        fast_dev_run: run 1 (or n) training and validation batches, no loggers; for smoke tests.
        prefetch_batches: training batches read and transferred to the devices, in their input
            sharding, while the current step runs (a background thread); 0 reads each batch
            when the loop needs it.
        compilation_cache: where compiled steps persist across runs (`jaxlight._cache`): None
            (`$JAXLIGHT_COMPILATION_CACHE`, JAX's own setting, else ~/.cache/jaxlight/xla), a
            directory, True (the default directory) or False (off). Process-wide.

    Example:
        >>> fit = Fit(strategy="single", max_steps=10, enable_progress_bar=False)
    """

    def __init__(
        self,
        strategy: str | _strategies.Strategy = "auto",
        *,
        devices: int | str | Sequence | None = None,
        max_steps: int | None = None,
        max_epochs: int | None = None,
        callbacks: Sequence[Callback] = (),
        precision: str | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        val_check_interval: int | float | None = None,
        check_val_every_n_epoch: int | None = 1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        log_every_n_steps: int = 50,
        enable_progress_bar: bool = True,
        enable_model_summary: bool = True,
        logger: bool = True,
        default_root_dir: str | os.PathLike = "jaxlight_logs",
        seed: int = 0,
        fast_dev_run: bool | int = False,
        prefetch_batches: int = 2,
        compilation_cache: str | os.PathLike | bool | None = None,
    ):
        # Join a launched multi-process job (jaxlight launch, torchrun, SLURM, ...) before
        # anything starts JAX's backend; a no-op for one process or when already joined.
        _distributed.initialize()
        from jaxlight import _cache

        #: The persistent compilation cache directory in use (None: off).
        self.compilation_cache_dir = _cache.configure(compilation_cache)
        self.strategy = _strategies.resolve(strategy)
        self._devices = select_devices(devices)
        check_strategy_devices(self.strategy, self._devices)
        #: The `strategies.Auto` choosing this fit's layout (None: a fixed strategy). Once it
        #: has chosen, `strategy` is the chosen one and `auto.choice` the candidate table.
        self.auto = self.strategy if isinstance(self.strategy, _strategies.Auto) else None
        if fast_dev_run:
            n = 1 if fast_dev_run is True else int(fast_dev_run)
            max_steps, max_epochs = n, 1
            limit_train_batches, limit_val_batches, val_check_interval = n, n, None
            logger, enable_model_summary = False, False
        if max_steps is None and max_epochs is None:
            raise ConfigurationError(
                "Fit needs max_steps or max_epochs (both are None): say how long to train, "
                "for example Fit(max_steps=1000) or Fit(max_epochs=10)."
            )
        for name, value in (("max_steps", max_steps), ("max_epochs", max_epochs),
                            ("log_every_n_steps", log_every_n_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigurationError(f"{name} must be a positive integer, got {value!r}.")
        _check_batch_limit("limit_train_batches", limit_train_batches, "train on")
        _check_batch_limit("limit_val_batches", limit_val_batches, "validate on")
        if isinstance(val_check_interval, float) and not 0.0 < val_check_interval <= 1.0:
            raise ConfigurationError(
                f"val_check_interval={val_check_interval} as a float is a fraction of an epoch "
                "and must be in (0, 1]; pass an int to validate every N steps."
            )
        self.max_steps = max_steps
        self.max_epochs = max_epochs
        self.val_check_interval = val_check_interval
        self.check_val_every_n_epoch = check_val_every_n_epoch
        self.limit_train_batches = limit_train_batches
        self.limit_val_batches = limit_val_batches
        self.log_every_n_steps = log_every_n_steps
        self.default_root_dir = os.fspath(default_root_dir)
        self.seed = seed
        self.fast_dev_run = fast_dev_run
        if not isinstance(prefetch_batches, int) or prefetch_batches < 0:
            raise ConfigurationError(
                f"prefetch_batches must be an integer >= 0, got {prefetch_batches!r} (0 turns "
                "prefetching off, 2 is the default)."
            )
        self.prefetch_batches = prefetch_batches
        self.callbacks: list[Callback] = self._assemble_callbacks(
            list(callbacks), precision, accumulate_grad_batches, gradient_clip_val,
            gradient_clip_algorithm, enable_progress_bar, enable_model_summary, logger,
        )
        from jaxlight._preemption import PreemptionHandler

        #: SIGTERM/SIGUSR1 during fit: checkpoint after the step, then exit (not in `callbacks`).
        self._preemption = PreemptionHandler()
        self.config = {
            "strategy": self.strategy.name, "max_steps": max_steps, "max_epochs": max_epochs,
            "precision": precision, "accumulate_grad_batches": accumulate_grad_batches,
            "gradient_clip_val": gradient_clip_val, "log_every_n_steps": log_every_n_steps,
            "val_check_interval": val_check_interval, "seed": seed,
        }
        # Loop state, read by callbacks through properties.
        self._state: TrainState | None = None
        self._global_step = 0
        self._epoch = 0
        self._batch_idx = 0
        self._stop_reason: str | None = None
        self._stage: str | None = None
        self.logged_metrics: dict[str, float] = {}
        self.callback_metrics: dict[str, float] = {}
        #: Compiles per step kind in this Fit ("init", "train", "eval:validation_step", ...).
        self.compile_counts: dict[str, int] = {}
        #: Seconds spent compiling per step kind ("init" includes running the initializer).
        self.compile_times: dict[str, float] = {}
        self._log_queue: list[tuple[dict, int]] = []
        self._logging = False
        self._compiled: dict[str, Any] = {}
        self._spec = None
        self._schedule = None
        self._shardings = None
        self._eval_batch_size: dict[str, int] = {}
        self._train_data = None
        self._feed: TrainFeed | None = None

    # -- callbacks -----------------------------------------------------------------------------

    @staticmethod
    def _assemble_callbacks(user, precision, accumulate, clip_val, clip_algo, progress,
                            summary, logger) -> list[Callback]:
        from jaxlight import callbacks as cbs

        for cb in user:
            if not isinstance(cb, Callback):
                raise ConfigurationError(
                    f"callbacks must be jaxlight.callbacks.Callback objects; got "
                    f"{type(cb).__name__}. Wrap plain functions in callbacks.LambdaCallback."
                )

        def present(name: str) -> bool:
            cls = getattr(cbs, name, None)
            return cls is not None and any(isinstance(cb, cls) for cb in user)

        shortcuts: list[Callback] = []
        for arg, value, default, name, make in (
            ("precision", precision, None, "MixedPrecision",
             lambda: cbs.MixedPrecision(precision)),
            ("accumulate_grad_batches", accumulate, 1, "GradientAccumulation",
             lambda: cbs.GradientAccumulation(accumulate)),
            ("gradient_clip_val", clip_val, None, "GradientClipping",
             lambda: cbs.GradientClipping(clip_val, algorithm=clip_algo)),
        ):
            if value == default or (arg == "precision" and value in ("32-true", "32", 32)):
                continue
            if present(name):
                raise ConfigurationError(
                    f"Fit({arg}={value!r}) and callbacks.{name} in callbacks both set the same "
                    f"thing; keep one of them (the shortcut just adds callbacks.{name})."
                )
            if not hasattr(cbs, name):
                raise ConfigurationError(f"Fit({arg}=...) needs callbacks.{name}, not available.")
            shortcuts.append(make())
        defaults: list[Callback] = []
        if summary and not present("ModelSummary"):
            defaults.append(cbs.ModelSummary())
        if progress and not present("TQDMProgressBar"):
            defaults.append(cbs.TQDMProgressBar())
        if logger and not any(getattr(cb, "is_logger", False) for cb in user):
            defaults.append(cbs.CSVLogger())
        return shortcuts + user + defaults

    def _call(self, hook: str, *args) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, self._module, *args)
        # Internal, last: a preemption checkpoint follows every callback's step hooks.
        getattr(self._preemption, hook)(self, self._module, *args)

    # -- read-only loop state for callbacks ------------------------------------------------------

    @property
    def state(self) -> TrainState | None:
        """The current train state (device arrays in the strategy's layout)."""
        return self._state

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self._global_step

    @property
    def current_epoch(self) -> int:
        return self._epoch

    @property
    def batch_idx(self) -> int:
        """Batches consumed in the current epoch."""
        return self._batch_idx

    @property
    def should_stop(self) -> bool:
        return self._stop_reason is not None

    @property
    def is_global_zero(self) -> bool:
        return jax.process_index() == 0

    @property
    def log_dir(self) -> str:
        return self.default_root_dir

    @property
    def train_data(self):
        return self._train_data

    @property
    def train_feed(self) -> TrainFeed | None:
        """The training data's reader during fit: its `state()` is what a checkpoint saves."""
        return self._feed

    @property
    def compiled_train_step(self) -> Any | None:
        """The compiled training step (`jax.stages.Compiled` for SPMD strategies), once built.

        Its `cost_analysis()`, `memory_analysis()` and `as_text()` describe one step.
        """
        entry = self._compiled.get("train")
        return None if entry is None else entry[0]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Sends host metrics to every callback's `on_log` (loggers write them) at `step`.

        For callbacks that measure something on the host (throughput, learning rate, memory).
        Called from inside an `on_log`, the metrics go out once the current round has reached
        every callback, so each logger sees whole rounds, in step order.

        Example:
            >>> from jaxlight.callbacks import Callback
            >>> class QueueDepth(Callback):
            ...     def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
            ...         fit.log_metrics({"data/queue_depth": 3.0})
        """
        self._log_queue.append((dict(metrics), self._global_step if step is None else step))
        if self._logging:
            return
        self._logging = True
        try:
            while self._log_queue:
                queued, at = self._log_queue.pop(0)
                self.logged_metrics.update(queued)
                self._call("on_log", queued, at)
        finally:
            self._logging = False

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """Stops training after the current step (EarlyStopping, preemption, guards).

        With several processes, all must leave the loop at the same step: a request takes
        effect at the next agreement point (after a log interval's metrics reached the
        callbacks, after a validation, at an epoch's end), where every process adopts it
        (`jaxlight.distributed.agree_stop`).
        """
        if self._stop_reason is None:
            self._stop_reason = reason

    def _agree_stop(self) -> None:
        """Multi-process: every process adopts a stop that any process requested."""
        if self._agreed_stop is None:
            self._agreed_stop = _distributed.agree_stop(self._stop_reason)
            if self._agreed_stop is not None:
                self._stop_reason = self._agreed_stop

    # -- set-up ------------------------------------------------------------------------------

    def _setup(self, module: TrainModule, stage: str) -> None:
        if not isinstance(module, TrainModule):
            raise ConfigurationError(
                f"Fit.{stage} takes a jaxlight.TrainModule, got {type(module).__name__}."
            )
        check_module(module)  # Lightning habits that cannot run, refused before tracing
        self._module = module
        self._stage = stage
        if self.strategy.mesh is None:
            self.strategy.setup(self._devices)
        if self._spec is None or self._spec_module is not module:
            tx, scheduler = build_optimizer(module, self.callbacks)
            self._tx = tx
            self._schedule = (None if scheduler is None
                              else ScheduleUpdate(scheduler, self._compile_state_update))
            self._params_transform = build_params_transform(self.callbacks)
            self._spec = model_spec(module, tx, self.seed, self._params_transform)
            self._spec_module = module
            self._compiled = {}
            self._shardings = None
            if self.auto is not None:
                self.strategy = self.auto  # a new model: choose again
            # fit and plan can wait for a batch to measure with (unless auto's shortcut holds)
            self._choose_layout(None, defer=stage in ("fit", "plan"))

    def _choose_layout(self, abstract_batch: Any, defer: bool = False) -> None:
        """Fixes the state's shardings; `strategies.Auto` first picks the layout, compiling
        candidate train steps for `abstract_batch` (None: from state bytes alone)."""
        if self._shardings is not None:
            return
        if self.auto is not None:
            def make_step(strategy):
                return build_train_step(self._module, self._spec.graphdef, self._tx,
                                        self.callbacks, strategy, frozen=self._spec.frozen)

            chosen = self.auto.choose(self._spec.abstract_state, self._spec.logical_axes,
                                      abstract_batch, make_step, defer=defer)
            if chosen is None:
                return  # decided with the first batch
            self.strategy = chosen
            self.compile_counts["auto"] = self.auto.choice.compiles
            self.compile_times["auto"] = self.auto.choice.seconds
        self._shardings = self.strategy.state_shardings(
            self._spec.abstract_state, self._spec.logical_axes
        )
        warn = getattr(self.strategy, "warn_unused_rules", None)
        if warn is not None:
            warn(self._spec.logical_axes)

    def _compile_state_update(self, fn, extra_abstract: tuple):
        """Compiles `fn(state, *extra) -> state` (the state donated, extras replicated)."""
        rep = self.strategy.replicated()
        with self._compiling("schedule"):
            return self.strategy.compile(
                fn, (self._spec.abstract_state, *extra_abstract),
                in_shardings=(self._shardings, *(rep for _ in extra_abstract)),
                out_shardings=self._shardings, donate_argnums=(0,))

    def _count_compile(self, kind: str) -> None:
        self.compile_counts[kind] = self.compile_counts.get(kind, 0) + 1

    @contextlib.contextmanager
    def _compiling(self, kind: str):
        """Counts one compile of `kind` and adds its wall time to `compile_times`."""
        self._count_compile(kind)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.compile_times[kind] = (self.compile_times.get(kind, 0.0)
                                        + time.perf_counter() - start)

    def _init_state(self) -> TrainState:
        init = make_init_fn(self._module, self._tx, self.seed, self._params_transform)
        with self._compiling("init"):
            return self.strategy.init_state(init, self._spec.abstract_state, self._shardings)

    def _state_from_model(self, model: nnx.Module) -> TrainState:
        """Places an existing model's variables into this strategy's layout (no optimizer)."""
        _, params, rest = split_model(model, self._module.trainable)
        state = TrainState(step=np.zeros((), np.int32), params=params, opt_state=None, rest=rest)
        return self.strategy.from_canonical(state, self._state_shardings(state))

    def _state_shardings(self, state: TrainState) -> TrainState:
        """The shardings of `state`, which may lack the optimizer (evaluation from a model)."""
        if state.opt_state is None:
            return self._shardings.replace(opt_state=None)
        return self._shardings

    def _eval_size(self, kind: str, local: int) -> int:
        """The padded local batch size of an evaluation kind, fixed by its first batch."""
        if kind not in self._eval_batch_size:
            dp_local = max(1, self.strategy.data_parallel_size // jax.process_count())
            # Processes may hold different counts (an uneven last batch): all pad to the
            # largest, so that they compile the same step.
            self._eval_batch_size[kind] = _distributed.agree_max(
                f"eval_batch:{kind}", math.ceil(local / dp_local) * dp_local)
        return self._eval_batch_size[kind]

    def _canonical_abstract(self, state: TrainState) -> TrainState:
        """Shapes of `state` as the model sees them (without DDP's device axis)."""
        shapes = jax.eval_shape(self.strategy.to_canonical, state)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)

    def _compile_train_step(self, abstract_batch: Any):
        if "train" in self._compiled:
            return self._compiled["train"]
        step = build_train_step(self._module, self._spec.graphdef, self._tx, self.callbacks,
                                self.strategy, frozen=self._spec.frozen)
        batch_sh = self.strategy.batch_shardings(abstract_batch)
        _batch.check_batch_layout(batch_sh, abstract_batch, "training batch")
        with self._compiling("train"):
            compiled = self.strategy.compile(
                step,
                (self._spec.abstract_state, abstract_batch),
                in_shardings=(self._shardings, batch_sh),
                out_shardings=(self._shardings, self.strategy.replicated()),
                donate_argnums=(0,),
            )
        self._compiled["train"] = (compiled, batch_sh)
        return self._compiled["train"]

    def plan(self, module: TrainModule, example_batch: Any, *, verbose: bool = True):
        """Compiles the training step for `example_batch` without running it; reports costs.

        Returns a `jaxlight._plan.Plan`: per parameter shape, spec and bytes per device; per
        device argument/output/temp bytes; per step collectives by kind with bytes. Prints the
        table when `verbose`.

        Example:
            >>> # plan = jl.Fit(strategy="fsdp", max_steps=1).plan(module, first_batch)
            >>> # plan.collective_totals["all-gather"]["traffic_bytes"]
        """
        from jaxlight._plan import plan

        return plan(self, module, example_batch, verbose=verbose)

    # -- fit -----------------------------------------------------------------------------------

    def fit(
        self,
        module: TrainModule,
        train_data: Iterable,
        val_data: Iterable | None = None,
        ckpt_path: str | None = None,
    ) -> TrainModule:
        """Trains `module`; afterwards `module.model` holds the trained `nnx.Module`."""
        self._setup(module, "fit")
        self._train_data = train_data
        self._feed = TrainFeed(train_data)
        self._val_data = val_data
        if self._schedule is not None and self._schedule.scheduler.monitor and val_data is None:
            raise ConfigurationError(
                f"{type(module).__name__}.configure_optimizers' lr_scheduler monitors "
                f"{self._schedule.scheduler.monitor!r}, a validation metric, but Fit.fit got no "
                "val_data. Pass val_data, or use a schedule that reads no metric."
            )
        self._stop_reason = None
        self._agreed_stop: str | None = None
        self._multi_process = jax.process_count() > 1
        self._call("setup", "fit")
        try:
            self._state = None
            restored = None
            if ckpt_path is not None:
                from jaxlight._checkpoint import resume_fit

                self._choose_layout(None)  # restoring needs the layout before any batch
                restored = resume_fit(self, module, ckpt_path)
            if restored is None:
                self._global_step, self._epoch, self._batch_idx = 0, 0, 0
            self._call("on_fit_start")
            self._run_training(train_data, val_data)
            self._call("on_fit_end")
        except BaseException as exc:
            self._call("on_exception", exc)
            raise
        finally:
            if self._state is not None:
                self._publish_model()
            self._call("teardown", "fit")
        return module

    def _publish_model(self) -> None:
        canonical = self.strategy.to_canonical(self._state)
        self._module.model = nnx.merge(self._spec.graphdef, canonical.params, canonical.rest)

    def _epoch_batches(self, limit: int | None) -> Iterator:
        """This epoch's `(batch, position)` pairs, never reading past what will be trained."""
        budget = None if self.max_steps is None else self.max_steps - self._global_step
        if limit is not None:
            left = limit - self._batch_idx
            budget = left if budget is None else min(budget, left)
        return self._feed.epoch(self._epoch, self._batch_idx, budget)

    def _limit(self, limit, data) -> int | None:
        if limit is None:
            return None
        if isinstance(limit, float):
            try:
                return max(1, int(len(data) * limit))
            except TypeError:
                raise ConfigurationError(
                    f"a fractional batch limit ({limit}) needs data with len(); this iterable "
                    "has none. Pass an integer number of batches instead."
                ) from None
        return int(limit)

    def _val_every(self, train_data) -> int | None:
        v = self.val_check_interval
        if v is None:
            return None
        if isinstance(v, float):
            try:
                per_epoch = len(train_data)
            except TypeError:
                raise ConfigurationError(
                    f"val_check_interval={v} (a fraction of an epoch) needs training data with "
                    "len(); pass an integer number of steps instead."
                ) from None
            limit = self._limit(self.limit_train_batches, train_data)
            per_epoch = min(per_epoch, limit) if limit else per_epoch
            return max(1, int(per_epoch * v))
        return int(v)

    def _check_batch(self, batch: Any, reference: _batch.BatchSignature, index: int) -> None:
        _batch.check_same_signature(
            batch, reference, f"training batch {index} of epoch {self._epoch}",
            "Every training batch must have the same structure and shapes (drop a last partial "
            "batch, for example ArrayLoader(drop_remainder=True)).")

    def _run_training(self, train_data: Iterable, val_data: Iterable | None) -> None:
        limit = self._limit(self.limit_train_batches, train_data)
        val_every = self._val_every(train_data)
        pairs = self._epoch_batches(limit)
        try:
            first, first_position = next(pairs)
        except StopIteration:
            raise DataError(
                "the training data yielded no batch: the iterable is empty (or exhausted, if it "
                "is a one-shot iterator). Pass a non-empty iterable of batches."
            ) from None
        # Every process must feed an equal share, or they compile different steps and hang.
        _batch.check_batch_agreement(first, "training batch", _len_or_none(train_data))
        abstract_batch = _abstract_global_batch(first)
        first_name = f"training batch {self._batch_idx} of epoch {self._epoch}"
        with tracing_for(first_name, "train_data", first):
            self._choose_layout(abstract_batch)
        self.strategy.check_batch(abstract_batch)
        reference = _batch.batch_signature(first, first_name)
        if self._state is None:
            self._state = self._init_state()
        with tracing_for(first_name, "train_data", first):
            compiled, batch_sh = self._compile_train_step(abstract_batch)
        self._call("on_train_start")

        def put(batch):
            return self.strategy.put_batch(batch, batch_sh)

        pending: _Pending | None = None
        first_epoch = True
        if self._multi_process:
            self._agree_stop()
        while not self._done():
            if first_epoch:
                pairs = itertools.chain([(first, first_position)], pairs)
            else:
                pairs = self._epoch_batches(limit)
            self._call("on_train_epoch_start")
            start = self._batch_idx
            batches = Prefetcher(pairs, put, self.prefetch_batches,
                                 lambda b, n, s=start: self._check_batch(b, reference, s + n))
            first_epoch = False
            got_any = False
            try:
                for batch, device_batch, position in batches:
                    got_any = True
                    self._call("on_train_batch_start", batch, self._batch_idx)
                    self._state, metrics = compiled(self._state, device_batch)
                    self._feed.consumed(position)
                    self._global_step += 1
                    self._batch_idx += 1
                    logged = pending is not None and pending.log
                    if pending is not None:
                        self._retire(pending)
                    log = self._global_step % self.log_every_n_steps == 0
                    pending = _Pending(self._global_step, metrics, log)
                    self._call("on_train_batch_end", StepOutput(self._global_step, metrics), batch,
                               self._batch_idx - 1)
                    if val_every and self._global_step % val_every == 0 and val_data is not None:
                        pending = self._retire(pending, final=True)
                        self._run_validation(val_data)
                        logged = True
                    if self._multi_process and logged:
                        self._agree_stop()
                    if self._done():
                        break
            finally:
                batches.close()
            if not got_any and self._batch_idx == 0:
                raise DataError(
                    f"the training data yielded no batch in epoch {self._epoch} (it gave batches "
                    "before): a one-shot iterator cannot be iterated twice. Pass a re-iterable "
                    "(a list, jaxlight.data.ArrayLoader) or set max_steps within one pass."
                )
            if pending is not None:
                pending = self._retire(pending, final=True)
            if self._hit_max_steps() and not self._epoch_exhausted(train_data, limit):
                break  # stopped mid-epoch: no epoch-end hooks, as in Lightning
            # A stop requested mid-epoch (EarlyStopping at a val_check_interval) skips the
            # end-of-epoch validation, as Lightning does: the epoch did not end.
            stopped_early = self.should_stop and not self._epoch_exhausted(train_data, limit)
            validate = (val_data is not None and val_every is None
                        and self.check_val_every_n_epoch
                        and (self._epoch + 1) % self.check_val_every_n_epoch == 0
                        and not stopped_early)
            if self._schedule is not None:
                # Before the epoch-end hooks, where checkpoints are taken: they resume it.
                self._state = self._schedule.at_epoch_end(self._state, self._epoch,
                                                          bool(validate))
            self._call("on_train_epoch_end")
            if validate:
                self._run_validation(val_data, epoch_end=True)
            if self._multi_process:
                self._agree_stop()
            self._epoch += 1
            self._batch_idx = 0
        if pending is not None:
            self._retire(pending, final=True)
        if self._multi_process:
            self._agree_stop()  # a guard's last-moment error must end every process alike
        if self._stop_reason is not None and self._stop_reason.startswith("error:"):
            raise TrainingStopped(self._stop_reason[len("error:"):].strip())
        self._call("on_train_end")

    def _hit_max_steps(self) -> bool:
        return self.max_steps is not None and self._global_step >= self.max_steps

    def _epoch_exhausted(self, data, limit) -> bool:
        try:
            n = len(data)
        except TypeError:
            return False
        n = min(n, limit) if limit else n
        return self._batch_idx >= n

    def _done(self) -> bool:
        stop = self._agreed_stop if getattr(self, "_multi_process", False) else self._stop_reason
        if stop is not None or self._hit_max_steps():
            return True
        return self.max_epochs is not None and self._epoch >= self.max_epochs

    def _retire(self, pending: _Pending, final: bool = False) -> _Pending | None:
        """Waits for a finished-or-nearly step and logs its metrics at log intervals."""
        jax.block_until_ready(pending.metrics)
        if pending.log or final:
            host = jax.device_get(pending.metrics)
            metrics = {"loss": float(host.pop("loss"))} if "loss" in host else {}
            metrics.update((k, float(v)) for k, v in host.items())
            metrics["epoch"] = float(self._epoch)
            self.callback_metrics.update(metrics)
            self.log_metrics(metrics, pending.step)
            pending.log = False
        return None if final else pending

    # -- evaluation ----------------------------------------------------------------------------

    def _run_validation(self, val_data: Iterable, epoch_end: bool = False) -> dict[str, float]:
        self._call("on_validation_start")
        self._call("on_validation_epoch_start")
        metrics = self._evaluate(val_data, "validation_step", "val", self.limit_val_batches,
                                 f"validation at step {self._global_step}", "val_data")
        if self._schedule is not None:
            # Before the end hooks, where checkpoints are taken: they resume it.
            self._state = self._schedule.after_validation(
                self._state, metrics, self._global_step, self._epoch, epoch_end)
        self.callback_metrics.update(metrics)
        self.log_metrics(metrics, self._global_step)
        self._call("on_validation_epoch_end")
        self._call("on_validation_end")
        return metrics

    def _pad(self, batch: Any, size: int, what: str) -> tuple[Any, np.ndarray]:
        n = int(np.shape(jax.tree.leaves(batch)[0])[0])
        if n > size:
            raise DataError(
                f"{what} batch of {n} examples is larger than the first {what} batch ({size}); "
                "the evaluation step is compiled for the first batch's size. Put the largest "
                "batch first or use equal batch sizes."
            )
        mask = np.arange(size) < n
        if n == size:
            return batch, mask
        # Pad with copies of the first example (finite values); the mask drops them. A process
        # can get no example of a short last batch (fewer examples than processes): zeros then.
        def pad(x):
            x = np.asarray(x)
            fill = np.repeat(x[:1], size - n, 0) if n else np.zeros((size, *x.shape[1:]), x.dtype)
            return np.concatenate([x, fill])

        return jax.tree.map(pad, batch), mask

    def _eval_state(self) -> TrainState:
        if self._state is not None:
            return self._state
        if self._module._model is not None:
            return self._state_from_model(self._module.model)
        self._state = self._init_state()
        return self._state

    def _evaluate(self, data: Iterable, method: str, prefix: str, limit_arg,
                  occasion: str = "", data_name: str = "the data") -> dict[str, float]:
        limit = self._limit(limit_arg, data)
        if hasattr(data, "set_epoch"):
            data.set_epoch(0)  # every evaluation reads the data from its start, in one order
        state = self._eval_state()
        totals = None
        compiled = None
        pending = None
        check_iterable(data, prefix)
        for idx, batch in enumerate(numpy_batches(data)):
            if limit is not None and idx >= limit:
                break
            local = int(np.shape(jax.tree.leaves(batch)[0])[0])
            size = self._eval_size(method, local)
            batch, mask = self._pad(batch, size, prefix)
            if compiled is None:
                what = "validation" if prefix == "val" else prefix
                with tracing_for(f"{what} batch {idx}" + (f" ({occasion})" if occasion else ""),
                                 data_name, batch):
                    compiled, batch_sh, mask_sh, totals = self._compile_eval(method, batch, state)
            device_batch = self.strategy.put_batch(batch, batch_sh)
            device_mask = self.strategy.put_batch(mask, mask_sh)
            totals = compiled(state, device_batch, device_mask, totals)
            if pending is not None:
                jax.block_until_ready(pending)
            pending = totals
            self._call("on_validation_batch_end", batch, idx) if prefix == "val" else None
        if totals is None:
            raise DataError(f"the {prefix} data yielded no batch; pass a non-empty iterable.")
        host = jax.device_get(totals)
        count = float(host.pop("__count__"))
        return {(k if k.startswith(prefix) else f"{prefix}_{k}"): float(v) / count
                for k, v in host.items()}

    def _compile_eval(self, method: str, batch: Any, state: TrainState):
        key = f"eval:{method}:{state.opt_state is None}"
        if key not in self._compiled:
            self._compiled[key] = self._compile_eval_uncached(method, batch, state)
        return self._compiled[key]

    def _compile_eval_uncached(self, method: str, batch: Any, state: TrainState):
        _batch.check_batch_agreement(batch, f"{method} batch (padded)")
        abstract_batch = _abstract_global_batch(batch)
        self.strategy.check_batch(abstract_batch, what=f"{method} batch")
        abstract_mask = _abstract_global_batch(np.zeros(np.shape(jax.tree.leaves(batch)[0])[0],
                                                        bool))
        batch_sh = self.strategy.batch_shardings(abstract_batch)
        _batch.check_batch_layout(batch_sh, abstract_batch, f"{method} batch")
        mask_sh = self.strategy.batch_shardings(abstract_mask)
        key = f"eval:{method}"
        eval_step, batch_sums = build_eval_step(self._module, self._spec.eval_graphdef, method,
                                                self.strategy)
        state_sh = self._state_shardings(state)
        abstract_state = self._canonical_abstract(state)
        with self.strategy.trace_context():
            abstract_totals = jax.eval_shape(batch_sums, abstract_state, abstract_batch,
                                             abstract_mask)
        rep = self.strategy.replicated()
        with self._compiling(key):
            compiled = self.strategy.compile(
                eval_step,
                (abstract_state, abstract_batch, abstract_mask, abstract_totals),
                in_shardings=(state_sh, batch_sh, mask_sh, rep),
                out_shardings=rep,  # a few scalars, not donated: the loop can wait on them
            )
        zeros = jax.device_put(
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_totals),
            self.strategy.replicated_like(abstract_totals),
        )
        return compiled, batch_sh, mask_sh, zeros

    def validate(self, module: TrainModule, data: Iterable, ckpt_path: str | None = None
                 ) -> dict[str, float]:
        """Runs `validation_step` over `data`; returns exact metrics over every example."""
        return self._eval_entry(module, data, ckpt_path, "validate", "validation_step", "val",
                                self.limit_val_batches)

    def test(self, module: TrainModule, data: Iterable, ckpt_path: str | None = None
             ) -> dict[str, float]:
        """Runs `test_step` over `data`; returns exact metrics over every example."""
        return self._eval_entry(module, data, ckpt_path, "test", "test_step", "test", None)

    def _eval_entry(self, module, data, ckpt_path, stage, method, prefix, limit):
        self._setup(module, stage)
        self._call("setup", stage)
        try:
            if ckpt_path is not None:
                from jaxlight._checkpoint import load_checkpoint

                load_checkpoint(ckpt_path, module, strategy=self.strategy, fit=self)
                self._state = None
            start, end = (("on_validation_start", "on_validation_end") if prefix == "val"
                          else ("on_test_start", "on_test_end"))
            self._call(start)
            metrics = self._evaluate(data, method, prefix, limit, f"Fit.{stage}",
                                     f"the data passed to Fit.{stage}")
            self.callback_metrics.update(metrics)
            self.log_metrics(metrics, self._global_step)
            self._call(end)
            return metrics
        except BaseException as exc:
            self._call("on_exception", exc)
            raise
        finally:
            self._call("teardown", stage)

    def predict(self, module: TrainModule, data: Iterable, ckpt_path: str | None = None
                ) -> list[Any]:
        """Runs `predict_step` over `data`; returns one NumPy pytree per batch (padding cut)."""
        self._setup(module, "predict")
        self._call("setup", "predict")
        try:
            if ckpt_path is not None:
                from jaxlight._checkpoint import load_checkpoint

                load_checkpoint(ckpt_path, module, strategy=self.strategy, fit=self)
                self._state = None
            self._call("on_predict_start")
            state = self._eval_state()
            outputs, compiled = [], None
            check_iterable(data, "predict")
            for batch in numpy_batches(data):
                local = int(np.shape(jax.tree.leaves(batch)[0])[0])
                size = self._eval_size("predict", local)
                batch, _ = self._pad(batch, size, "predict")
                if compiled is None:
                    _batch.check_batch_agreement(batch, "predict batch (padded)")
                    abstract_batch = _abstract_global_batch(batch)
                    batch_sh = self.strategy.batch_shardings(abstract_batch)
                    _batch.check_batch_layout(batch_sh, abstract_batch, "predict batch")
                    state_sh = self._state_shardings(state)
                    abstract_state = self._canonical_abstract(state)
                    with self._compiling("predict"), tracing_for(
                            "predict batch 0", "the data passed to Fit.predict", batch):
                        compiled = self.strategy.compile(
                            build_predict_step(module, self._spec.eval_graphdef),
                            (abstract_state, abstract_batch),
                            in_shardings=(state_sh, batch_sh), out_shardings=None)
                out = compiled(state, self.strategy.put_batch(batch, batch_sh))
                if jax.process_count() > 1:
                    # Process p's rows sit at [p * size, p * size + its count) of the output.
                    counts = _distributed.all_gather_json("predict_rows", local)
                    rows = np.concatenate([np.arange(p * size, p * size + c)
                                           for p, c in enumerate(counts)])
                    out = jax.tree.map(lambda x: np.asarray(
                        jax.experimental.multihost_utils.process_allgather(x, tiled=True))[rows],
                        out)
                else:
                    out = jax.tree.map(lambda x: np.asarray(x)[:local], out)
                outputs.append(out)
            self._call("on_predict_end")
            return outputs
        except BaseException as exc:
            self._call("on_exception", exc)
            raise
        finally:
            self._call("teardown", "predict")
