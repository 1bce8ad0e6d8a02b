"""Lightning's batch-size finder: the search (`search_batch_size`, `run_scale_batch_size`) and
the callback that sizes a fit's loader with it (`BatchSizeFinder`).

The batch-size search asks the compiled training step's memory analysis whether a batch size
fits in a device's memory, instead of running steps until one runs out; the sequence of tried
sizes is Lightning's (`search_batch_size`).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import numpy as np

from jaxlight._errors import ConfigurationError, DataError, ShardingError
from jaxlight.callbacks._base import Callback

__all__ = ["BatchSizeFinder", "search_batch_size"]


def search_batch_size(fits: Callable[[int], bool], mode: str = "power", init_val: int = 2,
                      max_trials: int = 25, margin: float = 0.05, max_val: int = 8192,
                      dataset_length: int | None = None) -> int:
    """Lightning's `_run_power_scaling` / `_run_binsearch_scaling` with `fits(size)` in place of
    running steps until out of memory: the same sizes tried in the same order, the same answer.

    `power` doubles until a size does not fit (then halves once); `binsearch` doubles, then
    bisects between the last size that fit and the first that did not, and takes `margin` off
    the result. A size at or above `dataset_length` (a batch cannot grow past the data) or at
    `max_val` ends the search; `max_trials` bounds the sizes that fit.
    """
    size = int(init_val)

    def adjust(value: int) -> tuple[int, bool]:
        nonlocal size
        if dataset_length is not None and size >= dataset_length:
            return size, False
        new = min(int(value), max_val)
        changed, size = new != size, new
        return size, changed

    if mode == "power":
        any_success = False
        for i in range(max_trials):
            if size >= max_val:
                break
            if fits(size):
                last = size
                if i + 1 >= max_trials:
                    size = last
                    break
                _, changed = adjust(int(size * 2.0))
                if not changed:
                    break
                any_success = True
            else:
                adjust(int(size * 0.5))
                if any_success:
                    break
        return size
    low, high, count = 1, None, 0
    while True:
        if size >= max_val:
            break
        if fits(size):
            last = size
            count += 1
            if count >= max_trials:
                size = last
                break
            low = size
            if high:
                if high - low <= 1:
                    break
                _, changed = adjust((high + low) // 2)
            else:
                _, changed = adjust(int(size * 2.0))
            if not changed:
                break
        else:
            high = size
            adjust((high + low) // 2)
            if high - low <= 1:
                break
    if margin > 0:
        size = max(1, int(size * (1 - margin)))
    return size


def device_memory_limit() -> int:
    """Bytes one device may use: the device's own limit (GPU, TPU), else the host's memory
    shared by its local devices (CPU)."""
    device = jax.local_devices()[0]
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(total // max(1, jax.local_device_count()))


def step_bytes(memory: dict[str, int]) -> int:
    """Peak per-device bytes of a compiled step from its memory analysis: arguments, outputs
    not aliased to (donated) arguments, temporaries and code."""
    return (memory.get("argument", 0) + memory.get("output", 0) - memory.get("alias", 0)
            + memory.get("temp", 0) + memory.get("generated_code", 0))


def _first_batch(train_data, datamodule, module, fresh: bool):
    source = train_data
    if source is None and datamodule is not None:
        if fresh:  # the tuner's own call; inside a fit, the fit has set it up
            datamodule.setup("fit")
        source = datamodule.train_dataloader()
    if source is None and callable(getattr(module, "train_dataloader", None)):
        source = module.train_dataloader()
    if source is None:
        raise ConfigurationError(
            "the batch-size finder needs training data: pass train_dataloaders= or "
            "datamodule=, whose train_dataloader() reads the batch size attribute.")
    return next(iter(source)), source


def _dataset_length(source) -> int | None:
    for name in ("num_examples", "dataset"):
        value = getattr(source, name, None)
        if isinstance(value, int):
            return value
        if value is not None:
            try:
                return len(value)
            except TypeError:
                pass
    return None


def _batch_holders(module, datamodule, name: str) -> list:
    """Lightning's holders of the batch size (`lightning_setattr`): the module if it has the
    attribute, its hparams if they name it, and the same two of the datamodule; all are set."""
    holders = []
    for owner in (module, datamodule):
        if owner is None:
            continue
        if hasattr(owner, name):
            holders.append(owner)
        hparams = getattr(owner, "hparams", None)
        if isinstance(hparams, dict) and name in hparams:
            holders.append(hparams)
    if not holders:
        raise ConfigurationError(
            f"the batch-size finder sets the batch size through an attribute named "
            f"{name!r} (batch_arg_name), which neither {type(module).__name__}, the datamodule "
            "nor their hparams have: add one that train_dataloader() reads, or name yours with "
            "batch_arg_name=.")
    return holders


def run_scale_batch_size(fit, module, train_data, datamodule, *, mode: str, init_val: int,
                         max_trials: int, batch_arg_name: str, margin: float, max_val: int,
                         memory_limit: int | None = None,
                         fresh: bool = True) -> tuple[int, list[tuple[int, int]]]:
    """The largest batch size whose compiled training step fits in `memory_limit` bytes per
    device (default: `device_memory_limit()`), searched as Lightning's; sets `batch_arg_name`
    on each of the module, the datamodule and their hparams that has it (as Lightning).
    Returns it and `(size, bytes)` per trial. Nothing runs: each trial compiles the step for
    that size and reads its analysis."""
    if mode not in ("power", "binsearch"):
        raise ConfigurationError(
            f"batch-size finder mode={mode!r}: use 'power' or 'binsearch'.")
    if not 0.0 <= margin < 1.0:
        raise ConfigurationError(f"batch-size finder margin={margin}: give 0 <= margin < 1.")
    if int(init_val) < 1 or int(max_trials) < 1:
        raise ConfigurationError(
            f"batch-size finder: init_val ({init_val}) and max_trials ({max_trials}) must be "
            ">= 1.")
    holders = _batch_holders(module, datamodule, batch_arg_name)
    batch, source = _first_batch(train_data, datamodule, module, fresh)
    length = _dataset_length(source)
    limit = device_memory_limit() if memory_limit is None else int(memory_limit)
    trials: list[tuple[int, int]] = []
    kept = module.assigned_model

    def fits(size: int) -> bool:
        rows = size if length is None else min(size, length)
        example = jax.tree.map(
            lambda x: np.broadcast_to(np.zeros((), np.asarray(x).dtype),
                                      (rows, *np.shape(x)[1:])), batch)
        try:
            used = step_bytes(fit.plan(module, example, verbose=False).memory)
        except (DataError, ShardingError) as err:
            raise type(err)(
                f"the batch-size finder cannot try a batch of {rows} under {fit.strategy.name}: "
                f"{err} A jaxlight batch is the global batch: give init_val a multiple of the "
                "data-parallel degree (mode='power' keeps it one; 'binsearch' may try "
                "midpoints that are not).") from err
        trials.append((rows, used))
        return used <= limit

    try:
        found = search_batch_size(fits, mode, int(init_val), int(max_trials), margin,
                                  int(max_val), length)
    finally:
        module.model = kept
    for holder in holders:
        if isinstance(holder, dict):
            holder[batch_arg_name] = found
        else:
            setattr(holder, batch_arg_name, found)
    return found, trials


class BatchSizeFinder(Callback):
    """Lightning's `BatchSizeFinder`: before the fit's loaders are built, finds the largest
    batch size whose compiled training step fits in a device's memory (`Tuner.
    scale_batch_size`) and sets `batch_arg_name` on each of the module, the datamodule and
    their hparams that has it (as Lightning), so the `train_dataloader()` that builds the
    fit's loader reads it.

    Args:
        mode: "power" or "binsearch".
        steps_per_trial: accepted for Lightning's signature (no step runs: each trial reads
            the compiled step's memory analysis).
        init_val: the first size tried.
        max_trials: most sizes that fit before the search ends.
        batch_arg_name: the attribute holding the batch size.
        margin: binsearch's safety margin taken off the result.
        max_val: the largest size considered.
        memory_limit: bytes per device (default: the device's limit).

    Example:
        >>> from jaxlight import callbacks
        >>> finder = callbacks.BatchSizeFinder(mode="binsearch", init_val=8)
    """

    def __init__(self, mode: str = "power", steps_per_trial: int = 3, init_val: int = 2,
                 max_trials: int = 25, batch_arg_name: str = "batch_size",
                 margin: float = 0.05, max_val: int = 8192, *,
                 memory_limit: int | None = None):
        if mode not in ("power", "binsearch"):
            raise ConfigurationError(
                f"BatchSizeFinder(mode={mode!r}): use 'power' or 'binsearch'.")
        self._mode, self._steps_per_trial, self._init_val = mode, steps_per_trial, init_val
        self._max_trials, self._batch_arg_name = max_trials, batch_arg_name
        self._margin, self._max_val, self._memory_limit = margin, max_val, memory_limit
        #: The size found, and `(size, bytes per device)` for each trial.
        self.optimal_batch_size: int | None = None
        self.trials: list[tuple[int, int]] = []

    def setup(self, fit, module, stage: str) -> None:
        if stage != "fit" or fit.fast_dev_run:
            return
        datamodule = fit.datamodule
        if datamodule is None and not callable(getattr(module, "train_dataloader", None)):
            raise ConfigurationError(
                "BatchSizeFinder changes the batch size through train_dataloader(): give the "
                "fit a DataModule (Fit.fit(module, datamodule=dm)) whose train_dataloader() "
                f"reads its {self._batch_arg_name!r}, or use jl.Tuner(fit).scale_batch_size "
                "and build the loader with the size it returns.")
        self.optimal_batch_size, self.trials = run_scale_batch_size(
            fit, module, None, datamodule, mode=self._mode, init_val=self._init_val,
            max_trials=self._max_trials, batch_arg_name=self._batch_arg_name,
            margin=self._margin, max_val=self._max_val, memory_limit=self._memory_limit,
            fresh=False)
