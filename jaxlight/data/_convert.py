"""Batches from other ecosystems as NumPy: torch tensors and Hugging Face datasets, without copies.

`Fit` feeds the devices NumPy pytrees. A loader that yields `torch.Tensor` leaves (a
`torch.utils.data.DataLoader`, a torchdata `StatefulDataLoader`) or a Hugging Face
`datasets.Dataset` batch works unchanged: each CPU tensor becomes a NumPy view of the same memory
(`Tensor.numpy()` shares it; bfloat16, which NumPy lacks, is reinterpreted bit for bit as
`ml_dtypes.bfloat16`). torch and datasets are never imported here: a leaf is recognised by its
type's module, so jaxlight works without them installed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jaxlight._errors import DataError, DataTypeError

__all__ = ["numpy_batches", "to_numpy"]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _torch_to_numpy(t: Any) -> np.ndarray:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # one copy off the accelerator; CPU tensors below are shared, not copied
    t = t.resolve_conj().resolve_neg()
    name = str(t.dtype).removeprefix("torch.")
    if name == "bfloat16":
        import ml_dtypes  # installed with jax; only needed for bf16 torch tensors
        import torch  # the batch already holds torch tensors, so torch is installed

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _needs_conversion(batch: Any) -> bool:
    return any(not isinstance(x, np.ndarray) and _is_torch(x) for x in jax.tree.leaves(batch))


def to_numpy(batch: Any) -> Any:
    """Turns every torch tensor leaf of `batch` into a NumPy array sharing its memory.

    Other leaves (NumPy arrays, JAX arrays, Python scalars) pass through unchanged.

    Example:
        >>> to_numpy({"x": np.ones(2)})["x"].tolist()
        [1.0, 1.0]
    """
    if not _needs_conversion(batch):
        return batch
    return jax.tree.map(lambda x: _torch_to_numpy(x) if _is_torch(x) else x, batch)


def is_hf_dataset(data: Any) -> bool:
    return type(data).__module__.startswith("datasets") and type(data).__name__ == "Dataset"


def check_iterable(data: Any, what: str) -> None:
    """Refuses data whose iteration would not yield batches, with the way to batch it."""
    if is_hf_dataset(data):
        raise DataError(
            f"the {what} data is a datasets.Dataset ({len(data)} rows): iterating it yields one "
            "example at a time, not batches. Pass jaxlight.data.ArrayLoader(dataset."
            "with_format('numpy'), batch_size=...) (shuffled, resumable, sharded per process) or "
            "dataset.with_format('numpy').iter(batch_size=..., drop_last_batch=True)."
        )
    if not isinstance(data, Iterable) and not hasattr(data, "__iter__") and callable(data):
        name = getattr(data, "__qualname__", None) or type(data).__name__
        raise DataError(
            f"the {what} data is {name}, a function or method, not its result: call it, for "
            f"example Fit.fit(module, dm.train_dataloader()) rather than dm.train_dataloader "
            "(or pass the DataModule itself: Fit.fit(module, datamodule=dm))."
        )
    if not isinstance(data, Iterable) and not hasattr(data, "__iter__"):
        raise DataError(
            f"the {what} data ({type(data).__name__}) is not iterable: pass an iterable of "
            "batches (pytrees of NumPy arrays), a grain DataLoader or dataset, or "
            "jaxlight.data.ArrayLoader."
        )


#: NumPy dtype kinds no JAX array holds: strings, bytes, Python objects, records, datetimes.
_NOT_ARRAYS = {"U": "strings", "S": "bytes", "O": "Python objects", "V": "records",
               "M": "datetimes", "m": "timedeltas"}


def check_dtypes(batch: Any, where: str) -> None:
    """Refuses a batch leaf JAX cannot hold (strings such as file names), naming the leaf."""
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        dtype = getattr(x, "dtype", None)
        kind = np.dtype(dtype).kind if dtype is not None else np.asarray(x).dtype.kind
        if kind in _NOT_ARRAYS:
            shown = dtype if dtype is not None else np.asarray(x).dtype
            raise DataTypeError(
                f"{where} has leaf {jax.tree_util.keystr(path) or 'batch'} of dtype {shown} "
                f"({_NOT_ARRAYS[kind]}), which a JAX array cannot hold. Keep it out of the "
                "batches given to Fit (drop the key in the loader or a collate function), or "
                "turn it into numbers (an index, token ids)."
            )


def numpy_batches(data: Iterable, where: str = "batch") -> Iterator[Any]:
    """Iterates `data`, converting torch tensor leaves to NumPy (see `to_numpy`); refuses
    leaves JAX cannot hold (`check_dtypes`)."""
    for i, batch in enumerate(data):
        batch = to_numpy(batch)
        check_dtypes(batch, f"{where} {i}")
        yield batch
