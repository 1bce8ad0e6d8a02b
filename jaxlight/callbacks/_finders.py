"""Lightning's tuner for a `Fit` (`Tuner`): `lr_find` runs the learning-rate sweep
(`_lr_finder.py`), `scale_batch_size` the batch-size search (`_batch_size_finder.py`).
"""

from __future__ import annotations

import warnings

from jaxlight._errors import ConfigurationError, JaxlightWarning
from jaxlight.callbacks._batch_size_finder import run_scale_batch_size
from jaxlight.callbacks._lr_finder import LRFinder, run_lr_find

__all__ = ["Tuner"]


class Tuner:
    """Lightning's `Tuner(trainer)` for a `Fit`: `lr_find` and `scale_batch_size`.

    Example:
        >>> import jaxlight as jl
        >>> tuner = jl.Tuner(jl.Fit("single", max_epochs=1, enable_progress_bar=False))
    """

    def __init__(self, fit):
        self._fit = fit

    def lr_find(self, model, train_dataloaders=None, val_dataloaders=None, dataloaders=None,
                datamodule=None, method: str = "fit", min_lr: float = 1e-8, max_lr: float = 1,
                num_training: int = 100, mode: str = "exponential",
                early_stop_threshold: float | None = 4.0, update_attr: bool = True,
                attr_name: str = "") -> LRFinder | None:
        """Sweeps the learning rate from `min_lr` to `max_lr` over `num_training` steps
        (Lightning's arguments and meaning); returns an `LRFinder` (`results`, `suggestion()`,
        `plot()`), and with `update_attr` sets the module's `lr` (or `learning_rate`, or
        `attr_name`) to the suggestion. Validation data is not used by the sweep."""
        if method != "fit":
            raise ConfigurationError(
                f"Tuner.lr_find(method={method!r}): the learning-rate finder only works with "
                "method='fit' (as Lightning's).")
        data = train_dataloaders if train_dataloaders is not None else dataloaders
        return run_lr_find(self._fit, model, data, datamodule, min_lr=min_lr, max_lr=max_lr,
                           num_training=num_training, mode=mode,
                           early_stop_threshold=early_stop_threshold, update_attr=update_attr,
                           attr_name=attr_name)

    def scale_batch_size(self, model, train_dataloaders=None, val_dataloaders=None,
                         dataloaders=None, datamodule=None, method: str = "fit",
                         mode: str = "power", steps_per_trial: int = 3, init_val: int = 2,
                         max_trials: int = 25, batch_arg_name: str = "batch_size",
                         margin: float = 0.05, max_val: int = 8192, *,
                         memory_limit: int | None = None) -> int | None:
        """The largest batch size (Lightning's search, `mode` "power" or "binsearch") whose
        compiled training step fits in a device's memory, read from the step's memory
        analysis (`memory_limit`: bytes per device, default the device's limit); sets
        `batch_arg_name` on each of the module, the datamodule and their hparams that has it
        (as Lightning), and returns it.
        `steps_per_trial` is accepted for Lightning's signature: no step runs."""
        if method != "fit":
            raise ConfigurationError(
                f"Tuner.scale_batch_size(method={method!r}): jaxlight measures the training "
                "step only; use method='fit'.")
        if self._fit.fast_dev_run:
            warnings.warn("Skipping the batch-size finder since fast_dev_run is on.",
                          JaxlightWarning, stacklevel=2)
            return None
        data = train_dataloaders if train_dataloaders is not None else dataloaders
        found, _ = run_scale_batch_size(
            self._fit, model, data, datamodule, mode=mode, init_val=init_val,
            max_trials=max_trials, batch_arg_name=batch_arg_name, margin=margin,
            max_val=max_val, memory_limit=memory_limit)
        return found
