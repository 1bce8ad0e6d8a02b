"""TQDMProgressBar: training progress with loss and steps/s (process 0 only)."""

from __future__ import annotations

import sys
import time

import jax

from jaxlight.callbacks._base import Callback


class TQDMProgressBar(Callback):
    """A tqdm bar over optimizer steps, updated at each step, with metrics at log intervals.

    Updating the bar's count never reads device values; the loss shown is the last logged one.

    Args:
        refresh_rate: steps between bar refreshes.
        leave: keep the bar after training.
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = True):
        self.refresh_rate = refresh_rate
        self.leave = leave
        self._bar = None
        self._t0 = None
        self._step0 = 0

    def on_train_start(self, fit, module) -> None:
        if jax.process_index() != 0:
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=fit.max_steps, initial=fit.global_step, desc="train",
                         dynamic_ncols=True, leave=self.leave, file=sys.stderr,
                         mininterval=0.25)
        self._t0, self._step0 = time.perf_counter(), fit.global_step

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx) -> None:
        if self._bar is not None and fit.global_step % self.refresh_rate == 0:
            self._bar.n = fit.global_step
            self._bar.set_description(f"epoch {fit.current_epoch}", refresh=False)
            self._bar.refresh()

    def on_log(self, fit, module, metrics, step) -> None:
        if self._bar is None:
            return
        elapsed = time.perf_counter() - self._t0
        shown = {k: f"{v:.4g}" for k, v in metrics.items() if self._shows(fit, k)}
        if elapsed > 0 and step > self._step0:
            shown["steps/s"] = f"{(step - self._step0) / elapsed:.2f}"
        self._bar.set_postfix(shown, refresh=True)

    @staticmethod
    def _shows(fit, name: str) -> bool:
        """The loss, and what the module logged with `prog_bar=True`; without any such log,
        every validation metric (`val_*`)."""
        picked = fit.progress_bar_metrics
        return name == "loss" or name in picked or (not picked and name.startswith("val_"))

    def on_train_end(self, fit, module) -> None:
        if self._bar is not None:
            self._bar.n = fit.global_step
            self._bar.close()
            self._bar = None

    def on_exception(self, fit, module, exception) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
