"""Timer: Lightning's time limit on training (`Fit(max_time=...)` adds one)."""

from __future__ import annotations

import datetime
import re
import time
from typing import Any

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback

__all__ = ["Timer", "parse_duration"]

_STAGES = ("train", "validate", "test")


def parse_duration(duration: Any, who: str = "Timer(duration=...)") -> float | None:
    """Seconds from Lightning's forms: "DD:HH:MM:SS", a `datetime.timedelta`, a dict of
    timedelta keywords ({"hours": 2}), or None (no limit)."""
    if duration is None:
        return None
    if isinstance(duration, str):
        match = re.fullmatch(r"(\d+):(\d\d):(\d\d):(\d\d)", duration.strip())
        if not match:
            raise ConfigurationError(
                f"{who}: {duration!r} is not a duration; write DD:HH:MM:SS "
                "(\"00:12:00:00\" is 12 hours), a datetime.timedelta, or a dict such as "
                "{'hours': 12}.")
        d, h, m, s = (int(g) for g in match.groups())
        duration = datetime.timedelta(days=d, hours=h, minutes=m, seconds=s)
    elif isinstance(duration, dict):
        try:
            duration = datetime.timedelta(**duration)
        except TypeError as exc:
            raise ConfigurationError(f"{who}: {duration!r} is not timedelta keywords "
                                     f"(weeks, days, hours, minutes, seconds): {exc}.") from None
    if not isinstance(duration, datetime.timedelta):
        raise ConfigurationError(
            f"{who} takes \"DD:HH:MM:SS\", a datetime.timedelta or a dict; got "
            f"{type(duration).__name__}.")
    return duration.total_seconds()


class Timer(Callback):
    """Stops training once `duration` has elapsed, as Lightning's `Timer`.

    The time counts from `on_train_start` (plus the time of the run a checkpoint resumes:
    it is saved in the checkpoint). It is checked when the fit starts, after every training
    batch (`interval="step"`) or at every epoch's end (`interval="epoch"`); reaching the limit
    requests a stop (`fit.stop_reason` says so). `time_elapsed(stage)`, `time_remaining()`,
    `start_time(stage)` and `end_time(stage)` read the clock for "train", "validate", "test".

    Args:
        duration: "DD:HH:MM:SS", a `datetime.timedelta`, or a dict of its keywords.
        interval: "step" or "epoch".
        verbose: print a line when the limit is reached.

    Example:
        >>> from jaxlight import callbacks
        >>> timer = callbacks.Timer(duration="00:12:00:00")
    """

    def __init__(self, duration: Any = None, interval: str = "step", verbose: bool = True):
        if interval not in ("step", "epoch"):
            raise ConfigurationError(
                f"Timer(interval={interval!r}): choose 'step' or 'epoch'.")
        self._duration = parse_duration(duration)
        self._interval = interval
        self._verbose = verbose
        self._start: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._end: dict[str, float | None] = dict.fromkeys(_STAGES)
        self._offset = 0.0

    @property
    def duration(self) -> float | None:
        """The limit in seconds (None: no limit)."""
        return self._duration

    def start_time(self, stage: str = "train") -> float | None:
        return self._start[self._stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        return self._end[self._stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        stage = self._stage(stage)
        start, end = self._start[stage], self._end[stage]
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return (time.monotonic() if end is None else end) - start + offset

    def time_remaining(self, stage: str = "train") -> float | None:
        return None if self._duration is None else self._duration - self.time_elapsed(stage)

    @staticmethod
    def _stage(stage: str) -> str:
        aliases = {"training": "train", "validating": "validate", "validation": "validate",
                   "testing": "test"}
        stage = aliases.get(stage, stage)
        if stage not in _STAGES:
            raise ConfigurationError(f"Timer: unknown stage {stage!r}; one of {_STAGES}.")
        return stage

    def _mark(self, table: dict, stage: str) -> None:
        table[stage] = time.monotonic()

    def on_train_start(self, fit, module):
        self._mark(self._start, "train")

    def on_train_end(self, fit, module):
        self._mark(self._end, "train")

    def on_validation_start(self, fit, module):
        self._mark(self._start, "validate")

    def on_validation_end(self, fit, module):
        self._mark(self._end, "validate")

    def on_test_start(self, fit, module):
        self._mark(self._start, "test")

    def on_test_end(self, fit, module):
        self._mark(self._end, "test")

    def on_fit_start(self, fit, module):
        if self._duration is not None:
            self._check(fit)

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        if self._interval == "step" and self._duration is not None:
            self._check(fit)

    def on_train_epoch_end(self, fit, module):
        if self._interval == "epoch" and self._duration is not None:
            self._check(fit)

    def _check(self, fit) -> None:
        elapsed = self.time_elapsed("train")
        if elapsed >= self._duration:
            td = datetime.timedelta(seconds=int(elapsed))
            if self._verbose and fit.is_global_zero:
                print(f"Time limit reached. Elapsed time is {td}. Signaling Fit to stop.")
            fit.request_stop(f"Timer: the time limit {datetime.timedelta(seconds=self._duration)}"
                             f" was reached ({td} elapsed)")

    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {s: self.time_elapsed(s) for s in _STAGES}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))

    def __repr__(self) -> str:
        return f"Timer(duration={self._duration}, interval={self._interval!r})"
