"""Fit: the facade users call — fit / validate / test / predict / plan, and read-only loop state.

`Fit` wires named parts together and holds no loop logic itself:

- `FitConfig` (`_config.py`): the validated, frozen settings;
- `Session` (`_session.py`): spec, shardings, optimizer, train state and compiled steps;
- `LoopState` (`_loop_state.py`): step, epoch, batch index, stop request;
- `TrainLoop` (`_train_loop.py`): the training loop;
- `Evaluator` (`_evaluation.py`): validation, test and prediction loops;
- `Hooks` / `MetricLog` (`_hooks.py`): callback dispatch and the `on_log` queue.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from jaxlight import _cache, _plan
from jaxlight import distributed as _distributed
from jaxlight import strategies as _strategies
from jaxlight._devices import check_strategy_devices, select_devices
from jaxlight._errors import ConfigurationError
from jaxlight._fit._config import FitConfig, batch_limit, validation_interval
from jaxlight._fit._evaluation import Evaluator
from jaxlight._fit._hooks import Hooks, MetricLog, assemble_callbacks
from jaxlight._fit._loop_state import LoopState
from jaxlight._fit._session import Session, abstract_global_batch
from jaxlight._fit._train_loop import TrainLoop
from jaxlight._module import TrainModule
from jaxlight._porting import check_module, refuse_fit_kwargs
from jaxlight._state import TrainState
from jaxlight.callbacks._base import Callback
from jaxlight.data._feed import TrainFeed


class Fit:
    """Trains a `TrainModule` with a strategy and callbacks, Lightning's `Trainer` for JAX.

    Args:
        strategy: a `jaxlight.strategies` object or alias (`"auto"`, `"single"`, `"dp"`, ...).
        devices: the devices to use (`jaxlight._devices`): None / "auto" / -1 for all, N for
            the first N of each process, a list of device indices or `jax.Device`s. The
            strategy's mesh spans only these; the rest stay idle.
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
        num_sanity_val_steps: validation batches run before training (-1: all, 0: none), as
            in Lightning: an error in `validation_step` or in the validation data shows before
            the first training step, not at the first validation. The step compiled for it is
            the one validation reuses; its metrics are not logged; callbacks get
            `on_sanity_check_start` / `on_sanity_check_end` and no validation hook.
        log_every_n_steps: how often training metrics reach loggers (the only host reads).
        enable_progress_bar: add a `TQDMProgressBar` unless one is given.
        enable_model_summary: add a `ModelSummary` unless one is given.
        logger: add a `CSVLogger` under `default_root_dir` unless a logger is given; or
            Lightning's form, a logger (or a list of them) to add to the callbacks.
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
        num_sanity_val_steps: int = 2,
        log_every_n_steps: int = 50,
        enable_progress_bar: bool = True,
        enable_model_summary: bool = True,
        logger: bool | Callback | Sequence[Callback] = True,
        default_root_dir: str | os.PathLike = "jaxlight_logs",
        seed: int = 0,
        fast_dev_run: bool | int = False,
        prefetch_batches: int = 2,
        compilation_cache: str | os.PathLike | bool | None = None,
        **unknown: Any,
    ):
        if unknown:  # Lightning Trainer arguments get the jaxlight form; typos a did-you-mean
            valid = [n for n in inspect.signature(Fit.__init__).parameters
                     if n not in ("self", "unknown")]
            refuse_fit_kwargs(unknown, valid)
        if logger is not None and not isinstance(logger, bool):
            # Lightning's logger=WandbLogger(...) (or a list): the loggers join the callbacks.
            given = list(logger) if isinstance(logger, list | tuple) else [logger]
            bad = [type(x).__name__ for x in given
                   if not (isinstance(x, Callback) and getattr(x, "is_logger", False))]
            if bad:
                raise ConfigurationError(
                    f"Fit(logger=...) takes True / False (the default CSVLogger), or jaxlight "
                    f"loggers (callbacks.CSVLogger, TensorBoardLogger, WandbLogger); got {bad}."
                )
            callbacks, logger = [*callbacks, *given], True
        # Join a launched multi-process job (jaxlight launch, torchrun, SLURM, ...) before
        # anything starts JAX's backend; a no-op for one process or when already joined.
        _distributed.initialize()
        #: The persistent compilation cache directory in use (None: off).
        self.compilation_cache_dir = _cache.configure(compilation_cache)
        resolved = _strategies.resolve(strategy)
        chosen = select_devices(devices)
        check_strategy_devices(resolved, chosen)
        self._config = FitConfig.create(
            max_steps=max_steps, max_epochs=max_epochs, precision=precision,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            limit_train_batches=limit_train_batches, limit_val_batches=limit_val_batches,
            num_sanity_val_steps=num_sanity_val_steps,
            log_every_n_steps=log_every_n_steps, enable_progress_bar=enable_progress_bar,
            enable_model_summary=enable_model_summary, logger=logger,
            default_root_dir=default_root_dir, seed=seed, fast_dev_run=fast_dev_run,
            prefetch_batches=prefetch_batches,
        )
        self.callbacks: list[Callback] = assemble_callbacks(list(callbacks), self._config)
        #: The settings loggers record as the run's config.
        self.config = self._config.summary(resolved.name)
        self.config["devices"] = None if chosen is None else [d.id for d in chosen]
        self._session = Session(resolved, self.callbacks, self._config.seed, chosen)
        self._position = LoopState()
        self._call = Hooks(self, self.callbacks)
        self._log = MetricLog(self._call)
        self._evaluator = Evaluator(self._config, self._session, self._position, self._call,
                                    self._log)
        self._stage: str | None = None
        self._train_data = None
        self._val_data = None
        self._feed: TrainFeed | None = None

    # -- settings (read-only) ------------------------------------------------------------------

    @property
    def settings(self) -> FitConfig:
        """The validated settings (`FitConfig`, frozen)."""
        return self._config

    max_steps = property(lambda self: self._config.max_steps)
    max_epochs = property(lambda self: self._config.max_epochs)
    val_check_interval = property(lambda self: self._config.val_check_interval)
    check_val_every_n_epoch = property(lambda self: self._config.check_val_every_n_epoch)
    limit_train_batches = property(lambda self: self._config.limit_train_batches)
    limit_val_batches = property(lambda self: self._config.limit_val_batches)
    num_sanity_val_steps = property(lambda self: self._config.num_sanity_val_steps)
    log_every_n_steps = property(lambda self: self._config.log_every_n_steps)
    default_root_dir = property(lambda self: self._config.default_root_dir)
    seed = property(lambda self: self._config.seed)
    fast_dev_run = property(lambda self: self._config.fast_dev_run)
    prefetch_batches = property(lambda self: self._config.prefetch_batches)

    # -- read-only loop state for callbacks ------------------------------------------------------

    @property
    def strategy(self) -> _strategies.Strategy:
        """The strategy in use (under `strategies.Auto`, the chosen one once it has chosen)."""
        return self._session.strategy

    @property
    def auto(self):
        """The `strategies.Auto` choosing this fit's layout (None: a fixed strategy). Once it
        has chosen, `strategy` is the chosen one and `auto.choice` the candidate table."""
        return self._session.auto

    @property
    def session(self) -> Session:
        """The device side: spec, shardings, optimizer, train state, compiled steps."""
        return self._session

    @property
    def state(self) -> TrainState | None:
        """The current train state (device arrays in the strategy's layout)."""
        return self._session.state

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        return self._position.global_step

    @property
    def current_epoch(self) -> int:
        return self._position.epoch

    @property
    def batch_idx(self) -> int:
        """Batches consumed in the current epoch."""
        return self._position.batch_idx

    @property
    def should_stop(self) -> bool:
        return self._position.should_stop

    @property
    def stop_reason(self) -> str | None:
        """Why training stops (None while it goes on)."""
        return self._position.stop_reason

    @property
    def is_global_zero(self) -> bool:
        return jax.process_index() == 0

    @property
    def log_dir(self) -> str:
        return self._config.default_root_dir

    @property
    def train_data(self):
        return self._train_data

    @property
    def val_data(self):
        """The validation data of the current `fit` (None without one)."""
        return self._val_data

    @property
    def val_every_n_steps(self) -> int | None:
        """Training steps between validations during fit (None: at epoch ends, per
        `check_val_every_n_epoch`), from `val_check_interval` and the training data."""
        if self._train_data is None:
            return None
        return validation_interval(self._config, self._train_data)

    @property
    def train_feed(self) -> TrainFeed | None:
        """The training data's reader during fit: its `state()` is what a checkpoint saves."""
        return self._feed

    @property
    def progress_bar_metrics(self) -> set[str]:
        """Names the module logged with `self.log(..., prog_bar=True)` (the bar shows them)."""
        return self._session.progress_bar_metrics

    @property
    def compiled_train_step(self) -> Any | None:
        """The compiled training step (`jax.stages.Compiled` for SPMD strategies), once built.

        Its `cost_analysis()`, `memory_analysis()` and `as_text()` describe one step.
        """
        return self._session.compiled_train_step

    @property
    def compile_counts(self) -> dict[str, int]:
        """Compiles per step kind in this Fit ("init", "train", "eval:validation_step", ...)."""
        return self._session.compile_counts

    @property
    def compile_times(self) -> dict[str, float]:
        """Seconds spent compiling per step kind ("init" includes running the initializer)."""
        return self._session.compile_times

    @property
    def logged_metrics(self) -> dict[str, float]:
        return self._log.logged_metrics

    @property
    def callback_metrics(self) -> dict[str, float]:
        return self._log.callback_metrics

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
        self._log.log(metrics, self._position.global_step if step is None else step)

    def request_stop(self, reason: str = "requested by a callback") -> None:
        """Stops training after the current step (EarlyStopping, preemption, guards).

        With several processes, all must leave the loop at the same step: a request takes
        effect at the next agreement point (after a log interval's metrics reached the
        callbacks, after a validation, at an epoch's end), where every process adopts it
        (`jaxlight.distributed.agree_stop`).
        """
        self._position.request_stop(reason)

    # -- set-up ------------------------------------------------------------------------------

    def _setup(self, module: TrainModule, stage: str) -> None:
        if not isinstance(module, TrainModule):
            raise ConfigurationError(
                f"Fit.{stage} takes a jaxlight.TrainModule, got {type(module).__name__}."
            )
        check_module(module)  # Lightning habits that cannot run, refused before tracing
        self._stage = stage
        self._call.module = module
        self._session.setup(module, stage)

    def plan(self, module: TrainModule, example_batch: Any, *, verbose: bool = True):
        """Compiles the training step for `example_batch` without running it; reports costs.

        Returns a `jaxlight._plan.Plan`: per parameter shape, spec and bytes per device; per
        device argument/output/temp bytes; per step collectives by kind with bytes. Prints the
        table when `verbose`.

        Example:
            >>> # plan = jl.Fit(strategy="fsdp", max_steps=1).plan(module, first_batch)
            >>> # plan.collective_totals["all-gather"]["traffic_bytes"]
        """
        self._setup(module, "plan")
        return _plan.plan(self._session, abstract_global_batch(example_batch), verbose=verbose)

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
        schedule = self._session.schedule
        if schedule is not None and schedule.scheduler.monitor and val_data is None:
            raise ConfigurationError(
                f"{type(module).__name__}.configure_optimizers' lr_scheduler monitors "
                f"{schedule.scheduler.monitor!r}, a validation metric, but Fit.fit got no "
                "val_data. Pass val_data, or use a schedule that reads no metric."
            )
        self._train_data = train_data
        self._feed = TrainFeed(train_data)
        self._val_data = val_data
        self._position.start(multi_process=jax.process_count() > 1)
        self._call("setup", "fit")
        try:
            self._session.state = None
            restored = None
            if ckpt_path is not None:
                from jaxlight._checkpoint import resume_fit

                self._session.choose_layout(None)  # restoring needs the layout before any batch
                restored = resume_fit(self, module, ckpt_path)
            if restored is None:
                self._position.move_to(0, 0, 0)
            self._call("on_fit_start")
            TrainLoop(self._config, self._session, self._position, self._call, self._log,
                      self._evaluator, self._feed).run(train_data, val_data)
            self._call("on_fit_end")
        except BaseException as exc:
            self._call("on_exception", exc)
            raise
        finally:
            if self._session.state is not None:
                module.model = self._session.model(self._session.state)
            self._call("teardown", "fit")
        return module

    # -- evaluation and prediction -------------------------------------------------------------

    def validate(self, module: TrainModule, data: Iterable, ckpt_path: str | None = None
                 ) -> dict[str, float]:
        """Runs `validation_step` over `data`; returns exact metrics over every example."""
        return self._eval_entry(module, data, ckpt_path, "validate", "validation_step", "val",
                                self._config.limit_val_batches)

    def test(self, module: TrainModule, data: Iterable, ckpt_path: str | None = None
             ) -> dict[str, float]:
        """Runs `test_step` over `data`; returns exact metrics over every example."""
        return self._eval_entry(module, data, ckpt_path, "test", "test_step", "test", None)

    def _load_for_eval(self, module: TrainModule, ckpt_path: str | None) -> None:
        if ckpt_path is not None:
            from jaxlight._checkpoint import load_checkpoint

            load_checkpoint(ckpt_path, module, strategy=self.strategy, fit=self)
            self._session.state = None

    def _eval_entry(self, module, data, ckpt_path, stage, method, prefix, limit):
        self._setup(module, stage)
        self._call("setup", stage)
        try:
            self._load_for_eval(module, ckpt_path)
            start, end = (("on_validation_start", "on_validation_end") if prefix == "val"
                          else ("on_test_start", "on_test_end"))
            self._call(start)
            metrics = self._evaluator.evaluate(data, method, prefix, limit, f"Fit.{stage}",
                                               f"the data passed to Fit.{stage}")
            self._log.callback_metrics.update(metrics)
            self.log_metrics(metrics, self._position.global_step)
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
            self._load_for_eval(module, ckpt_path)
            self._call("on_predict_start")
            outputs = self._evaluator.predict(data)
            self._call("on_predict_end")
            return outputs
        except BaseException as exc:
            self._call("on_exception", exc)
            raise
        finally:
            self._call("teardown", "predict")

    # -- transitional private names (removed once checkpoint/callbacks/tests use the above) ------

    _module = property(lambda self: self._session.module)
    _spec = property(lambda self: self._session.spec)
    _shardings = property(lambda self: self._session.shardings)
    _tx = property(lambda self: self._session.optimizer)
    _compiled = property(lambda self: self._session._compiled)
    _stop_reason = property(lambda self: self._position.stop_reason)
    _preemption = property(lambda self: self._call.preemption)

    def _limit(self, limit, data):
        return batch_limit(limit, data)

    def _val_every(self, train_data):
        return validation_interval(self._config, train_data)

    def _get_state(self):
        return self._session.state

    def _set_state(self, state):
        self._session.state = state

    _state = property(_get_state, _set_state)
    _global_step = property(lambda self: self._position.global_step,
                            lambda self, v: setattr(self._position, "global_step", v))
    _epoch = property(lambda self: self._position.epoch,
                      lambda self, v: setattr(self._position, "epoch", v))
    _batch_idx = property(lambda self: self._position.batch_idx,
                          lambda self, v: setattr(self._position, "batch_idx", v))
