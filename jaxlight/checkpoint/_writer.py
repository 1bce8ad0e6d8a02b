"""Saving checkpoints: an orbax `CheckpointManager` per directory with jaxlight's retention."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import math
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax

from jaxlight import distributed as _distributed
from jaxlight._errors import CheckpointError, JaxlightWarning
from jaxlight.checkpoint import _verify
from jaxlight.checkpoint._format import (
    META_ITEM,
    STATE_ITEM,
    build_meta,
    is_finite,
    ocp,
    state_tree,
    unwrap_keys,
)
from jaxlight.checkpoint._guard import DirectoryLock, disk_fault
from jaxlight.checkpoint._paths import complete_steps
from jaxlight.state import _frozen

#: Below this many bytes per replica, a replicated array is written whole by one replica
#: instead of a slice by each (orbax's replica-parallel saving). Each slicing compiles a program
#: per array shape at the first save (24 `slice` programs, 1.2-1.8 of 5.9-6.5 CPU-seconds, in a
#: small classifier's 2-step data-parallel fit), which small arrays never win back; large ones
#: keep orbax's default.
MIN_REPLICA_SLICE_BYTES = 1 << 20


def type_handlers():
    """orbax's type handlers, with `jax.Array`'s writing arrays of fewer than
    `MIN_REPLICA_SLICE_BYTES` per replica from one replica (the same files either way)."""
    th = ocp().type_handlers
    array = copy.copy(th.get_type_handler(jax.Array))
    if not hasattr(array, "_min_slice_bytes_for_replica_parallel"):
        raise CheckpointError(  # tests/checkpoint/test_writer.py notices an orbax that moved it
            "this orbax-checkpoint's ArrayHandler has no _min_slice_bytes_for_replica_parallel; "
            "jaxlight supports the orbax-checkpoint versions its pyproject.toml names.")
    array._min_slice_bytes_for_replica_parallel = MIN_REPLICA_SLICE_BYTES
    return th.create_type_handler_registry(
        *[(ty, th.get_type_handler(ty)) for ty in th.supported_types() if ty is not jax.Array],
        (jax.Array, array))


def join_best(best: dict, step: int, value: float | None, k: int, mode: str) -> bool:
    """Lightning's top-k rule, one checkpoint at a time: `step` (with a finite `value`) joins
    `best` (step -> value, updated in place) while fewer than `k` are kept; after that only a
    strictly better value replaces the worst kept one (among equally worst, the first kept).
    Returns whether it joined."""
    if value is None or k == 0:
        return False
    if len(best) >= k:
        worst = max if mode == "min" else min
        kth = worst(best, key=best.get)  # the first of equally worst ones
        if not (value < best[kth] if mode == "min" else value > best[kth]):
            return False
        del best[kth]
    best[step] = value
    return True


@dataclasses.dataclass
class Retention:
    """Which checkpoints orbax keeps: the best `top_k` by a finite monitored value (or the latest
    `top_k` without a monitor), the newest one when `keep_last`, and `pinned` steps.

    The best `top_k` follow Lightning's `ModelCheckpoint` (2.6) exactly: in step order, a
    checkpoint joins while fewer than `top_k` are kept; after that only a strictly better value
    replaces the worst kept one (among equally worst, the first kept). So with ties the first
    checkpoints stay, and the best (the first with the best value) is never deleted.

    An orbax `PreservationPolicy`: orbax deletes the others only after the newest save has
    committed, so a failed or interrupted save never deletes anything.
    """

    monitor: str | None = None
    mode: str = "min"
    top_k: int = 1
    keep_last: bool = True
    pinned: set = dataclasses.field(default_factory=set)
    #: step -> monitored value of the best `top_k` (Lightning's `best_k_models`, in the order
    #: they joined), as of the last policy decision.
    best_k: dict = dataclasses.field(default_factory=dict)

    def value(self, info) -> float | None:
        metrics = getattr(info, "metrics", None) or {}
        v = metrics.get(self.monitor) if self.monitor else None
        return float(v) if is_finite(v) else None

    def _best_k(self, checkpoints: Sequence[Any]) -> dict:
        """Lightning's top-k over the surviving checkpoints, in step order. (The survivors are
        the kept ones plus the newest: replaying them reproduces the decisions made when each
        was saved, as deleted ones never return.)"""
        k = len(checkpoints) if self.top_k < 0 else self.top_k
        best: dict = {}
        for info in sorted(checkpoints, key=lambda c: c.step):
            join_best(best, info.step, self.value(info), k, self.mode)
        return best

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> list[bool]:
        del context
        n = len(checkpoints)
        keep = [info.step in self.pinned for info in checkpoints]
        if not n:
            return keep
        if self.monitor is not None:
            self.best_k = self._best_k(checkpoints)
        if self.top_k < 0:  # keep all, scored or not (a save before the monitor was logged too)
            return [True] * n
        if self.keep_last:
            keep[max(range(n), key=lambda i: checkpoints[i].step)] = True
        if self.monitor is None:
            ranked = sorted(range(n), key=lambda i: -checkpoints[i].step)[: self.top_k]
        else:
            ranked = [i for i in range(n) if checkpoints[i].step in self.best_k]
        for i in ranked:
            keep[i] = True
        return keep


# -- writing -------------------------------------------------------------------------------------


class CheckpointWriter:
    """An orbax `CheckpointManager` over one directory with jaxlight's retention policy.

    Saves are asynchronous by default. In a single process, `save` dispatches a device-side
    snapshot of the state (a jitted copy, so the next step may donate the state's buffers)
    and its checksums, and hands the rest to a background thread: orbax's device-to-host copy of
    the snapshot, its write and its commit (a rename). The loop waits only for dispatches. With
    several processes (orbax's save synchronizes the processes with device collectives, which
    must not interleave with the training step's), or when a device lacks the free memory for
    the snapshot, `save` runs orbax's blocking part (the copy to host) in the loop and only the
    write and commit in the background.

    At most one save is in flight: a new save first waits for the previous one's copy to host
    (and orbax, before it copies, for the previous commit), so checkpointing holds at most one
    device snapshot and one host copy of this process's shards.
    """

    def __init__(self, dirpath: str, *, monitor: str | None = None, mode: str = "min",
                 save_top_k: int = 1, save_last: bool = True, async_save: bool = True,
                 compress: bool = False):
        orbax = ocp()
        self.dirpath = os.path.abspath(dirpath)
        # Before orbax opens the directory: its start-up deletes unfinished saves, which may be
        # another live run's.
        self._lock = DirectoryLock.for_job(self.dirpath)
        self.monitor = monitor
        self.retention = Retention(monitor, mode, save_top_k, save_last)
        options = orbax.CheckpointManagerOptions(
            create=True,
            cleanup_tmp_directories=True,  # unfinished saves of a killed run
            enable_async_checkpointing=async_save,
            preservation_policy=self.retention,
            # best_fn only makes orbax write and reload the `metrics` item the retention reads.
            best_fn=(lambda m: m.get(monitor)) if monitor else None,
            best_mode=mode,
            # Older steps are deleted in orbax's own thread, not in the next save's path
            # (close() waits for them).
            enable_background_delete=True,
            # The step directory is made in the save call, so a directory that cannot be made
            # (a read-only disk) fails that save, instead of leaving orbax's writer threads
            # waiting (20 minutes) for a creation signal that never comes.
            async_options=orbax.AsyncOptions(create_directories_asynchronously=False),
        )
        # The state item is plain orbax PyTree (what StandardSave writes), with orbax's zstd only
        # on request: it saves ~8% of a float32 train state's bytes and costs ~25% of a save's
        # CPU time, which on a busy host is what holds the loop (docs/checkpoints.md).
        handlers = {STATE_ITEM: orbax.PyTreeCheckpointHandler(
                        use_compression=compress, type_handler_registry=type_handlers()),
                    META_ITEM: orbax.JsonCheckpointHandler(),
                    _verify.CHECKSUM_ITEM: _verify.handler()}
        try:
            self.manager = orbax.CheckpointManager(self.dirpath, options=options,
                                                   item_handlers=handlers)
        except Exception as exc:  # noqa: BLE001 - re-raised with the directory
            self._lock.release()
            raise CheckpointError(
                f"cannot open checkpoint directory {self.dirpath}: {exc}") from exc
        self.last_saved_step: int | None = None
        self._writing: int | None = None  # the step whose write orbax runs in the background
        self._needed: dict[int, int] = {}  # bytes each started save writes, about
        self._moved_aside_seen = _verify.moved_aside_count
        self._warned_exists: set[int] = set()
        self._failed = False
        # orbax's blocking part of an asynchronous save runs here (single process only).
        self._thread = (concurrent.futures.ThreadPoolExecutor(1, "jaxlight-checkpoint")
                        if async_save and jax.process_count() == 1 else None)
        self._handing_over: concurrent.futures.Future | None = None

    def step_dir(self, step: int) -> str:
        return os.path.join(self.dirpath, str(step))

    def save(self, fit, module, monitor_value: float | None = None, *,
             pin: bool = False) -> bool:
        """Starts saving the current state under `fit.global_step`; False if already saved."""
        orbax = ocp()
        step = int(fit.global_step)
        if step == self.last_saved_step:
            return False
        self._wait_handed_over()  # the manager is not touched by two threads at once
        if self._thread is not None and not self.manager.is_saving_in_progress():
            self._wait_committed()  # finished already: a failed write is reported now
        self._check_directory()
        if self._moved_aside_seen != _verify.moved_aside_count:
            # A resume moved a damaged step aside: re-list, so that step is written again.
            self._moved_aside_seen = _verify.moved_aside_count
            self.manager.reload()
        if step in self.manager.all_steps():
            if step not in self._warned_exists:
                self._warned_exists.add(step)
                warnings.warn(
                    f"checkpoint step {step} already exists in {self.dirpath} (from an earlier "
                    "run); it is kept and not overwritten.", stacklevel=3)
            return False
        if fit.state is None:
            return False
        tree = state_tree(fit.strategy.to_canonical(fit.state))
        mask, frozen = fit.session.spec.frozen, None
        if _frozen.has_frozen(mask):
            # configure_model rebuilds them on restore; their fingerprints prove it did.
            frozen = _frozen.records(_frozen.select(tree["rest"], mask, True))
            tree["rest"] = _frozen.select(tree["rest"], mask, False)
        tree, key_impls = unwrap_keys(tree)
        # Dispatched now, read by orbax's writer thread: the loop does not wait for them.
        in_background = self._thread is not None and room_for_snapshot(tree)
        if in_background:
            tree, digests = _verify.snapshot_with_digests(tree)
        else:
            digests = _verify.start_digests(tree)
        record = None
        if self.monitor is not None:
            record = {"name": self.monitor, "value": monitor_value,
                      "mode": self.retention.mode}
        meta = build_meta(fit, module, key_impls, record, frozen)
        meta["checksums"] = True  # a step without its checksums item is then known damaged
        metrics = None
        if self.monitor is not None:  # an empty record: saved before the metric existed
            metrics = {} if monitor_value is None else {self.monitor: monitor_value}
        if pin:
            self.retention.pinned.add(step)
        self._needed[step] = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(tree))
        args = orbax.args.Composite(**{STATE_ITEM: orbax.args.PyTreeSave(tree),
                                       META_ITEM: orbax.args.JsonSave(meta),
                                       _verify.CHECKSUM_ITEM: _verify.save_args(digests)})
        if in_background:
            self._handing_over = self._thread.submit(self._hand_over, step, args, metrics)
        else:
            self._hand_over(step, args, metrics)
        self.last_saved_step = step
        return True

    def _hand_over(self, step: int, args, metrics) -> None:
        """orbax's save: waits for the previous commit, copies the state to host, and starts the
        write and commit in orbax's own thread (all of it, when saving synchronously)."""
        self._wait_committed()  # orbax would wait too; this reports a failed save as such
        try:
            self.manager.save(step, args=args, metrics=metrics, force=True)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            self._failed = True
            raise CheckpointError(
                f"saving checkpoint step {step} to {self.dirpath} failed: "
                f"{self._reason(exc, step)}. Checkpoints saved before are untouched: "
                f"{complete_steps(self.dirpath)}."
            ) from exc
        self._writing = step

    def _wait_handed_over(self) -> None:
        """Blocks until the save handed to the background thread reached orbax; raises its
        CheckpointError if it failed there."""
        pending, self._handing_over = self._handing_over, None
        if pending is not None:
            try:
                pending.result()
            except Exception:
                self._failed = True
                raise

    def check_failed(self) -> None:
        """Raises the CheckpointError of a save that failed in the background thread; does not
        wait (the loop calls it after every step)."""
        pending = self._handing_over
        if pending is not None and pending.done() and pending.exception() is not None:
            self._wait_handed_over()

    def wait(self) -> None:
        """Blocks until the save in flight has committed; raises CheckpointError if it failed."""
        self._wait_handed_over()
        self._wait_committed()

    def _wait_committed(self) -> None:
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            self._failed = True
            step, self._writing = self._writing, None
            what = "" if step is None else f" (step {step})"
            raise CheckpointError(
                f"an asynchronous checkpoint save to {self.dirpath}{what} failed: "
                f"{self._reason(exc, step)}. Checkpoints saved before are untouched: "
                f"steps {complete_steps(self.dirpath)}."
            ) from exc
        self._writing = None

    def _reason(self, exc: BaseException, step: int | None) -> str:
        """What went wrong, in jaxlight's words where the cause is a known disk fault."""
        return disk_fault(exc, self.dirpath, self._needed.get(step, 0)
                          if step is not None else 0)

    def _check_directory(self) -> None:
        """A directory removed while the run saves into it is made again, with a warning.

        Every process takes the same branch (re-taking the lock is a collective): the directory
        counts as removed when any process finds it gone."""
        if not any(_distributed.all_gather_json("checkpoint_directory_gone",
                                                not os.path.isdir(self.dirpath))):
            return
        held = self.manager.all_steps()
        warnings.warn(
            f"the checkpoint directory {self.dirpath} was removed while this run was saving "
            f"into it (it held steps {sorted(held)}, now lost); it is made again for the next "
            "save. If that was not meant, check what cleans up the disk, or stop the run "
            "and point ModelCheckpoint(dirpath=...) elsewhere.", JaxlightWarning, stacklevel=4)
        os.makedirs(self.dirpath, exist_ok=True)
        self._lock.release()
        self._lock = DirectoryLock.for_job(self.dirpath)
        self.manager.reload()

    def close(self) -> None:
        """Waits for the save in flight and releases orbax's threads.

        A failure already raised by `wait` or `save` is not raised again (close runs in
        teardown, where it would hide the exception being handled).
        """
        reported = self._failed
        try:
            self.wait()
        except CheckpointError:
            if not reported:
                raise
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
            try:
                self.manager.close()  # also waits for orbax's deletions of older steps
            except Exception as exc:  # noqa: BLE001 - a failure already reported by wait()
                if not self._failed:
                    raise CheckpointError(
                        f"closing the checkpoint directory {self.dirpath} failed: "
                        f"{type(exc).__name__}: {exc}. This is where orbax's background "
                        "deletions of steps that fell out of retention end; nothing saved is "
                        f"lost: the complete checkpoints there are steps "
                        f"{complete_steps(self.dirpath)}. Delete the ones you do not need by "
                        "hand, and check the directory's permissions."
                    ) from exc
            finally:
                self._lock.release()


#: A device-side snapshot is taken only where it fits in this fraction of the free memory.
SNAPSHOT_HEADROOM = 0.9


def room_for_snapshot(tree: Any) -> bool:
    """Whether every device has the free memory for a copy of its shards of `tree`. Devices
    that report no memory statistics (CPU: the copy is host memory) always have."""
    need: dict = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            shard = math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for device in x.sharding.device_set:
                need[device] = need.get(device, 0) + shard
    for device, nbytes in need.items():
        stats = device.memory_stats()
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            if nbytes > SNAPSHOT_HEADROOM * free:
                return False
    return True
