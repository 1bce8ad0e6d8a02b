"""SpikeDetection: Lightning's loss-spike stop, reading each loss when its step is done."""

from __future__ import annotations

import collections
import json
import math
import os
from typing import Any

import jax
import numpy as np

from jaxlight._errors import ConfigurationError, TrainingSpikeException
from jaxlight.callbacks._base import Callback

__all__ = ["SpikeDetection", "TrainingSpikeException"]


class SpikeDetection(Callback):
    """Stops training with `TrainingSpikeException` when the loss spikes, as Lightning's.

    A batch's loss is a spike when it is not an improvement over the previous loss and it
    differs from the running mean of the last `window` (non-spike) losses by at least `atol`
    and by at least `rtol` times that mean (each test off when None); with `finite_only`, a
    NaN or infinite loss is a spike too. Batches with an index below `warmup` (within their
    epoch, as Lightning counts) are never spikes. On a spike the batch and the one before are
    written to `exclude_batches_path` (default `<default_root_dir>/skip_batches.json`) and the
    exception is raised.

    A loss is read when its step has finished anyway: at the next batch's end (the loop already
    waits for that step before dispatching another), so no step waits for the host. The
    exception therefore comes one step later than Lightning's, after the next step's update
    (docs/porting.md); the batch it names is the same.

    Args:
        mode: "min" (the loss should fall) or "max".
        window: how many past losses the running mean averages.
        warmup: the first batch index (per epoch) that is checked.
        atol, rtol: absolute and relative tolerances (None: not checked).
        exclude_batches_path: a folder or a .json file for the excluded batch indices.
        finite_only: True: non-finite losses are spikes; False: they are ignored.

    Example:
        >>> from jaxlight import callbacks
        >>> spike = callbacks.SpikeDetection(window=10, rtol=2.0)
    """

    def __init__(self, mode: str = "min", window: int = 10, warmup: int = 1,
                 atol: float | None = None, rtol: float | None = 2.0,
                 exclude_batches_path: str | os.PathLike | None = None,
                 finite_only: bool = True):
        if mode not in ("min", "max"):
            raise ConfigurationError(f"SpikeDetection(mode={mode!r}): 'min' or 'max'.")
        if window < 1:
            raise ConfigurationError(f"SpikeDetection(window={window}) must be at least 1.")
        self.mode, self.window, self.warmup = mode, int(window), int(warmup)
        self.atol, self.rtol = atol, rtol
        self.exclude_batches_path = (None if exclude_batches_path is None
                                     else os.fspath(exclude_batches_path))
        self.finite_only = finite_only
        self.bad_batches: list[int] = []
        self.last_val = 0.0
        self._values: collections.deque = collections.deque(maxlen=self.window)
        self._pending: tuple[Any, int] | None = None

    # -- the test (Lightning's) ------------------------------------------------------------------

    def _running_mean(self) -> float:
        return float(np.mean(self._values)) if self._values else math.nan

    def _is_spike(self, loss: float) -> bool:
        running = self._running_mean()
        diff = loss - self.last_val
        if self.finite_only and not math.isfinite(loss):
            return True
        if (diff <= 0.0) if self.mode == "min" else (diff >= 0.0):
            return False
        atol_ok = self.atol is None or abs(loss - running) >= abs(self.atol)
        rtol_ok = self.rtol is None or abs(loss - running) >= abs(self.rtol * running)
        return atol_ok and rtol_ok

    def _check(self, fit, loss: float, batch_idx: int) -> None:
        if batch_idx >= self.warmup and self._is_spike(loss):
            self._handle_spike(fit, batch_idx)
        elif self.finite_only or math.isfinite(loss):
            self._values.append(loss)
            self.last_val = loss

    def _handle_spike(self, fit, batch_idx: int) -> None:
        self.bad_batches.extend([batch_idx - 1, batch_idx])
        path = self.exclude_batches_path or fit.log_dir
        if not path.endswith(".json"):
            path = os.path.join(path, "skip_batches.json")
        self.exclude_batches_path = path
        if fit.is_global_zero:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(self.bad_batches, f, indent=4)
        raise TrainingSpikeException(batch_idx=batch_idx)

    # -- hooks -----------------------------------------------------------------------------------

    def _flush(self, fit) -> None:
        if self._pending is not None:
            loss, batch_idx = self._pending
            self._pending = None
            self._check(fit, float(np.ravel(jax.device_get(loss))[0]), batch_idx)

    def on_train_start(self, fit, module) -> None:
        self._pending = None

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx: int) -> None:
        # The previous step is done (or nearly): the loop waits for it before the next one.
        self._flush(fit)
        self._pending = (outputs["loss"], batch_idx)

    def on_train_epoch_end(self, fit, module) -> None:
        self._flush(fit)

    def on_train_end(self, fit, module) -> None:
        self._flush(fit)

    def state_dict(self) -> dict[str, Any]:
        return {"last_val": self.last_val, "bad_batches": list(self.bad_batches),
                "values": list(self._values), "bad_batches_path": self.exclude_batches_path}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_val = float(state["last_val"])
        self.bad_batches = list(state["bad_batches"])
        self._values = collections.deque(state["values"], maxlen=self.window)
        self.exclude_batches_path = state.get("bad_batches_path", self.exclude_batches_path)
