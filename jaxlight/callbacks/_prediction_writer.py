"""BasePredictionWriter: Lightning's hook for writing `Fit.predict` outputs as they come."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxlight._errors import ConfigurationError, MissingMethodError
from jaxlight.callbacks._base import Callback

__all__ = ["BasePredictionWriter"]

_INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """Subclass it and override `write_on_batch_end` and/or `write_on_epoch_end`, as in
    Lightning; `Fit.predict` calls them with each batch's output (NumPy, the global rows) and,
    at the end, with all of them.

    `batch_indices` are the examples' positions in the prediction data (a batch's rows follow
    the previous batch's, as torch's sequential sampler numbers them); `write_on_epoch_end`
    gets them per data loader, `[[indices of batch 0], [indices of batch 1], ...]`, and
    `predictions` as the list of per-batch outputs, as Lightning gives them for one loader.

    Args:
        write_interval: "batch", "epoch" or "batch_and_epoch".

    Example:
        >>> import numpy as np
        >>> from jaxlight import callbacks
        >>> class Saver(callbacks.BasePredictionWriter):
        ...     def write_on_epoch_end(self, fit, module, predictions, batch_indices):
        ...         self.saved = np.concatenate(predictions)
        >>> saver = Saver(write_interval="epoch")
    """

    def __init__(self, write_interval: str = "batch"):
        if write_interval not in _INTERVALS:
            raise ConfigurationError(
                f"BasePredictionWriter(write_interval={write_interval!r}) should be one of "
                f"{list(_INTERVALS)}.")
        self.interval = write_interval
        self._predictions: list[Any] = []
        self._indices: list[list[int]] = []
        self._seen = 0

    def write_on_batch_end(self, fit, module, prediction: Any, batch_indices: list[int] | None,
                           batch: Any, batch_idx: int, dataloader_idx: int) -> None:
        """Override to write one batch's prediction."""
        raise MissingMethodError(
            f"{type(self).__name__}(write_interval={self.interval!r}) needs "
            "write_on_batch_end(self, fit, module, prediction, batch_indices, batch, "
            "batch_idx, dataloader_idx).")

    def write_on_epoch_end(self, fit, module, predictions: list[Any],
                           batch_indices: list[list[list[int]]]) -> None:
        """Override to write all batches' predictions at the end of `Fit.predict`."""
        raise MissingMethodError(
            f"{type(self).__name__}(write_interval={self.interval!r}) needs "
            "write_on_epoch_end(self, fit, module, predictions, batch_indices).")

    def on_predict_start(self, fit, module) -> None:
        self._predictions, self._indices, self._seen = [], [], 0

    def on_predict_batch_end(self, fit, module, outputs, batch, batch_idx) -> None:
        # The global rows (every process gets the whole output): the output's leading
        # dimension, else this process's batch times the processes.
        out = [x for x in jax.tree.leaves(outputs) if np.ndim(x)]
        local = [x for x in jax.tree.leaves(batch) if np.ndim(x)]
        rows = (int(np.shape(out[0])[0]) if out else
                int(np.shape(local[0])[0]) * jax.process_count() if local else 1)
        indices = list(range(self._seen, self._seen + rows))
        self._seen += rows
        if self.interval in ("epoch", "batch_and_epoch"):
            self._predictions.append(outputs)
            self._indices.append(indices)
        if self.interval in ("batch", "batch_and_epoch"):
            self.write_on_batch_end(fit, module, outputs, indices, batch, batch_idx, 0)

    def on_predict_epoch_end(self, fit, module) -> None:
        if self.interval in ("epoch", "batch_and_epoch"):
            predictions, indices = self._predictions, [self._indices]
            self._predictions, self._indices = [], []
            self.write_on_epoch_end(fit, module, predictions, indices)
