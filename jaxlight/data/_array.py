"""ArrayLoader: in-memory data with deterministic, resumable, per-process sharded batches.

`ArrayLoader` holds a pytree of NumPy arrays with a common leading (example) dimension. Each epoch
draws one permutation from `(seed, epoch)`, so every process, and every resumed run, sees the same
order. With several processes each one yields only its contiguous share of every global batch,
which `Fit` assembles into one global array: the global batch equals a one-process run's.

Any iterable of NumPy pytrees works with `Fit` too; this loader adds exact resume
(`state_dict`/`load_state_dict`) and process sharding.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from jaxlight import distributed
from jaxlight._errors import CheckpointError, ConfigurationError, DataError
from jaxlight.data._convert import is_hf_dataset, to_numpy

__all__ = ["ArrayLoader"]


class ArrayLoader:
    """Batches of an in-memory pytree of arrays.

    Args:
        arrays: a pytree (usually a dict) of arrays sharing their first dimension (NumPy, or
            torch CPU tensors, shared without copies), or a Hugging Face `datasets.Dataset`.
        batch_size: the global batch size (all processes together).
        shuffle: draw a new permutation each epoch from `(seed, epoch)` (default True). Given
            as validation, test or prediction data, a loader left at the default reads in order
            (`for_evaluation`).
        seed: the shuffling seed.
        drop_remainder: drop the last partial batch (default True, for training); evaluation
            keeps it unless `drop_remainder=True` was given explicitly, so it sees every
            example, as Lightning's validation loader does.
        process_index, process_count: which share of each batch this process yields; default
            `jax.process_index()` and `jax.process_count()`.

    Example:
        >>> import numpy as np
        >>> loader = ArrayLoader({"x": np.arange(10)}, batch_size=4, shuffle=False)
        >>> [b["x"].tolist() for b in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """

    #: Batches are slices of arrays in memory, each read in microseconds: by default
    #: (`Fit(prefetch_batches=None)`) the training loop reads them in its own thread, since a
    #: thread reading ahead would only add its hand-over (docs/data.md, Prefetching).
    in_memory = True

    def __init__(
        self,
        arrays: Any,
        batch_size: int,
        *,
        shuffle: bool | None = None,
        seed: int = 0,
        drop_remainder: bool | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if is_hf_dataset(arrays):
            # A Hugging Face dataset's columns as NumPy (Arrow memory, no copy where possible).
            arrays = arrays.with_format("numpy")[:]
        arrays = to_numpy(arrays)  # torch tensors share their memory with the NumPy views
        flat = jax.tree_util.tree_leaves_with_path(arrays)
        leaves = [x for _, x in flat]
        if not leaves:
            raise DataError("ArrayLoader got no arrays: pass a dict such as {'x': X, 'y': Y}.")
        if len(flat) == 1 and not flat[0][0] and not np.ndim(flat[0][1]) \
                and isinstance(flat[0][1], Iterable):
            name = type(flat[0][1]).__name__
            raise DataError(
                f"{type(self).__name__} holds arrays in memory and got a {name}, an iterable of "
                "examples (like torch's IterableDataset) with no length or indexing. Stack its "
                "examples into arrays first, e.g. examples = list(dataset); arrays = "
                "jax.tree.map(lambda *xs: np.stack(xs), *examples); then "
                f"{type(self).__name__}(arrays, batch_size); or give Fit an iterable that yields "
                "whole batches (a generator of dicts of batch_size rows), or a Grain loader "
                "(resumable). See docs/data.md.")
        scalars = [jax.tree_util.keystr(path) or "the data" for path, x in flat if not np.ndim(x)]
        if scalars:
            raise DataError(
                f"{type(self).__name__} arrays need a first dimension (one row per example); "
                f"{', '.join(scalars)} has none. Pass arrays of "
                "shape (examples, ...), e.g. {'x': X, 'y': Y} with X.shape[0] == Y.shape[0].")
        lengths = {int(np.shape(x)[0]) for x in leaves}
        if len(lengths) != 1:
            raise DataError(
                "ArrayLoader arrays must share their first dimension; got lengths "
                f"{sorted(lengths)}."
            )
        if batch_size <= 0:
            raise ConfigurationError(f"batch_size must be positive, got {batch_size}.")
        self.arrays = jax.tree.map(np.asarray, arrays)
        self.num_examples = lengths.pop()
        self.batch_size = int(batch_size)
        # Training's defaults; evaluation changes only what was left at its default.
        self._defaults = {name for name, value in (("shuffle", shuffle),
                                                   ("drop_remainder", drop_remainder))
                          if value is None}
        self.shuffle = True if shuffle is None else bool(shuffle)
        self.seed = seed
        self.drop_remainder = True if drop_remainder is None else bool(drop_remainder)
        if process_index is None or process_count is None:
            # A loader is often built before Fit: join a launched multi-process job first (a
            # started JAX backend could not join it any more).
            distributed.initialize()
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if self.batch_size % self.process_count:
            raise ConfigurationError(
                f"batch_size {self.batch_size} is not divisible by the {self.process_count} "
                "processes: each process must feed the same number of examples. Choose a "
                f"multiple of {self.process_count}."
            )
        if self.drop_remainder and self.num_examples < self.batch_size:
            raise DataError(
                f"ArrayLoader has {self.num_examples} examples, fewer than one batch of "
                f"{self.batch_size} with drop_remainder=True: it would yield nothing. Lower "
                "batch_size or pass drop_remainder=False."
            )
        self.epoch = 0
        self.position = 0  # batches already yielded by the newest pass of the current epoch
        # A position to resume from (load_state_dict): the next pass of this epoch starts there.
        self._resume_at: int | None = None

    def __len__(self) -> int:
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_remainder else 0)

    def for_evaluation(self) -> ArrayLoader:
        """This loader as validation, test and prediction read it: every example (the last
        partial batch kept) in order, unless `drop_remainder` or `shuffle` was given
        explicitly; a copy sharing the arrays, so reading it moves no training position."""
        view = copy.copy(self)
        if "drop_remainder" in self._defaults:
            view.drop_remainder = False
        if "shuffle" in self._defaults:
            view.shuffle = False
        view.epoch, view.position, view._resume_at = 0, 0, None
        return view

    def set_epoch(self, epoch: int) -> None:
        """Selects the permutation of `epoch` for the next pass.

        Right after `load_state_dict` for the same epoch it keeps the restored position, so a
        resumed fit continues with the next unseen batch.
        """
        if self._resume_at is not None and epoch == self.epoch:
            return
        self._resume_at = None
        self.epoch = epoch
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        """The loader's position: restoring it resumes with the next unseen batch."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores a position: the next pass (`iter`) continues after its last batch."""
        self._check_batch_size(state)
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = int(state.get("seed", self.seed))
        self._resume_at = self.position

    def _check_batch_size(self, state: dict[str, int]) -> None:
        """A position counts batches: under another batch size it names other examples."""
        saved = state.get("batch_size")  # absent in checkpoints of older jaxlight versions
        if saved is None or int(saved) == self.batch_size or not int(state["position"]):
            return
        done = int(state["position"]) * int(saved)
        raise CheckpointError(
            f"the checkpoint's ArrayLoader position was saved with batch_size={saved} (epoch "
            f"{state['epoch']}, {state['position']} batches read: examples 0-{done - 1} of that "
            f"epoch's order), but this ArrayLoader has batch_size={self.batch_size}: counted in "
            f"its batches the epoch would go on at example "
            f"{int(state['position']) * self.batch_size} and train some examples twice or "
            f"never. Resume with batch_size={saved}, or start the data afresh: load the "
            "weights with jaxlight.load_checkpoint(path, module) and fit without ckpt_path."
        )

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_examples)
        rng = np.random.default_rng([self.seed, self.epoch])
        return rng.permutation(self.num_examples)

    def __iter__(self) -> Iterator[Any]:
        """A fresh pass over the current epoch's permutation, as every `iter()` of a Python
        iterable or a torch DataLoader is: a batch peeked at with `next(iter(loader))` does not
        move later passes. Only a restored position (`load_state_dict`) starts a pass part-way.
        `state_dict()` follows the newest pass; a pass that runs to its end moves to the next
        epoch's permutation."""
        start, self._resume_at = self._resume_at or 0, None
        self.position = start
        return self._batches(self._order(), self.epoch, start)

    def _batches(self, order: np.ndarray, epoch: int, index: int) -> Iterator[Any]:
        share = self.batch_size // self.process_count
        while index < len(self):
            start = index * self.batch_size
            idx = order[start : start + self.batch_size]
            if len(idx) < self.batch_size:  # the last partial batch, split as evenly as possible
                bounds = np.linspace(0, len(idx), self.process_count + 1).astype(int)
                local = idx[bounds[self.process_index] : bounds[self.process_index + 1]]
            else:
                local = idx[self.process_index * share : (self.process_index + 1) * share]
            index += 1
            self.position = index
            yield jax.tree.map(lambda a: a[local], self.arrays)
        # The epoch is exhausted: the next pass draws the next permutation (unless a newer pass
        # or set_epoch has chosen another epoch meanwhile).
        if self.epoch == epoch:
            self.epoch += 1
            self.position = 0
