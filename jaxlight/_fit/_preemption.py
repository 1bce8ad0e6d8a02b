"""Preemption: on SIGTERM or SIGUSR1, finish the step, checkpoint, wait for the commit, exit.

Clusters announce an eviction with SIGTERM (Kubernetes, TPU VMs, most schedulers) or, with
`sbatch --signal=USR1@90`, SLURM's SIGUSR1, some seconds before they kill the job. The training
loop owns a `PreemptionHandler` (it is not a callback): during `fit` it catches those signals,
and after the training step in progress (every callback's `on_train_batch_end` included) it
saves a checkpoint through the first `ModelCheckpoint` (or under `<default_root_dir>/checkpoints`),
blocks until orbax has committed it, prints how to resume, and raises `Preempted`, a
`SystemExit` with status 128 + the signal number (143 for SIGTERM, 138 for SIGUSR1), the status
of a process ended by that signal.

With several processes all of them must save the same step. JAX's distributed runtime
(`jax.distributed.initialize`) already watches SIGTERM and agrees on a step through its
coordination service; the handler then asks `jaxlight.distributed.reached_preemption_sync_point`
after each step (a local flag read until a notice arrives) and turns SIGUSR1 into that same
notice. Without that service (`jax_enable_preemption_service=False`) it falls back to its own
flag, agreed on at log intervals only (`jaxlight.distributed.agree_stop`, one barrier per
interval; never a per-step host sync).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

import jax

from jaxlight import distributed
from jaxlight.callbacks._checkpoint import ModelCheckpoint
from jaxlight.checkpoint._paths import default_dirpath
from jaxlight.checkpoint._writer import CheckpointWriter

#: The signals treated as a preemption notice.
SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None))
                if s is not None)


class Preempted(SystemExit):
    """Raised (after a committed checkpoint) when a preemption signal stopped training."""

    def __init__(self, signum: int, message: str, checkpoint: str):
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return self.message


def _sync_manager() -> Any:
    try:
        # JAX's private module, looked up only when needed: it may move between JAX versions.
        from jax._src import distributed as jax_distributed

        return jax_distributed.global_state.preemption_sync_manager
    except Exception:  # noqa: BLE001 - private API moved: use the fallback
        return None


class PreemptionHandler:
    """Turns SIGTERM/SIGUSR1 into checkpoint-and-exit after the current step (see module doc).

    `Fit.fit` calls `install()` after the callbacks' `setup`, `after_step(fit, module)` after
    every step's `on_train_batch_end` hooks, and `restore()` after their `teardown`.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._use_sync_manager = False

    # -- signal handlers ---------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        del frame
        if self.signum is None:
            self.signum = signum
            if jax.process_index() == 0:
                print(f"jaxlight: received {signal.Signals(signum).name}; saving a checkpoint "
                      "after the current step.", file=sys.stderr, flush=True)

    def _forward_to_jax(self, signum, frame) -> None:
        """SIGUSR1 with JAX's preemption service: raise the notice the service listens for."""
        self._on_signal(signum, frame)
        os.kill(os.getpid(), signal.SIGTERM)

    def install(self) -> None:
        """Catches the preemption signals (main thread only: Python delivers them there)."""
        self.signum = None
        if threading.current_thread() is not threading.main_thread():
            return
        self._use_sync_manager = jax.process_count() > 1 and _sync_manager() is not None
        for sig in SIGNALS:
            if self._use_sync_manager and sig == signal.SIGTERM:
                continue  # JAX's runtime owns SIGTERM and propagates it to every process
            handler = self._forward_to_jax if self._use_sync_manager else self._on_signal
            self._previous[sig] = signal.signal(sig, handler)

    def restore(self) -> None:
        """Puts back the signal handlers `install` replaced."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    # -- after each step -----------------------------------------------------------------------

    def _triggered(self, fit) -> bool:
        if jax.process_count() == 1:
            return self.signum is not None
        if self._use_sync_manager:
            if distributed.reached_preemption_sync_point(fit.global_step):
                self.signum = self.signum or signal.SIGTERM
                return True
            return False
        if fit.global_step % fit.log_every_n_steps:
            return False
        # Every process calls this at the same log steps (one coordination-service barrier).
        agreed = distributed.agree_stop(f"preempted {self.signum}" if self.signum else None)
        if agreed is None:
            return False
        self.signum = self.signum or int(agreed.split()[1])
        return True

    def after_step(self, fit, module) -> None:
        """After a step's hooks: on a (agreed) preemption notice, save, wait, raise Preempted."""
        if not self._triggered(fit):
            return
        path = save_on_preemption(fit, module)
        name = signal.Signals(self.signum).name
        message = (
            f"jaxlight: stopped by {name} after step {fit.global_step}; checkpoint {path} is "
            "committed. Resume with the same script and fit.fit(module, train_data, val_data, "
            f"ckpt_path='last') (same ModelCheckpoint dirpath / default_root_dir), or "
            f"ckpt_path={path!r}."
        )
        if jax.process_index() == 0:
            print(message, file=sys.stderr, flush=True)
        fit.request_stop(f"preempted by {name}")
        raise Preempted(self.signum, message, path)


def save_on_preemption(fit, module) -> str:
    """Saves the current state (through the first ModelCheckpoint, or under
    `<default_root_dir>/checkpoints`) and waits for the commit; returns the step directory."""
    for cb in fit.callbacks:
        if isinstance(cb, ModelCheckpoint):
            return cb.save_now(fit, module, wait=True, pin=True)
    writer = CheckpointWriter(default_dirpath(fit), save_top_k=1, save_last=True,
                              async_save=False)
    try:
        writer.save(fit, module)
        writer.wait()
    finally:
        writer.close()
    return writer.step_dir(fit.global_step)
