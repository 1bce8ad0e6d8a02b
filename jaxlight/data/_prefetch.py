"""Prefetcher: reads the next batches and puts them on the devices while the current step runs.

The first batch is read in the loop's thread (at an epoch's start the devices wait for it, and a
thread would add its start and a hand-over); then a background thread pulls the next
`(batch, position)` pairs from the epoch's iterator, checks each batch, and transfers it to the
devices already in the step's input sharding; the loop takes `(batch, device_batch, position)`
triples from a queue holding at most `depth` transferred batches. The host's work per batch (a
loader's Python, decoding, augmentation, the transfer) then overlaps both the device step and the
loop's own host work (dispatch, hooks, waiting on the step before): a step costs max(load,
compute) instead of their sum.

Nothing here waits on the device: `device_put` is asynchronous, and the loop's bound of two steps
in flight is its own. Depth 0 reads and transfers in the loop's thread, as a loop without
prefetching does. The thread only ever reads ahead within the budget the loop gives the
iterator, so no batch is read that will not be trained on; `close()` stops it and waits for it
(the iterator belongs to the loop again afterwards).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from jaxlight._errors import DataError

__all__ = ["Prefetcher", "prefetch_depth"]

_END = object()

#: Batches read ahead by default from a loader whose reading costs host time.
DEFAULT_DEPTH = 2


def prefetch_depth(data: Any, asked: int | None) -> int:
    """Batches to read ahead of the loop from `data` when `Fit(prefetch_batches=asked)`.

    None (the default): none for batches already in memory (a loader whose `in_memory` is True,
    as `ArrayLoader`'s, or a list or tuple of batches), whose reading costs less than a thread's
    hand-over, else `DEFAULT_DEPTH`. Data that samples from the live model (its
    `reads_live_model` is True, e.g. GRPO's generation batches) is never read ahead, whatever
    was asked: each batch is read right after the step before it was dispatched.
    """
    if getattr(data, "reads_live_model", False):
        return 0
    if asked is not None:
        return asked
    return 0 if isinstance(data, (list, tuple)) or getattr(data, "in_memory", False) \
        else DEFAULT_DEPTH


def explain_donated(exc: BaseException, depth: int) -> BaseException:
    """A read-ahead thread's "Array has been deleted" (the data read a JAX array that a
    training step had donated since) as an error naming `reads_live_model`; any other
    exception as it is."""
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and ("has been deleted" in text
                                                or "donated" in text)):
        return exc
    err = DataError(
        f"the training data read a JAX array that a training step had already donated "
        f"(JAX: {text}) while it was read {depth} batch(es) ahead of the loop, in a background "
        "thread (Fit's prefetch_batches). Data that reads the live model (module.model, e.g. to "
        "sample from it or to score examples with it) must say so: give the iterable the class "
        "attribute `reads_live_model = True`, and the loop reads each of its batches right "
        "after the step before it was dispatched, never ahead (docs/data.md, 'Data that reads "
        "the model'). Fit(prefetch_batches=0) reads in the loop's thread too.")
    err.__cause__ = exc
    return err


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """Iterates `(batch, device_batch, position)` over `pairs`, `depth` transfers ahead.

    Args:
        pairs: an iterator of `(host_batch, position)` (see `TrainFeed.epoch`).
        put: host batch -> device batch (the strategy's `put_batch` with the step's shardings).
        depth: transferred batches kept ready; 0 reads and transfers on demand in this thread.
        check: called as `check(batch, n)` for the n-th batch (from 0) before its transfer.
    """

    def __init__(self, pairs: Iterator[tuple[Any, Any]], put: Callable[[Any], Any],
                 depth: int = 2, check: Callable[[Any, int], None] | None = None):
        self._pairs = pairs
        self._put = put
        self._check = check
        self._depth = int(depth)
        self._count = 0
        self._stop = threading.Event()
        self._done = False
        self._thread: threading.Thread | None = None
        if self._depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=self._depth)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaxlight-prefetch", daemon=True)
        self._thread.start()

    def _prepare(self, batch: Any, position: Any) -> tuple[Any, Any, Any]:
        if self._check is not None:
            self._check(batch, self._count)
        self._count += 1
        return batch, self._put(batch), position

    def _offer(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)  # wakes at once when the loop takes one
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for batch, position in self._pairs:
                if self._stop.is_set() or not self._offer(self._prepare(batch, position)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the loop's thread, re-raised
            self._offer(_Failure(explain_donated(exc, self._depth)))
            return
        self._offer(_END)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> tuple[Any, Any, Any]:
        if self._done:
            raise StopIteration
        if self._thread is None:
            # The first batch is read here, and reading ahead starts after it: the loop waits
            # for one batch, not also for a thread to start and hand it over (at every epoch's
            # start the devices are idle until the first step is dispatched).
            try:
                batch, position = next(self._pairs)
            except StopIteration:
                self._done = True
                raise
            item = self._prepare(batch, position)
            if self._depth > 0:
                self._start()
            return item
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.exc
        return item

    def close(self) -> None:
        """Stops reading ahead and waits for the thread (at most one batch read in progress)."""
        self._done = True
        if self._thread is None:
            return
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.1)
        self._thread.join()
