"""TQDMProgressBar: training progress with loss and steps/s (process 0 only)."""

from __future__ import annotations

import sys
import time
from typing import Any

import jax

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback
from jaxlight.sharding._batch import len_or_none


def total_steps(fit) -> int | None:
    """The optimizer steps this fit will take: `max_steps`, or `max_epochs` times the batches
    per epoch (after `limit_train_batches`) when the data has a length; None when unknown."""
    max_steps = None if fit.max_steps == -1 else fit.max_steps
    if fit.max_epochs is None:
        return max_steps
    if (per_epoch := len_or_none(fit.train_data)) is None:
        return max_steps
    limit = fit.limit_train_batches
    if isinstance(limit, float):
        per_epoch = max(1, int(per_epoch * limit))
    elif limit is not None:
        per_epoch = min(per_epoch, int(limit))
    total = fit.max_epochs * per_epoch
    return total if max_steps is None else min(total, max_steps)


class TQDMProgressBar(Callback):
    """Training progress on stderr: a tqdm bar on a terminal, plain lines in a log file.

    On a terminal the bar redraws at most once every `mininterval` seconds (however fast the
    steps are), with the last logged loss, validation metrics and steps/s. When stderr is not a
    terminal (a log file, a pipe, a batch job) it prints one plain line at most every
    `print_interval` seconds, at log intervals, and one at the end. The total is `max_steps`,
    or under `max_epochs` the epochs times the batches per epoch. When training stops before
    its end (early stopping, the non-finite guard, preemption, `fit.request_stop`) it prints
    one line saying why. Updating never reads device values.

    Args:
        refresh_rate: steps between updates of the bar's count.
        leave: keep the bar on the terminal after training.
        mininterval: least seconds between two redraws of the bar.
        print_interval: least seconds between two plain lines (not a terminal).

    Example:
        >>> bar = TQDMProgressBar(mininterval=1.0, print_interval=60.0)
    """

    #: How metric values are shown (RichProgressBar: its theme's `metrics_format`).
    metrics_format = ".4g"

    def __init__(self, refresh_rate: int = 1, leave: bool = True, mininterval: float = 0.25,
                 print_interval: float = 30.0):
        for name, value in (("refresh_rate", refresh_rate), ("mininterval", mininterval),
                            ("print_interval", print_interval)):
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or (
                    name == "refresh_rate" and (not isinstance(value, int) or value < 1)):
                raise ConfigurationError(
                    f"TQDMProgressBar({name}={value!r}): give a "
                    f"{'positive int' if name == 'refresh_rate' else 'number of seconds >= 0'}."
                )
        self.refresh_rate = refresh_rate
        self.leave = leave
        self.mininterval = mininterval
        self.print_interval = print_interval
        self._bar = None
        self._stream = None
        self._plain = False
        self._total: int | None = None
        self._t0 = 0.0
        self._step0 = 0
        self._last_line = 0.0
        self._shown: dict[str, str] = {}
        self._told_stop = False

    # -- start ---------------------------------------------------------------------------------

    def on_train_start(self, fit, module) -> None:
        if jax.process_index() != 0:
            return
        self._stream = sys.stderr
        self._total = total_steps(fit)
        self._t0, self._step0 = time.perf_counter(), fit.global_step
        self._last_line = self._t0
        self._shown = {}
        self._told_stop = False
        self._plain = not self._is_terminal()
        if self._plain:
            self._line(fit, "train: started")
            return
        self._bar = self._make_bar(fit)

    def _is_terminal(self) -> bool:
        isatty = getattr(self._stream, "isatty", None)
        return callable(isatty) and isatty()

    def _make_bar(self, fit):
        """The terminal's bar: `n`, `desc`, `update(k)`, `set_description(text, refresh)`,
        `set_postfix(dict, refresh)`, `refresh()`, `close()` (tqdm's; RichProgressBar's own)."""
        from tqdm.auto import tqdm  # optional: only a terminal needs it

        return tqdm(total=self._total, initial=fit.global_step,
                    desc=f"epoch {fit.current_epoch}", dynamic_ncols=True, leave=self.leave,
                    file=self._stream, mininterval=self.mininterval)

    # -- progress ------------------------------------------------------------------------------

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx) -> None:
        if self._bar is None or fit.global_step % self.refresh_rate:
            return
        desc = f"epoch {fit.current_epoch}"
        if self._bar.desc != desc:
            self._bar.set_description(desc, refresh=False)
        # update() redraws only when mininterval has passed (refresh() would redraw each call).
        self._bar.update(fit.global_step - self._bar.n)

    def on_log(self, fit, module, metrics, step) -> None:
        if self._stream is None:
            return
        self._shown.update((k, f"{v:{self.metrics_format}}") for k, v in metrics.items()
                           if self._shows(fit, k))
        elapsed = time.perf_counter() - self._t0
        if elapsed > 0 and step > self._step0:
            self._shown["steps/s"] = f"{(step - self._step0) / elapsed:.2f}"
        if self._bar is not None:
            self._bar.set_postfix(self._shown, refresh=False)  # shown at the next redraw
        elif self._plain and time.perf_counter() - self._last_line >= self.print_interval:
            self._line(fit, "train:", step)

    @staticmethod
    def _shows(fit, name: str) -> bool:
        """The loss, and what the module logged with `prog_bar=True`; without any such log,
        every validation metric (`val_*`)."""
        picked = fit.progress_bar_metrics
        return name == "loss" or name in picked or (not picked and name.startswith("val_"))

    # -- end -----------------------------------------------------------------------------------

    def on_train_end(self, fit, module) -> None:
        if self._stream is None:
            return
        if self._bar is not None:
            self._bar.update(fit.global_step - self._bar.n)
            self._bar.refresh()
        elif self._plain:
            self._line(fit, f"train: finished in {time.perf_counter() - self._t0:.1f} s,")
        self._close()
        self._tell_stop(fit, fit.stop_reason)

    def on_exception(self, fit, module, exception) -> None:
        if self._stream is None:
            return
        self._close()
        # A guard's error (TrainingStopped) or a preemption (Preempted) sets the reason; any
        # other exception prints its own traceback.
        self._tell_stop(fit, fit.stop_reason)
        self._stream = None

    def teardown(self, fit, module, stage: str) -> None:
        self._close()
        self._stream = None

    # -- helpers -------------------------------------------------------------------------------

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _position(self, fit, step: int | None = None) -> str:
        step = fit.global_step if step is None else step
        if self._total:
            return f"step {step}/{self._total} ({100 * step / self._total:.0f}%)"
        return f"step {step}"

    def _line(self, fit, head: str, step: int | None = None) -> None:
        # Training metrics reach on_log one step late: the line names the step they are from.
        parts = [f"{head} {self._position(fit, step)}, epoch {fit.current_epoch}"]
        parts += [f"{k} {v}" for k, v in self._shown.items()]
        print(", ".join(parts), file=self._stream, flush=True)
        self._last_line = time.perf_counter()

    def _tell_stop(self, fit, reason: Any) -> None:
        if not reason or self._told_stop or self._stream is None:
            return
        reason = str(reason)
        if reason.startswith("error:"):
            reason = reason[len("error:"):].strip()
        print(f"training stopped at {self._position(fit)}: {reason}", file=self._stream,
              flush=True)
        self._told_stop = True
