"""EarlyStopping: stop when a monitored metric stops improving (or stops being finite)."""

from __future__ import annotations

import math
from typing import Any

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.callbacks._base import Callback


class EarlyStopping(Callback):
    """Stops training when `monitor` has not improved for `patience` checks.

    The check runs after every validation during `fit` when `monitor` is a validation metric
    (`val_<name>`), else at the end of every training epoch on the latest logged training
    metrics; `check_on_train_epoch_end=True` / `False` chooses the epoch's end / the end of each
    validation explicitly (Lightning's argument). An improvement is a value better than the
    best so far by more than `min_delta`. With `check_finite`, a NaN or infinite value stops
    training at once; so does a value better than `stopping_threshold` (the goal is reached)
    or worse than `divergence_threshold`, checked in that order before the improvement, as in
    Lightning.

    The decision is the same on every process: the metrics it reads are global (reduced on
    device, then copied whole to every host), so every process computes the same decision from
    the same bits; and `Fit` adopts a stop requested on any process on all of them at the same
    step (`jaxlight.distributed.agree_stop`, at the agreement point right after the check), so
    no process can be left waiting in the next step's collectives.

    The wait counter and best value are saved in checkpoints and restored on resume.

    Args:
        monitor: the metric name, for example "val_loss" or "loss".
        patience: checks without improvement before stopping.
        mode: "min" or "max": which values are better.
        min_delta: the smallest change that counts as an improvement.
        check_finite: stop when the monitored value is NaN or infinite.
        stopping_threshold: stop as soon as the value is better than this (below it in "min"
            mode, above it in "max").
        divergence_threshold: stop as soon as the value is worse than this (above it in "min"
            mode, below it in "max").
        check_on_train_epoch_end: check at the end of each training epoch (True) or after each
            validation (False); None: after validation for a `val_` metric, else at epoch ends.

    Example:
        >>> from jaxlight import callbacks
        >>> stop = callbacks.EarlyStopping("val_loss", patience=3, min_delta=1e-3)
    """

    def __init__(self, monitor: str, patience: int = 3, mode: str = "min",
                 min_delta: float = 0.0, check_finite: bool = True,
                 stopping_threshold: float | None = None,
                 divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None):
        if mode not in ("min", "max"):
            raise ConfigurationError(f"EarlyStopping(mode={mode!r}): mode is 'min' or 'max'.")
        if not isinstance(patience, int) or patience < 1:
            raise ConfigurationError(
                f"EarlyStopping(patience={patience!r}): give a positive number of checks.")
        if min_delta < 0:
            raise ConfigurationError(
                f"EarlyStopping(min_delta={min_delta}): give a non-negative amount; the mode "
                "says which direction is better.")
        for name, value in (("stopping_threshold", stopping_threshold),
                            ("divergence_threshold", divergence_threshold)):
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, int | float)):
                raise ConfigurationError(
                    f"EarlyStopping({name}={value!r}): give a number (a value of the monitored "
                    "metric) or None.")
        if check_on_train_epoch_end not in (None, True, False):
            raise ConfigurationError(
                f"EarlyStopping(check_on_train_epoch_end={check_on_train_epoch_end!r}): give "
                "True (check at each training epoch's end), False (after each validation) or "
                "None (after validation for a val_ metric, else at epoch ends).")
        self.monitor = monitor
        self.patience = patience
        self.stopping_threshold = (None if stopping_threshold is None
                                   else float(stopping_threshold))
        self.divergence_threshold = (None if divergence_threshold is None
                                     else float(divergence_threshold))
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.mode = mode
        self.min_delta = float(min_delta)
        self.check_finite = check_finite
        self.best_score: float | None = None
        self.wait_count = 0
        self.stopped_step: int | None = None
        #: Lightning's: the epoch during which training was stopped, 0 if it was not.
        self.stopped_epoch = 0
        self.stop_reason: str | None = None
        self._stage: str | None = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor!r}}}"

    def state_dict(self) -> dict[str, Any]:
        return {"best_score": self.best_score, "wait_count": self.wait_count,
                "patience": self.patience, "stopped_step": self.stopped_step,
                "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best_score = state.get("best_score")
        self.wait_count = int(state.get("wait_count", 0))
        self.stopped_step = state.get("stopped_step")
        self.stopped_epoch = int(state.get("stopped_epoch", 0))

    def setup(self, fit, module, stage: str) -> None:
        self._stage = stage

    def on_train_start(self, fit, module) -> None:
        if self.monitor.startswith("val_") and fit.val_data is None:
            raise ConfigurationError(
                f"EarlyStopping(monitor={self.monitor!r}) watches a validation metric, but "
                "Fit.fit got no val_data. Pass val_data or monitor a training metric."
            )

    def _on_epoch_end(self) -> bool:
        """Whether the check runs at training epochs' ends (else after validations)."""
        if self.check_on_train_epoch_end is None:
            return not self.monitor.startswith("val_")
        return self.check_on_train_epoch_end

    def on_validation_end(self, fit, module) -> None:
        if self._stage == "fit" and not self._on_epoch_end():
            self._check(fit)

    def on_train_epoch_end(self, fit, module) -> None:
        if self._on_epoch_end():
            self._check(fit)

    def _beyond(self, value: float, threshold: float | None, better: bool) -> bool:
        """Whether `value` is strictly better (or, `better=False`, worse) than `threshold`."""
        if threshold is None:
            return False
        if (self.mode == "min") == better:
            return value < threshold
        return value > threshold

    def _improved(self, value: float) -> bool:
        if self.best_score is None:
            return True
        if self.mode == "min":
            return value < self.best_score - self.min_delta
        return value > self.best_score + self.min_delta

    def _decide(self, value: float) -> str | None:
        """Updates the counters; returns why to stop, or None."""
        if not math.isfinite(value):
            if self.check_finite:
                return (f"EarlyStopping: {self.monitor} = {value} is not finite; best was "
                        f"{self.best_score}.")
            self.wait_count += 1
        elif self._beyond(value, self.stopping_threshold, better=True):
            return (f"EarlyStopping: {self.monitor} = {value} reached stopping_threshold="
                    f"{self.stopping_threshold}.")
        elif self._beyond(value, self.divergence_threshold, better=False):
            return (f"EarlyStopping: {self.monitor} = {value} crossed divergence_threshold="
                    f"{self.divergence_threshold}; best was {self.best_score}.")
        elif self._improved(value):
            self.best_score, self.wait_count = value, 0
            return None
        else:
            self.wait_count += 1
        if self.wait_count >= self.patience:
            return (f"EarlyStopping: {self.monitor} did not improve by more than "
                    f"{self.min_delta} for {self.wait_count} checks (best {self.best_score}, "
                    f"now {value}).")
        return None

    def check_validation_monitor(self, names: list[str], when: str) -> None:
        """Refuses a validation-metric monitor (`val_...`) that validation does not produce
        (`names`). The sanity check calls it, so a misspelt name shows before the first
        training step (Lightning, which skips its check during the sanity check, reports it
        after the first epoch's validation)."""
        if not self.monitor.startswith("val_") or self.monitor in names:
            return
        raise ConfigurationError(
            f"EarlyStopping(monitor={self.monitor!r}) watches a validation metric that "
            f"validation does not produce{when}. Validation metrics: {sorted(names)}."
            f"{suggest(self.monitor, list(names))} Fix monitor, or log the metric from "
            "validation_step (a returned 'name' is logged as 'val_name').")

    def _check(self, fit) -> None:
        metrics = fit.callback_metrics
        if self.monitor not in metrics:
            logged = sorted(k for k in metrics if k != "epoch")
            raise ConfigurationError(
                f"EarlyStopping(monitor={self.monitor!r}): no metric of that name was logged. "
                f"Logged metrics: {logged}.{suggest(self.monitor, logged)} Validation metrics "
                "are named 'val_<name>'."
            )
        reason = self._decide(float(metrics[self.monitor]))
        if reason is not None:
            self.stopped_step = fit.global_step
            self.stopped_epoch = fit.current_epoch
            self.stop_reason = reason
            fit.request_stop(reason)
