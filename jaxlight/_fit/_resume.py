"""Resuming: a fit adopts a restored checkpoint (the checkpoint code only reads it)."""

from __future__ import annotations

import os

import jax

from jaxlight._fit._loop_state import LoopState
from jaxlight._fit._session import Session
from jaxlight.callbacks._checkpoint import ModelCheckpoint
from jaxlight.checkpoint._paths import CheckpointLocation, default_dirpath
from jaxlight.checkpoint._restore import Restored
from jaxlight.data._feed import TrainFeed


def checkpoint_locations(fit) -> list[CheckpointLocation]:
    """Each ModelCheckpoint's directory, or `<default_root_dir>/checkpoints` without one."""
    found = [CheckpointLocation(os.path.abspath(cb.resolved_dirpath(fit)), cb.monitor, cb.mode,
                                best=cb.best_model_path)
             for cb in fit.callbacks if isinstance(cb, ModelCheckpoint)]
    return found or [CheckpointLocation(default_dirpath(fit), default=True)]


def adopt_checkpoint(restored: Restored, fit, session: Session, position: LoopState,
                     feed: TrainFeed, epoch_length: int | None, hooks) -> None:
    """Takes over a checkpoint's state, loop position, loader position and callbacks' states.

    `epoch_length` is the training batches per epoch (None when the data has no len());
    `hooks` runs `on_load_checkpoint` on the module and the callbacks.
    """
    session.state = restored.state
    meta = restored.meta
    step, epoch, batch_idx = restored.position
    feed.restore(meta.get("loader"))
    # A checkpoint taken after an epoch's last batch resumes at the start of the next epoch
    # (that epoch's end-of-epoch hooks and validation had run, or are skipped).
    if epoch_length is not None and batch_idx >= epoch_length:
        epoch, batch_idx = epoch + 1, 0
    position.move_to(step, epoch, batch_idx)
    states = meta.get("callbacks", {})
    for cb in fit.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
    hooks("on_load_checkpoint", meta)  # the module's hook first, then the callbacks
    if jax.process_index() == 0:
        print(f"jaxlight: resumed from {restored.step_dir} (step {step}, epoch {epoch}, "
              f"batch {batch_idx}).", flush=True)
