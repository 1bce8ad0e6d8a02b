"""TrainFeed: the training loop's view of its data, one epoch at a time, with exact positions.

The loop asks for an epoch's batches and gets `(batch, position)` pairs: `position` is the data's
state right after that batch was read, so a checkpoint taken after the batch's step resumes with
the next unseen batch even when the prefetcher (`jaxlight.data._prefetch`) has read further ahead.
Three kinds of data, tried in this order:

- a loader with `state_dict`/`load_state_dict` (`ArrayLoader`, torchdata's `StatefulDataLoader`):
  the position is `state_dict()`, restored with `load_state_dict`;
- an iterable whose iterator has `get_state`/`set_state` (grain's `DataLoader`, `MapDataset`,
  `IterDataset`, or a grain iterator): every process's `get_state()`, restored with `set_state`;
- any other iterable: no position of its own; a resume skips the batches already trained.

Grain iterators hold per-process positions (each process reads its own shard), so a checkpoint
stores them all, gathered over the processes, and a resume needs the same process count.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator
from typing import Any

from jaxlight import distributed as _distributed
from jaxlight._errors import CheckpointError, DataError
from jaxlight.data._convert import check_iterable, to_numpy

__all__ = ["TrainFeed"]

#: The key that marks a checkpoint's loader record as per-process iterator states.
_ITERATOR_KEY = "iterator_states"


def _has_loader_state(data: Any) -> bool:
    return hasattr(data, "state_dict") and hasattr(data, "load_state_dict")


def _is_stateful_iterator(it: Any) -> bool:
    return callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))


def _encode(state: Any) -> Any:
    # grain's DataLoader iterator state is JSON bytes; dataset iterators give a JSON-able dict.
    if isinstance(state, bytes):
        return {"bytes": base64.b64encode(state).decode("ascii")}
    return {"value": state}


def _decode(record: dict) -> Any:
    if "bytes" in record:
        return base64.b64decode(record["bytes"])
    return record["value"]


def _prepare_grain(data: Any) -> None:
    """grain's worker processes read absl flags; outside `absl.app.run` nobody parsed them."""
    if not type(data).__module__.startswith("grain"):
        return
    from absl import flags  # grain depends on absl; only reached for grain data

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # their defaults, as absl.app.run would leave them


def _stacked_shapes(exc: BaseException) -> list | None:
    """The shapes NumPy was asked to stack when grain's batching failed (its frame's locals)."""
    cause = exc.__cause__ or exc.__context__
    tb = cause.__traceback__ if cause is not None else None
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    arrays = tb.tb_frame.f_locals.get("arrays") if tb is not None else None
    try:
        return [tuple(a.shape) for a in arrays] if arrays is not None else None
    except (AttributeError, TypeError):
        return None


def _grain_batches(iterator: Iterator, data: Any, epoch: int, skip: int) -> Iterator:
    """A grain pipeline's batches; an error grain raises while making one gets jaxlight's
    context (which batch, the records' shapes where grain could not stack them)."""
    index = skip
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            shapes = _stacked_shapes(exc)
            first = (str(exc).strip().splitlines() or [""])[0]
            stacking = shapes is not None or "same shape" in str(exc) or \
                "same structure" in str(exc)
            hint = (" Records batched together must have the same shapes: pad or crop them to "
                    "one length in a map before batching (or group records by length), or "
                    "batch them yourself." if stacking else "")
            shown = f" (records of shapes {shapes} in one batch)" if shapes else ""
            raise DataError(
                f"grain could not make training batch {index} of epoch {epoch} from the "
                f"{type(data).__name__}: {type(exc).__name__}: {first}{shown}.{hint}"
            ) from exc
        index += 1
        yield batch


class TrainFeed:
    """Yields an epoch's batches with the data's position after each; saves and restores it.

    Args:
        data: the training data given to `Fit.fit`.
    """

    def __init__(self, data: Any):
        check_iterable(data, "training")
        _prepare_grain(data)
        self.data = data
        self._loader = _has_loader_state(data)
        self._iterator: Any = None  # the current epoch's grain-style iterator
        self._pending: Any = None  # an iterator state to restore at the next epoch start
        self.position: Any = None  # the state after the last batch the loop consumed

    def epoch(self, epoch: int, skip: int, budget: int | None = None
              ) -> Iterator[tuple[Any, Any]]:
        """`(batch, position)` pairs of epoch `epoch`, after the `skip` batches already trained.

        `budget` bounds the batches read (the steps left, the epoch's batch limit), so that
        reading ahead never takes a batch the loop will not train on.
        """
        data = self.data
        if hasattr(data, "set_epoch"):
            data.set_epoch(epoch)
        iterator = iter(data)
        stateful = not self._loader and _is_stateful_iterator(iterator)
        if skip and stateful and self._pending is not None:
            iterator.set_state(self._pending)  # resumed mid-epoch: continue where it stopped
        elif skip and not self._loader:
            # A generic iterable resumes by skipping the batches it already gave.
            iterator = itertools.islice(iterator, skip, None)
        self._pending = None
        self._iterator = iterator if stateful else None
        if type(data).__module__.startswith("grain"):
            iterator = _grain_batches(iterator, data, epoch, skip)
        if budget is not None:
            iterator = itertools.islice(iterator, max(budget, 0))
        if self._loader:
            return ((to_numpy(b), data.state_dict()) for b in iterator)
        if stateful:
            it = self._iterator
            return ((to_numpy(b), it.get_state()) for b in iterator)
        return ((to_numpy(b), None) for b in iterator)

    def consumed(self, position: Any) -> None:
        """The loop took the batch read at `position` (its step has been dispatched)."""
        self.position = position

    # -- checkpoints -----------------------------------------------------------------------

    def state(self) -> Any:
        """The record a checkpoint stores (JSON-able); every process must call it together."""
        if self._loader:
            return self.position if self.position is not None else self.data.state_dict()
        if self._iterator is None and self.position is None:
            return None
        local = _encode(self.position) if self.position is not None else None
        return {_ITERATOR_KEY: _distributed.all_gather_json("data_position", local)}

    def restore(self, record: Any) -> None:
        """Resumes from a checkpoint's record: the next epoch continues after its batch."""
        if record is None:
            return
        if self._loader:
            self.data.load_state_dict(record)
            self.position = record
            return
        if not isinstance(record, dict) or _ITERATOR_KEY not in record:
            return  # a loader's state_dict, and this data has none: resume by skipping
        states = record[_ITERATOR_KEY]
        n, pid = _distributed.process_count(), _distributed.process_index()
        if len(states) != n:
            raise CheckpointError(
                f"the checkpoint holds the data iterator positions of {len(states)} processes, "
                f"but this run has {n}: each process reads its own shard of a grain pipeline, "
                f"so resume with {len(states)} processes (or restart the data from its start "
                "with ckpt_path=None and load the weights with jaxlight.load_checkpoint)."
            )
        if states[pid] is not None:
            self._pending = _decode(states[pid])
            self.position = self._pending

    def describe(self) -> str:
        if self._loader:
            return f"{type(self.data).__name__} (state_dict)"
        return type(self.data).__name__
