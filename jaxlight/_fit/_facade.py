"""Fit: the facade users call — fit / validate / test / predict / plan, and read-only loop state.

`Fit` wires named parts together and holds no loop logic itself: `FitConfig` (settings),
`Session` (spec, shardings, optimizer, state, compiled steps), `LoopState` (position, stop),
`TrainLoop`, `Evaluator`, `Hooks`/`MetricLog` (dispatch, `on_log`); docs/architecture.md.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from jaxlight import distributed as _distributed
from jaxlight import strategies as _strategies
from jaxlight._errors import ConfigurationError
from jaxlight._fit import _cache, _plan
from jaxlight._fit._config import FitConfig, epoch_length
from jaxlight._fit._data_source import DataSource, refuse_keywords
from jaxlight._fit._evaluation import Evaluator
from jaxlight._fit._hooks import Hooks, MetricLog, assemble_callbacks, loggers_into_callbacks
from jaxlight._fit._loop_state import LoopState
from jaxlight._fit._preemption import PreemptionHandler
from jaxlight._fit._resume import adopt_checkpoint
from jaxlight._fit._session import Session, abstract_global_batch
from jaxlight._fit._train_loop import TrainLoop
from jaxlight._fit._view import FitView
from jaxlight.callbacks._base import Callback
from jaxlight.checkpoint._paths import agreed_checkpoint_root
from jaxlight.checkpoint._restore import load_checkpoint, restore_training
from jaxlight.data._datamodule import DataModule
from jaxlight.data._feed import TrainFeed
from jaxlight.distributed._devices import check_strategy_devices, select_devices
from jaxlight.metrics._host_logs import warn_direct_log
from jaxlight.module._module import TrainModule
from jaxlight.module._porting import check_module, refuse_fit_kwargs


class Fit(FitView):
    """Trains a `TrainModule` with a strategy and callbacks, Lightning's `Trainer` for JAX.

    Args:
        strategy: a `jaxlight.strategies` object or alias (`"auto"`, `"single"`, `"dp"`, ...).
        devices: the devices to use (`jaxlight.distributed._devices`): None / "auto" / -1 for all,
        N for
            the first N of each process, a list of device indices or `jax.Device`s. The
            strategy's mesh spans only these; the rest stay idle.
        max_steps: optimizer steps to take; None (or -1, Lightning's) means "until
            max_epochs", and `fit.max_steps` reads -1 then, as Lightning's.
        max_epochs: passes over the training data; None means "until max_steps".
        max_time: shortcut for `callbacks.Timer(duration=max_time, interval="step")`: stop
            after this long ("DD:HH:MM:SS", a `datetime.timedelta` or a dict such as
            {"hours": 2}), checked after every training batch, as Lightning's.
        callbacks: `jaxlight.callbacks` objects (host hooks and step transforms).
        precision: shortcut for `callbacks.MixedPrecision(precision)`.
        accumulate_grad_batches: shortcut for `callbacks.GradientAccumulation(k)` when k > 1.
        gradient_clip_val, gradient_clip_algorithm: shortcut for `callbacks.GradientClipping`.
        val_check_interval: validate every this many training steps (int), or this fraction of
            an epoch (float); None validates at the end of every `check_val_every_n_epoch` epoch.
            As in Lightning, an int longer than the epoch is refused unless
            `check_val_every_n_epoch=None` (then it counts steps across epochs).
        check_val_every_n_epoch: epochs between end-of-epoch validations.
        limit_train_batches, limit_val_batches: batches per epoch (int) or fraction (float);
            `limit_val_batches=0` turns validation off (Lightning's meaning).
        num_sanity_val_steps: validation batches run before training (-1: all, 0: none), as
            in Lightning: an error in `validation_step` or in the validation data shows before
            the first training step, not at the first validation. The step compiled for it is
            the one validation reuses; its metrics are not logged; callbacks get
            `on_sanity_check_start` / `on_sanity_check_end` and no validation hook.
        log_every_n_steps: how often training metrics reach loggers (the only host reads).
        enable_progress_bar: add a `TQDMProgressBar` unless one is given.
        enable_model_summary: add a `ModelSummary` unless one is given.
        enable_checkpointing: as in Lightning, add a `ModelCheckpoint()` unless one is given: it
            saves at the end of every epoch (and, jaxlight's resumable default, when training
            ends) into `<default_root_dir>/checkpoints`, keeping the newest, so that
            `test(ckpt_path="best")` and `fit(ckpt_path="last")` find it. False saves nothing
            (and refuses a `ModelCheckpoint` in `callbacks`, as Lightning does).
        logger: add a `CSVLogger` under `default_root_dir` unless a logger is given; or
            Lightning's form, a logger (or a list of them) to add to the callbacks.
        default_root_dir: where default loggers and checkpoints write.
        seed: seeds parameter initialization and every `nnx.Rngs` stream.
        fast_dev_run: run 1 (or n) training and validation batches, no loggers; for smoke tests.
        prefetch_batches: training batches read and transferred to the devices, in their input
            sharding, while the current step runs (a background thread); 0 reads each batch
            when the loop needs it. None (the default): 2, or 0 for batches already in memory
            (an `ArrayLoader` or `DataLoader`, a list of batches), read faster than a thread
            hands them over.
        compilation_cache: where compiled steps persist across runs (`jaxlight._fit._cache`): None
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
        max_time: Any = None,
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
        enable_checkpointing: bool | None = None,
        logger: bool | Callback | Sequence[Callback] = True,
        default_root_dir: str | os.PathLike = "jaxlight_logs",
        seed: int = 0,
        fast_dev_run: bool | int = False,
        prefetch_batches: int | None = None,
        compilation_cache: str | os.PathLike | bool | None = None,
        **unknown: Any,
    ):
        if unknown:  # Lightning Trainer arguments get the jaxlight form; typos a did-you-mean
            refuse_fit_kwargs(unknown, _arguments(Fit.__init__))
        callbacks, logger = loggers_into_callbacks(logger, callbacks)
        # Join a launched multi-process job (jaxlight launch, torchrun, SLURM, ...) before
        # anything starts JAX's backend; a no-op for one process or when already joined.
        _distributed.initialize()
        #: The persistent compilation cache directory in use (None: off).
        self.compilation_cache_dir = _cache.configure(compilation_cache)
        resolved = _strategies.resolve(strategy)
        chosen = select_devices(devices)
        check_strategy_devices(resolved, chosen)
        self._config = FitConfig.create(
            max_steps=max_steps, max_epochs=max_epochs, max_time=max_time, precision=precision,
            accumulate_grad_batches=accumulate_grad_batches,
            gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm,
            val_check_interval=val_check_interval,
            check_val_every_n_epoch=check_val_every_n_epoch,
            limit_train_batches=limit_train_batches, limit_val_batches=limit_val_batches,
            num_sanity_val_steps=num_sanity_val_steps,
            log_every_n_steps=log_every_n_steps, enable_progress_bar=enable_progress_bar,
            enable_model_summary=enable_model_summary,
            enable_checkpointing=enable_checkpointing, logger=logger,
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
        #: SIGTERM/SIGUSR1 during fit: checkpoint after the step, then exit (not a callback).
        self._preemption = PreemptionHandler()
        self._log = MetricLog(self._call)
        self._evaluator = Evaluator(self._config, self._session, self._position, self._call,
                                    self._log)
        self._train_data = None
        self._val_data = None
        self._feed: TrainFeed | None = None
        self._datamodule: DataModule | None = None
        self._checkpoint_root: str | None = None  # process 0's, set per stage (default_dirpath)

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
        if step is None:
            warn_direct_log(self._position.global_step)  # from a module's batch hook
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
        self._call.module = module
        module.attach_trainer(self)  # self.trainer, self.global_step, ... in module hooks
        self._session.setup(module, stage)
        self._checkpoint_root = agreed_checkpoint_root(self.default_root_dir)

    def plan(self, module: TrainModule, example_batch: Any, *, verbose: bool = True):
        """Compiles the training step for `example_batch` without running it; reports costs.

        Returns a `jaxlight._fit._plan.Plan`: per parameter shape, spec and bytes per device; per
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
        train_data: Iterable | DataModule | None = None,
        val_data: Iterable | None = None,
        ckpt_path: str | None = None,
        *,
        datamodule: DataModule | None = None,
        **unknown: Any,
    ) -> TrainModule:
        """Trains `module` on `train_data` (and validates on `val_data`), or on a
        `jaxlight.DataModule`'s loaders (`datamodule=`, or in `train_data`'s place); afterwards
        `module.model` holds the trained `nnx.Module`."""
        train_data = _alias("fit", unknown, "train_dataloaders", "train_data", train_data)
        val_data = _alias("fit", unknown, "val_dataloaders", "val_data", val_data)
        if unknown:
            refuse_keywords("fit", unknown, _arguments(Fit.fit))
        self._config.require_length()
        source = DataSource.resolve("fit", train_data, datamodule, val_data, module)
        self._setup(module, "fit")
        self._datamodule = source.datamodule
        self._train_data = self._val_data = self._feed = None
        self._position.start(multi_process=jax.process_count() > 1)
        self._session.state = None
        self._position.move_to(0, 0, 0)
        module.attach_model_source(lambda: self._session.live_model(fresh=True))
        source.prepare()
        self._call("setup", "fit")
        self._preemption.install()
        try:
            restored = None
            if ckpt_path is not None:
                self._session.choose_layout(None)  # restoring needs the layout before any batch
                restored = restore_training(self._session, ckpt_path, fit=self)
            source.restore(None if restored is None else restored.meta)
            config = self._config
            train_data, val_data = source.loaders(
                val_first=config.num_sanity_val_steps != 0 and not config.validation_off)
            if self._config.validation_off:
                val_data = None
            self._session.check_schedule_data(val_data)
            self._train_data, self._val_data = train_data, val_data
            self._feed = TrainFeed(train_data)
            if restored is not None:  # None: ckpt_path="last" and nothing saved yet
                adopt_checkpoint(restored, self, self._session, self._position, self._feed,
                                 epoch_length(self._config, train_data), self._call)
            self._call("on_fit_start")
            TrainLoop(self._config, self._session, self._position, self._call, self._log,
                      self._evaluator, self._feed,
                      lambda: self._preemption.after_step(self, module)).run(train_data, val_data)
            self._call("on_fit_end")
        except BaseException as exc:
            self._call("on_exception", exc)
            raise
        finally:
            try:
                if self._session.state is not None:
                    module.model = self._session.model(self._session.state)
                source.teardown()
                self._call("teardown", "fit")
            finally:
                self._preemption.restore()
                module.attach_model_source(None)
        return module

    # -- evaluation and prediction -------------------------------------------------------------

    def validate(self, module: TrainModule | None = None,
                 data: Iterable | DataModule | None = None,
                 ckpt_path: str | None = None, *, datamodule: DataModule | None = None,
                 **unknown: Any) -> dict[str, float]:
        """Runs `validation_step` over `data` (or `datamodule.val_dataloader()`); returns exact
        metrics over every example.

        As Lightning's `trainer.validate(model, dataloaders, ckpt_path, datamodule=)`: `module`
        may be left out after a fit (the fit's module), and `dataloaders=` is `data`'s
        Lightning name; the same holds for `test` and `predict`."""
        if self._config.validation_off:  # as Lightning: setup and teardown only, no metrics
            return self._stage(module, "validate", ckpt_path, None, None, lambda d: {}, data,
                               datamodule, unknown)

        def run(d):  # the epoch hooks inside the stage's start/end, as Lightning's validate
            self._call("on_validation_epoch_start")
            metrics = self._metrics(d, "validation_step", "val", self._config.limit_val_batches,
                                    "validate")
            self._call("on_validation_epoch_end")
            return metrics

        return self._stage(module, "validate", ckpt_path, "on_validation_start",
                           "on_validation_end", run, data, datamodule, unknown)

    def test(self, module: TrainModule | None = None, data: Iterable | DataModule | None = None,
             ckpt_path: str | None = None, *, datamodule: DataModule | None = None,
             **unknown: Any) -> dict[str, float]:
        """Runs `test_step` over `data` (or `datamodule.test_dataloader()`); returns exact
        metrics over every example. `ckpt_path="best"`: the best checkpoint of this fit's
        ModelCheckpoint."""
        return self._stage(module, "test", ckpt_path, "on_test_start", "on_test_end",
                           lambda d: self._metrics(d, "test_step", "test", None, "test"),
                           data, datamodule, unknown)

    def predict(self, module: TrainModule | None = None,
                data: Iterable | DataModule | None = None,
                ckpt_path: str | None = None, *, datamodule: DataModule | None = None,
                **unknown: Any) -> list[Any]:
        """Runs `predict_step` over `data` (or `datamodule.predict_dataloader()`); returns one
        NumPy pytree per batch (padding cut)."""
        return self._stage(module, "predict", ckpt_path, "on_predict_start", "on_predict_end",
                           self._evaluator.predict, data, datamodule, unknown)

    def _metrics(self, data, method: str, prefix: str, limit, stage: str) -> dict[str, float]:
        metrics = self._evaluator.evaluate(data, method, prefix, limit, f"Fit.{stage}",
                                           f"the data passed to Fit.{stage}")
        self._log.callback_metrics.update(metrics)
        self._log.log(metrics, self._position.global_step, self._session.logger_hidden)
        return metrics

    def _stage(self, module, stage: str, ckpt_path, start: str, end: str, run, data,
               datamodule, unknown):
        """validate/test/predict: set-up, the checkpoint, start hook, `run(data)`, end hook."""
        data = _alias(stage, unknown, "dataloaders", "data", data)
        if unknown:
            refuse_keywords(stage, unknown, _arguments(getattr(Fit, stage)))
        if module is None:  # Lightning's trainer.test(dataloaders=...) after trainer.fit(model)
            module = self._call.module
            if module is None:
                raise ConfigurationError(
                    f"Fit.{stage}() got no module, and this Fit has run none: pass it, "
                    f"Fit.{stage}(module, data) (Lightning's trainer.{stage}(model, "
                    "dataloaders)).")
        source = DataSource.resolve(stage, data, datamodule, module=module)
        self._setup(module, stage)
        self._datamodule = source.datamodule
        module.attach_model_source(lambda: self._session.live_model(fresh=False))
        source.prepare()
        self._call("setup", stage)
        try:
            if ckpt_path is not None:
                load_checkpoint(ckpt_path, module, strategy=self.strategy, fit=self)
                self._session.state = None
            (data,) = source.loaders()
            if start is not None:
                self._call(start)
            out = run(data)
            if end is not None:
                self._call(end)
            return out
        except BaseException as exc:
            self._call("on_exception", exc)
            raise
        finally:
            try:
                source.teardown()
                self._call("teardown", stage)
            finally:
                module.attach_model_source(None)


def _alias(stage: str, unknown: dict[str, Any], lightning: str, ours: str, value: Any) -> Any:
    """`value`, or the one given under Lightning's keyword `lightning` (taken from `unknown`)."""
    if lightning not in unknown:
        return value
    given = unknown.pop(lightning)
    if value is not None:
        raise ConfigurationError(
            f"Fit.{stage} got both {ours}= and {lightning}= (Lightning's name for the same "
            "argument): pass one.")
    return given


def _arguments(method) -> list[str]:
    """The parameter names of a `Fit` stage method, for messages."""
    return [n for n in inspect.signature(method).parameters if n not in ("self", "unknown")]
