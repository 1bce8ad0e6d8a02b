"""LoopState: where the training loop is (step, epoch, batch) and whether it should stop."""

from __future__ import annotations

import dataclasses

from jaxlight import distributed as _distributed


@dataclasses.dataclass
class LoopState:
    """The loop's position and stop request; `Fit` exposes it read-only to callbacks.

    Attributes:
        global_step: optimizer steps taken so far.
        epoch: the current epoch (0-based).
        batch_idx: batches consumed in the current epoch.
        stop_reason: why training should stop (None: keep going); a reason starting with
            "error:" ends `fit` with `TrainingStopped`.
        agreed_stop: with several processes, the stop every process adopted (the loop obeys
            this one, so that all leave at the same step).
        multi_process: whether stops need cross-process agreement.
    """

    global_step: int = 0
    epoch: int = 0
    batch_idx: int = 0
    stop_reason: str | None = None
    agreed_stop: str | None = None
    multi_process: bool = False

    def start(self, *, multi_process: bool) -> None:
        """Clears stop requests at the start of a `fit` (the position is set separately)."""
        self.stop_reason = None
        self.agreed_stop = None
        self.multi_process = multi_process

    def move_to(self, global_step: int, epoch: int, batch_idx: int) -> None:
        """Places the loop at a position (0, 0, 0 for a fresh fit, a checkpoint's on resume)."""
        self.global_step, self.epoch, self.batch_idx = global_step, epoch, batch_idx

    def request_stop(self, reason: str) -> None:
        """Records the first stop request; later ones keep the first reason."""
        if self.stop_reason is None:
            self.stop_reason = reason

    @property
    def should_stop(self) -> bool:
        return self.stop_reason is not None

    @property
    def effective_stop(self) -> str | None:
        """The stop the loop obeys: this process's own, or with several processes the agreed."""
        return self.agreed_stop if self.multi_process else self.stop_reason

    def agree_stop(self) -> None:
        """Multi-process: every process adopts a stop that any process requested."""
        if self.agreed_stop is None:
            self.agreed_stop = _distributed.agree_stop(self.stop_reason)
            if self.agreed_stop is not None:
                self.stop_reason = self.agreed_stop
