"""FitView: the read-only face of a `Fit` that callbacks and module hooks read.

Settings (from the frozen `FitConfig`), the loop position, the data of the current fit, the
session (spec, shardings, state) and the compile counts; nothing here changes the fit. `Fit`
inherits it; the names are documented in docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxlight import strategies as _strategies
from jaxlight._fit._config import validates_after_step, validation_interval
from jaxlight._fit._resume import checkpoint_locations
from jaxlight._fit._session import Session
from jaxlight.callbacks._accumulation import batches_per_step
from jaxlight.checkpoint._paths import CheckpointLocation
from jaxlight.data._feed import TrainFeed
from jaxlight.state._state import TrainState


class FitView:
    """Read-only properties of `Fit` (which sets `_config`, `_session`, `_position`, `_log`,
    `_train_data`, `_val_data`, `_feed` and `_datamodule`)."""

    # -- settings (read-only) ------------------------------------------------------------------

    #: Lightning's: -1 when not given (no step limit).
    max_steps = property(lambda self: -1 if self._config.max_steps is None
                         else self._config.max_steps)
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
    def datamodule(self):
        """The `jaxlight.DataModule` of the current (or last) stage; None when loaders were
        given directly."""
        return self._datamodule

    @property
    def val_every_n_steps(self) -> int | None:
        """Training steps between validations during fit (None: at epoch ends)."""
        return None if self._train_data is None else validation_interval(self._config,
                                                                         self._train_data)

    @property
    def validates_after_step(self) -> bool:
        """Whether the loop validates right after the step just taken (`val_check_interval`;
        False when it validates only at epoch ends)."""
        if self._val_data is None or self._config.val_check_interval is None:
            return False
        try:
            every = self.val_every_n_steps
        except Exception:  # noqa: BLE001 - no len(): the loop could not validate by fraction
            return False
        pos = self._position
        taken = batches_per_step(self.callbacks)
        return validates_after_step(self._config, every, pos.global_step, pos.epoch,
                                    pos.batch_idx, taken)

    @property
    def checkpoint_locations(self) -> list[CheckpointLocation]:
        """Where checkpoints go (each ModelCheckpoint's dirpath, else the default directory)."""
        return checkpoint_locations(self)

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
