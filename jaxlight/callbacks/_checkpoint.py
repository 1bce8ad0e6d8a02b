"""ModelCheckpoint: periodic, best-k and last checkpoints on orbax-checkpoint."""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import jax
import numpy as np

from jaxlight import distributed as _distributed
from jaxlight._errors import ConfigurationError, suggest
from jaxlight.callbacks._base import Callback
from jaxlight.checkpoint._paths import complete_steps, default_dirpath
from jaxlight.checkpoint._writer import CheckpointWriter, join_best


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigurationError(f"ModelCheckpoint({name}={value!r}): give a positive integer or "
                                 "None.")


def _logged(fit) -> list[str]:
    return sorted(k for k in fit.callback_metrics if k != "epoch")


class ModelCheckpoint(Callback):
    """Saves the train state with orbax-checkpoint, asynchronously and sharded.

    What a checkpoint holds: parameters, optimizer state, step, epoch, RNG state (the model's
    RNG variables), the data loader's position, every callback's `state_dict()` and the
    hyperparameters; `docs/checkpoints.md` describes the layout, which plain orbax reads. Each
    process writes its own shards; process 0 coordinates the commit. A save is atomic: orbax
    writes `<step>.orbax-checkpoint-tmp` and renames it when every process has finished, and
    older checkpoints are deleted only after that, so a killed or failed save deletes nothing.

    When it saves: every `every_n_steps` optimizer steps (the state after that step; if a
    validation runs at that step, after it, so the monitored value is fresh), or every
    `every_n_epochs` epochs at the epoch's end (after its validation, as in Lightning); with
    neither, at the end of every epoch. By default (`save_last=None`) the final state is also
    saved when training ends, so that `ckpt_path="last"` resumes where the fit stopped.

    Which it keeps: with `monitor`, the `save_top_k` best by the monitored value: a training
    metric of the saved step itself for `every_n_steps` saves, else the latest value in
    `fit.callback_metrics` (validation metrics are named `val_<name>`). A non-finite value
    never counts as better than a finite one. Without `monitor`, the `save_top_k` latest.
    `save_top_k=-1` keeps all, `0` none but the last. By default the newest checkpoint is always
    kept too (what `ckpt_path="last"` resumes from). `save_last=True` is Lightning's `last.ckpt`
    instead: a step is written only when it joins the best `save_top_k` (with `monitor`), the
    newest such save is `last_model_path`, and the final state is saved at the end only if the
    fit saved nothing. `save_last=False` keeps no newest step and saves nothing at the end.

    Args:
        dirpath: the checkpoint directory (default `<default_root_dir>/checkpoints`).
        every_n_steps: save every this many optimizer steps (Lightning's `every_n_train_steps`,
            accepted too).
        every_n_epochs: save every this many epochs (after the epoch's validation).
        monitor: a metric name in `fit.callback_metrics` ranking the checkpoints.
        mode: "min" or "max": which monitored values are better.
        save_top_k: how many ranked checkpoints to keep (-1: all).
        save_last: None (default): also keep the newest checkpoint and save the final state at
            the end (jaxlight's resumable default); True: Lightning's `last.ckpt` (the newest
            save, written only when it ranks; the final state only if nothing was saved);
            False: neither.
        async_save: write in a background thread while training continues.
        compress: compress the array data with orbax's zstd: about 8% fewer bytes for a
            float32 train state, for about a quarter more CPU time per save (more for
            compressible arrays; restores read either).

    Example:
        >>> from jaxlight import callbacks
        >>> ckpt = callbacks.ModelCheckpoint("ckpt", every_n_steps=100, monitor="val_loss")
    """

    #: Set on the one `Fit` adds by default (`enable_checkpointing=True`): the steps already in
    #: its directory when the fit starts (another run's, sharing `<default_root_dir>`) are
    #: never deleted by its retention, as Lightning's default deletes only what it saved.
    keeps_earlier_steps = False

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = None,
        monitor: str | None = None,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool | None = None,
        async_save: bool = True,
        compress: bool = False,
        every_n_train_steps: int | None = None,
    ):
        if every_n_train_steps is not None:  # Lightning's name for every_n_steps
            if every_n_steps is not None and every_n_steps != every_n_train_steps:
                raise ConfigurationError(
                    f"ModelCheckpoint(every_n_steps={every_n_steps}, every_n_train_steps="
                    f"{every_n_train_steps}): the two are one setting (Lightning's name and "
                    "jaxlight's); give one.")
            every_n_steps = every_n_train_steps
        _positive_or_none("every_n_steps", every_n_steps)
        _positive_or_none("every_n_epochs", every_n_epochs)
        if every_n_steps is not None and every_n_epochs is not None:
            raise ConfigurationError(
                f"ModelCheckpoint(every_n_steps={every_n_steps}, every_n_epochs="
                f"{every_n_epochs}): choose one schedule; use two ModelCheckpoint callbacks with "
                "different dirpaths for both."
            )
        if mode not in ("min", "max"):
            raise ConfigurationError(f"ModelCheckpoint(mode={mode!r}): mode is 'min' or 'max'.")
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise ConfigurationError(
                f"ModelCheckpoint(save_top_k={save_top_k!r}): give -1 (keep all), 0 or a "
                "positive number."
            )
        if save_last not in (None, True, False):
            raise ConfigurationError(
                f"ModelCheckpoint(save_last={save_last!r}): give None (keep the newest step and "
                "save the final state: the default), True (Lightning's last.ckpt) or False.")
        for name, flag in (("async_save", async_save), ("compress", compress)):
            if not isinstance(flag, bool):
                raise ConfigurationError(f"ModelCheckpoint({name}={flag!r}): give True or False.")
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.async_save = async_save
        self.compress = compress
        #: The best monitored value saved so far, its step and step directory.
        self.best_model_score: float | None = None
        self.best_step: int | None = None
        self.best_model_path: str | None = None
        #: The step directory of the newest save, unless `save_last=False` (then None, as
        #: Lightning's is empty).
        self.last_model_path: str | None = None
        #: save_last=True: the best save_top_k saved so far (step -> value), Lightning's rule.
        self._ranked: dict[int, float] = {}
        self._saved_in_fit = False
        self._writer = None
        self._agreed_dirpath: str | None = None
        self._retention = None  # the writer's retention policy (kept after the writer closes)
        self._stage: str | None = None
        self._deferred = False  # a step save waiting for this step's validation

    @property
    def best_k_models(self) -> dict[str, float]:
        """Lightning's `best_k_models`: step directory -> monitored value of the kept best
        `save_top_k` checkpoints (empty without `monitor`), as of the last committed save."""
        if self._retention is None or self.monitor is None:
            return {}
        step_dir = self._retention_dir
        return {step_dir(step): value for step, value in self._retention.best_k.items()}

    def _retention_dir(self, step: int) -> str:
        return os.path.join(self._dirpath_used, str(step))

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint{{dirpath={self.dirpath!r}, monitor={self.monitor!r}}}"

    def resolved_dirpath(self, fit) -> str:
        """The directory saves go to: process 0's, with several processes, as Lightning's
        ModelCheckpoint broadcasts its dirpath (the default is agreed by Fit as each stage
        starts, an explicit dirpath in `setup`)."""
        if self.dirpath is None:
            return default_dirpath(fit)
        if self._agreed_dirpath is not None:
            return self._agreed_dirpath
        return os.path.abspath(self.dirpath)

    # -- state saved in checkpoints -----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"monitor": self.monitor, "mode": self.mode, "best_model_score":
                self.best_model_score, "best_step": self.best_step,
                "best_model_path": self.best_model_path, "last_model_path": self.last_model_path,
                "ranked": {str(k): v for k, v in self._ranked.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("monitor") != self.monitor:
            return  # ranked by another metric: start ranking afresh
        self.best_model_score = state.get("best_model_score")
        self.best_step = state.get("best_step")
        self.best_model_path = state.get("best_model_path")
        self.last_model_path = state.get("last_model_path")
        self._ranked = {int(k): float(v) for k, v in (state.get("ranked") or {}).items()}

    # -- hooks ----------------------------------------------------------------------------------

    def setup(self, fit, module, stage: str) -> None:
        self._stage = stage
        if self._writer is not None:
            return
        if self.dirpath is not None:
            self._agreed_dirpath = _distributed.all_gather_json(
                "checkpoint_dirpath", os.path.abspath(self.dirpath))[0]
        if stage != "fit":
            return
        self._writer = CheckpointWriter(
            self.resolved_dirpath(fit), monitor=self.monitor, mode=self.mode,
            save_top_k=self.save_top_k, save_last=self.save_last is not False,
            async_save=self.async_save,
            compress=self.compress)
        self._retention = self._writer.retention
        self._dirpath_used = self._writer.dirpath
        if self.keeps_earlier_steps:
            self._retention.pinned.update(complete_steps(self._dirpath_used))

    def teardown(self, fit, module, stage: str) -> None:
        if stage == "fit" and self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def on_train_start(self, fit, module) -> None:
        self._deferred = False
        self._saved_in_fit = False
        if (self.monitor is not None and self.monitor.startswith("val_")
                and fit.val_data is None):
            raise ConfigurationError(
                f"ModelCheckpoint(monitor={self.monitor!r}) ranks by a validation metric, but "
                "Fit.fit got no val_data. Pass val_data, or monitor a training metric such as "
                "'loss'."
            )

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx: int) -> None:
        if self._writer is not None:
            self._writer.check_failed()  # a background save's failure shows at the next step
        if self.every_n_steps is None or fit.global_step % self.every_n_steps:
            return
        if fit.validates_after_step:
            self._deferred = True
            return
        current = None
        if self.monitor is not None and self.monitor in getattr(outputs, "metrics", {}):
            # This step's own value. Reading it waits for the step, which the save has to do
            # anyway (it copies the state after this step); the logged value is a step older.
            current = float(np.ravel(jax.device_get(outputs.metrics[self.monitor]))[0])
        self._save(fit, module, current=current)

    def on_validation_end(self, fit, module) -> None:
        if self._stage != "fit":
            return
        if self._deferred:
            self._deferred = False
            self._save(fit, module)

    def on_train_epoch_end(self, fit, module) -> None:
        # The epoch's validation (if one ran) came before this hook, as in Lightning: the
        # monitored value is this epoch's.
        every = self.every_n_epochs
        if every is None and self.every_n_steps is None:
            every = 1
        if every is not None and (fit.current_epoch + 1) % every == 0:
            self._save(fit, module)

    def on_train_end(self, fit, module) -> None:
        if self._deferred:
            self._deferred = False
            self._save(fit, module)
        if self.save_last is None or (self.save_last and not self._saved_in_fit):
            self._save(fit, module, last=True)
        if self.monitor is not None and self.monitor not in fit.callback_metrics:
            self._missing_monitor(fit)
        if self._writer is not None:
            self._writer.wait()

    def on_exception(self, fit, module, exception: BaseException) -> None:
        if self._writer is not None:
            # Let a save already under way commit; the original exception is the one to report.
            with contextlib.suppress(Exception):
                self._writer.wait()

    def check_validation_monitor(self, names: list[str], when: str) -> None:
        """Refuses a validation-metric monitor (`val_...`) that validation does not produce
        (`names`); the sanity check calls it, so a misspelt name shows before training (as
        `EarlyStopping.check_validation_monitor`)."""
        if self.monitor is None or not self.monitor.startswith("val_") or self.monitor in names:
            return
        raise ConfigurationError(
            f"ModelCheckpoint(monitor={self.monitor!r}) ranks by a validation metric that "
            f"validation does not produce{when}. Validation metrics: {sorted(names)}."
            f"{suggest(self.monitor, list(names))} Fix monitor, or log the metric from "
            "validation_step (a returned 'name' is logged as 'val_name').")

    # -- saving ---------------------------------------------------------------------------------

    def _missing_monitor(self, fit) -> None:
        logged = _logged(fit)
        raise ConfigurationError(
            f"ModelCheckpoint(monitor={self.monitor!r}): no metric of that name was logged. "
            f"Logged metrics: {logged}.{suggest(self.monitor, logged)} Validation metrics are "
            "named 'val_<name>'."
        )

    def _monitor_value(self, fit, strict: bool = True) -> float | None:
        if self.monitor is None:
            return None
        metrics = fit.callback_metrics
        if self.monitor in metrics:
            return float(metrics[self.monitor])
        # Training metrics arrive at log intervals and validation metrics after a validation:
        # the monitor is missing for real only once its kind has been logged.
        is_val = self.monitor.startswith("val_")
        seen = any(k.startswith("val_") for k in metrics) if is_val else \
            any(not k.startswith(("val_", "test_")) and k != "epoch" for k in metrics)
        if seen and strict:
            self._missing_monitor(fit)
        return None

    def _save(self, fit, module, *, pin: bool = False, current: float | None = None,
              last: bool = False) -> bool:
        if self._writer is None or fit.state is None:
            return False
        value = current if current is not None else self._monitor_value(fit, strict=not pin)
        finite = value is not None and math.isfinite(value)
        ranks = self.monitor is not None and self.save_top_k != -1 and not pin and not last
        if ranks and not finite and self.save_last is not None:
            return False  # it could never rank (and keep-all is off): do not spend a write
        if ranks and self.save_last and not join_best(
                dict(self._ranked), fit.global_step, value, self.save_top_k, self.mode):
            return False  # Lightning writes (and points last.ckpt at) only a ranking save
        saved = self._writer.save(fit, module, value, pin=pin)
        if saved:
            self._saved_in_fit = True
            if ranks and self.save_last:
                join_best(self._ranked, fit.global_step, value, self.save_top_k, self.mode)
            path = self._writer.step_dir(fit.global_step)
            if self.save_last is not False:  # Lightning's is empty without save_last
                self.last_model_path = path
            if self.monitor is None:  # Lightning: without a monitor, the newest is "best"
                self.best_step, self.best_model_path = fit.global_step, path
            elif finite and (self.best_model_score is None or
                             (value < self.best_model_score if self.mode == "min"
                              else value > self.best_model_score)):
                self.best_model_score, self.best_step, self.best_model_path = \
                    value, fit.global_step, path
        return saved

    def save_now(self, fit, module, *, wait: bool = True, pin: bool = False) -> str:
        """Saves the current state now (unless this step is saved already); returns its path.

        With `wait`, blocks until the checkpoint has committed (preemption). With `pin`, the
        retention policy keeps it until the next run's first save.
        """
        if self._writer is None:
            self.setup(fit, module, "fit")
        step = fit.global_step
        if not self._save(fit, module, pin=pin) and pin:
            self._writer.retention.pinned.add(step)
        if wait:
            self._writer.wait()
        return self._writer.step_dir(step)
