"""Profiler: a jax.profiler trace of chosen steps, host timing per step, compile times."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import time
import warnings

import jax

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback
from jaxlight.callbacks._logdir import ensure_writable


class Profiler(Callback):
    """Traces training steps `start_step .. start_step + num_steps - 1` with `jax.profiler`.

    The trace (`<logdir>/plugins/profile/<run>/*.xplane.pb` and a `*.trace.json.gz` that
    Perfetto opens) shows every device kernel and host event of those steps, each step marked
    with a `StepTraceAnnotation`; open it with `tensorboard --logdir <logdir>` (profile plugin)
    or at ui.perfetto.dev.

    For every traced step it also times the host, in milliseconds:

    - `data_wait`: from the end of the previous step to the start of this one (the data
      iterator, batch checks and callbacks' batch-start hooks);
    - `dispatch`: putting the batch on the devices and launching the step (asynchronous);
    - `device`: waiting for the step's results once it was launched;
    - `step`: the sum.

    To attribute time cleanly the profiler waits for each traced step to finish (and for the
    one before the window), so the traced steps do not overlap; outside the window nothing
    waits. On the CPU backend a small step runs inside the launching call, so its compute
    shows as `dispatch` and `device` is near zero; accelerators launch asynchronously.

    It also reports the compile time of each compiled function (`Fit.compile_times`).
    Everything goes to `<logdir>/host_timing.json`, is printed at the end of the window, and
    the means are logged as `profiler/*_ms`, compile times as `compile_time/<kind>`.

    Every process traces its own devices (into `<logdir>/process_<i>` when there are several).

    Args:
        start_step: the first optimizer step to trace (1-based; later steps skip warm-up).
        num_steps: how many steps to trace.
        logdir: where traces go (default: `<Fit.default_root_dir>/profile`).

    Example:
        >>> profiler = Profiler(start_step=5, num_steps=3, logdir="profile")
    """

    def __init__(self, start_step: int = 5, num_steps: int = 3, logdir: str | None = None):
        for name, value in (("start_step", start_step), ("num_steps", num_steps)):
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"Profiler({name}={value!r}): must be an integer >= 1.")
        self.start_step = start_step
        self.num_steps = num_steps
        self.logdir = logdir
        self.trace_dir: str | None = None
        #: Per traced step: step, data_wait_ms, dispatch_ms, device_ms, step_ms.
        self.step_timings: list[dict[str, float]] = []
        #: Seconds per compiled function, from `Fit.compile_times`.
        self.compile_times: dict[str, float] = {}
        self._tracing = False
        self._done = False
        self._annotation = None
        self._t_prev_end: float | None = None
        self._t_start = 0.0

    @property
    def last_step(self) -> int:
        return self.start_step + self.num_steps - 1

    def setup(self, fit, module, stage: str) -> None:
        if stage != "fit":
            return
        root = self.logdir or os.path.join(fit.default_root_dir, "profile")
        if jax.process_count() > 1:
            root = os.path.join(root, f"process_{jax.process_index()}")
        self.trace_dir = ensure_writable(root, "Profiler")
        max_steps = None if fit.max_steps == -1 else fit.max_steps
        if max_steps is not None and self.start_step > max_steps:
            warnings.warn(
                f"Profiler(start_step={self.start_step}) is beyond max_steps={max_steps}: no "
                f"step will be traced. Use start_step <= {max(1, max_steps - self.num_steps + 1)}"
                f" to trace {self.num_steps} step(s).", stacklevel=2)
        elif max_steps is not None and self.last_step > max_steps:
            warnings.warn(
                f"Profiler(start_step={self.start_step}, num_steps={self.num_steps}) ends at "
                f"step {self.last_step}, beyond max_steps={max_steps}: only "
                f"{max_steps - self.start_step + 1} step(s) will be traced.", stacklevel=2)

    def on_train_start(self, fit, module) -> None:
        self._t_prev_end = time.perf_counter()
        self._log_compile_times(fit)

    def _log_compile_times(self, fit) -> None:
        new = {k: v for k, v in fit.compile_times.items() if self.compile_times.get(k) != v}
        self.compile_times.update(fit.compile_times)
        if new:
            fit.log_metrics({f"compile_time/{k}": v for k, v in new.items()}, fit.global_step)

    def on_train_batch_start(self, fit, module, batch, batch_idx) -> None:
        step = fit.global_step + 1
        if step == self.start_step and not self._done and not self._tracing:
            try:
                jax.profiler.start_trace(self.trace_dir)
            except RuntimeError as exc:  # another trace is running in this process
                warnings.warn(f"Profiler could not start a trace: {exc}", stacklevel=2)
                self._done = True
                return
            self._tracing = True
        if self._tracing:
            self._t_start = time.perf_counter()
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._annotation.__enter__()

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx) -> None:
        step = fit.global_step
        if step == self.start_step - 1 and not self._done:
            # Let the step before the window finish, so the first traced step starts alone.
            jax.block_until_ready(outputs.metrics)
            self._t_prev_end = time.perf_counter()
            return
        if not self._tracing:
            return
        dispatched = time.perf_counter()
        jax.block_until_ready(outputs.metrics)
        done = time.perf_counter()
        self._annotation.__exit__(None, None, None)
        self._annotation = None
        data_wait = self._t_start - (self._t_prev_end or self._t_start)
        self.step_timings.append({
            "step": step,
            "data_wait_ms": 1e3 * data_wait,
            "dispatch_ms": 1e3 * (dispatched - self._t_start),
            "device_ms": 1e3 * (done - dispatched),
            "step_ms": 1e3 * (done - self._t_start + data_wait),
        })
        self._t_prev_end = done
        if step >= self.last_step:
            self._stop(fit)

    def on_validation_end(self, fit, module) -> None:
        # Validation between two steps is not the next step's data wait.
        self._t_prev_end = time.perf_counter()
        self._log_compile_times(fit)

    def _stop(self, fit) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        if self._tracing:
            if fit.state is not None:
                jax.block_until_ready(fit.state)
            jax.profiler.stop_trace()
            self._tracing = False
            self._done = True
            self._report(fit)

    def mean_timings(self) -> dict[str, float]:
        """Mean of each timing over the traced steps."""
        if not self.step_timings:
            return {}
        keys = [k for k in self.step_timings[0] if k != "step"]
        n = len(self.step_timings)
        return {k: sum(t[k] for t in self.step_timings) / n for k in keys}

    @property
    def trace_files(self) -> list[str]:
        """The trace files written (`*.xplane.pb`, `*.trace.json.gz`)."""
        if self.trace_dir is None:
            return []
        return sorted(glob.glob(os.path.join(self.trace_dir, "plugins", "profile", "*", "*")))

    def _report(self, fit) -> None:
        means = self.mean_timings()
        report = {"steps": self.step_timings, "mean": means, "compile_times_s": self.compile_times,
                  "trace_files": self.trace_files}
        with open(os.path.join(self.trace_dir, "host_timing.json"), "w") as f:
            json.dump(report, f, indent=2)
        if means:
            fit.log_metrics({f"profiler/{k}": v for k, v in means.items()}, fit.global_step)
        if jax.process_index() == 0:
            lines = [f"jaxlight: profiled steps {self.start_step}-{self.step_timings[-1]['step']}"
                     if self.step_timings else "jaxlight: profiler trace stopped (no step)",
                     "  step  data_wait_ms  dispatch_ms  device_ms  step_ms"]
            lines += [f"  {int(t['step']):>4}  {t['data_wait_ms']:>12.2f}  "
                      f"{t['dispatch_ms']:>11.2f}  {t['device_ms']:>9.2f}  {t['step_ms']:>7.2f}"
                      for t in self.step_timings]
            lines.append("  compile: " + ", ".join(f"{k} {v:.2f}s"
                                                  for k, v in self.compile_times.items()))
            lines.append(f"  trace: {self.trace_dir}  (tensorboard --logdir {self.trace_dir})")
            print("\n".join(lines), file=sys.stderr)

    def on_train_end(self, fit, module) -> None:
        self._stop(fit)

    def on_exception(self, fit, module, exception) -> None:
        if self._tracing:
            with contextlib.suppress(Exception):  # the original exception matters more
                self._stop(fit)

    def teardown(self, fit, module, stage: str) -> None:
        if stage == "fit" and self.trace_dir is not None and not self._tracing:
            self.compile_times.update(fit.compile_times)  # eval steps compile later
            self._log_compile_times_file()

    def _log_compile_times_file(self) -> None:
        path = os.path.join(self.trace_dir, "host_timing.json")
        report = {}
        if os.path.exists(path):
            with open(path) as f:
                report = json.load(f)
        report["compile_times_s"] = self.compile_times
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
