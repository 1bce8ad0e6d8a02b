"""DataLoader: `ArrayLoader` under torch's name, with torch's defaults (no shuffle, keep the
last partial batch), so that a ported `DataLoader(ds, batch_size=32)` trains what Lightning
trains: every example, the same optimizer steps per epoch."""

from __future__ import annotations

from typing import Any

from jaxlight._errors import ConfigurationError
from jaxlight.data._array import ArrayLoader

__all__ = ["DataLoader"]

#: torch.utils.data.DataLoader arguments with no meaning for in-memory NumPy batches: what
#: each is in jaxlight (the loader runs in the host thread; `Fit(prefetch_batches=...)` reads
#: ahead in a background thread and puts batches on the devices).
_TORCH_ONLY = {
    "num_workers": "the Fit's prefetch thread reads ahead: Fit(prefetch_batches=2)",
    "pin_memory": "batches go to the devices from NumPy directly",
    "persistent_workers": "there are no worker processes",
    "prefetch_factor": "Fit(prefetch_batches=...)",
    "collate_fn": "batches are slices of the arrays; transform the arrays beforehand",
    "sampler": "shuffle=True draws a permutation per epoch from (seed, epoch)",
    "batch_sampler": "batch_size and drop_last set the batches",
    "worker_init_fn": "there are no worker processes",
    "generator": "seed= sets the shuffling seed",
    "timeout": "there are no worker processes",
    "multiprocessing_context": "there are no worker processes",
    "in_order": "batches are always yielded in order",
}


class DataLoader(ArrayLoader):
    """In-memory batches with `torch.utils.data.DataLoader`'s defaults and argument names.

    The port of `DataLoader(dataset, batch_size=32)` is `DataLoader(arrays, batch_size=32)`:
    no shuffling and the last partial batch kept, as in torch, so a training epoch has
    `ceil(N / batch_size)` steps as in Lightning. The partial batch runs through one more
    compiled step of its shape (see docs/data.md). Everything else is `ArrayLoader`'s:
    resumable position, per-process shares.

    Args:
        dataset: a pytree (a dict, or a tuple as torch's `TensorDataset` yields) of NumPy
            arrays or torch CPU tensors sharing their first dimension, or a Hugging Face
            `datasets.Dataset`.
        batch_size: the global batch size (torch's default 1).
        shuffle: a new permutation every epoch from `(seed, epoch)` (torch's default False).
        drop_last: drop the last partial batch (torch's default False).
        seed: the shuffling seed (torch's `generator=`).

    Example:
        >>> import numpy as np
        >>> from jaxlight.data import DataLoader
        >>> [b["x"].tolist() for b in DataLoader({"x": np.arange(5)}, batch_size=2)]
        [[0, 1], [2, 3], [4]]
    """

    def __init__(self, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 *, drop_last: bool = False, seed: int = 0, **torch_only: Any):
        for name in torch_only:
            if name not in _TORCH_ONLY:
                raise ConfigurationError(
                    f"DataLoader got an unknown argument {name!r}; it takes dataset, "
                    "batch_size, shuffle, drop_last and seed (torch's own arguments "
                    f"{', '.join(sorted(_TORCH_ONLY))} are accepted and ignored where they "
                    "mean nothing here).")
            value = torch_only[name]
            if name in ("collate_fn", "sampler", "batch_sampler", "generator") \
                    and value is not None:
                raise ConfigurationError(
                    f"DataLoader({name}=...) has no jaxlight meaning: {_TORCH_ONLY[name]}.")
        if batch_size is None:
            raise ConfigurationError(
                "DataLoader(batch_size=None) (torch's unbatched mode) is not supported: give "
                "the batch size, or pass the batches themselves (a list of dicts) to Fit.")
        super().__init__(dataset, batch_size, shuffle=bool(shuffle), seed=seed,
                         drop_remainder=drop_last)

    @property
    def drop_last(self) -> bool:
        return self.drop_remainder
