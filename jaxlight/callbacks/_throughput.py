"""ThroughputMonitor (samples/s, tokens/s, FLOP/s, MFU) and DeviceStatsMonitor (memory).

Both measure on the host and never wait for the device: the Fit already waits for step t-1
after dispatching step t, and reports a log step's metrics only once that step has finished, so
the wall time between two training log rounds is the time the device took for the steps in
between (or the host, if it is the bottleneck). Their figures reach the loggers through
`Fit.log_metrics` at the same step as the training metrics.
"""

from __future__ import annotations

import collections
import sys
import time
from typing import Any

import jax
import numpy as np

from jaxlight.analysis._flops import FlopCount, compiled_flops, device_peak_flops
from jaxlight.callbacks._base import Callback

_GIB = float(2**30)


def _is_training_round(metrics: dict) -> bool:
    # Training rounds carry the step's loss; validation, test and monitor rounds do not.
    return "loss" in metrics


def _mesh_devices(fit) -> int:
    mesh = getattr(fit.strategy, "mesh", None)
    return int(mesh.devices.size) if mesh is not None else jax.device_count()


class ThroughputMonitor(Callback):
    """Logs training throughput at every log step: steps, samples, tokens and FLOPs per second,
    and the model FLOPs utilization (MFU).

    - samples: the global batch size (leading dimension of the batch, times the processes);
    - tokens: `module.tokens_per_batch(batch)` when the module defines it (called with the
      batch this process loads, and multiplied by the number of processes);
    - FLOPs per step: `module.flops_per_batch(batch)` when the module declares them (model
      FLOPs of the global batch); otherwise the compiled step's `cost_analysis()` with every
      loop body counted once per iteration (`jaxlight.analysis._flops.compiled_flops`), summed over
      the mesh's devices. The compiled count is what the devices execute: recomputation
      (remat) included, and work every device repeats (the optimizer update of replicated
      parameters under data parallelism) counted on each;
    - MFU: achieved FLOP/s over the mesh's peak, from `peak_flops_per_device` or a table of
      known accelerators (H100, H200, A100, TPU v4/v5e/v5p/v6e; dense bf16). Unknown
      devices (CPU) give no MFU unless a peak is passed.

    The window between two log rounds excludes validation. The first window includes the
    first step's one-off costs; `summary` (after training) averages every later window.

    Args:
        peak_flops_per_device: peak FLOP/s of one device, to override or extend the table.

    Example:
        >>> monitor = ThroughputMonitor(peak_flops_per_device=989e12)
    """

    def __init__(self, peak_flops_per_device: float | None = None):
        self.peak_flops_per_device = peak_flops_per_device
        #: FLOPs of one step on the whole mesh (None until known or when unavailable).
        self.flops_per_step: float | None = None
        #: The compiled step's count (per device), when FLOPs come from the compiled step.
        self.flop_count: FlopCount | None = None
        #: Whole-run averages, set at the end of training.
        self.summary: dict[str, float] = {}
        self._reset()

    def _reset(self) -> None:
        self._per_step: collections.deque = collections.deque()  # (step, samples, tokens, flops)
        self._t_last = self._step_last = None
        self._paused = 0.0
        self._pause_start: float | None = None
        self._windows: list[tuple[float, int, float, float, float]] = []
        self._tokens = self._samples = None
        self._module_flops = False
        self._noted: set[str] = set()

    def _note(self, key: str, message: str) -> None:
        if key not in self._noted and jax.process_index() == 0:
            print(f"jaxlight: {message}", file=sys.stderr)
        self._noted.add(key)

    def peak(self) -> float | None:
        """Peak FLOP/s of one device: the user's value or the table's."""
        if self.peak_flops_per_device is not None:
            return float(self.peak_flops_per_device)
        return device_peak_flops(jax.devices()[0])

    def on_train_start(self, fit, module) -> None:
        self._reset()
        self._t_last, self._step_last = time.perf_counter(), fit.global_step
        self._devices = _mesh_devices(fit)
        self.flops_per_step, self.flop_count = None, None
        compiled = fit.compiled_train_step
        if compiled is not None:
            try:
                self.flop_count = compiled_flops(compiled)
            except Exception as exc:  # noqa: BLE001 - e.g. an executable without HLO text
                self._note("hlo", f"ThroughputMonitor cannot count the step's FLOPs ({exc}); "
                                  "declare TrainModule.flops_per_batch for FLOP/s and MFU.")
        if self.flop_count is not None and self.flop_count.unknown_trip_counts:
            self._note("trips", f"ThroughputMonitor: {self.flop_count.unknown_trip_counts} "
                                "loop(s) in the step have no known trip count and are counted "
                                "once; declare TrainModule.flops_per_batch for exact FLOPs.")

    def on_train_batch_start(self, fit, module, batch, batch_idx) -> None:
        procs = jax.process_count()
        # accumulate_grad_batches=k: this step trains the loader batches fit.batch_idx ..
        # batch_idx (the hook gets the last one), each of the same shape.
        taken = max(1, batch_idx - fit.batch_idx + 1)
        if self._samples is None:  # every training batch has the same shape (Fit checks it)
            self._samples = int(np.shape(jax.tree.leaves(batch)[0])[0]) * procs
            # Same shape every step, so the module's counts are asked once: they may be
            # costly host work (an abstract model build), which must stay off the hot loop.
            tokens = module.tokens_per_batch(batch)
            self._tokens = None if tokens is None else float(tokens) * procs
            flops = module.flops_per_batch(batch)
            self._module_flops = flops is not None
            if flops is None and self.flop_count is not None:
                flops = self.flop_count.flops * self._devices
            self.flops_per_step = None if flops is None else float(flops)
        per_batch_flops = self._module_flops and self.flops_per_step is not None
        self._per_step.append((
            fit.global_step + 1, self._samples * taken,
            None if self._tokens is None else self._tokens * taken,
            self.flops_per_step * taken if per_batch_flops else self.flops_per_step))

    def on_validation_start(self, fit, module) -> None:
        if self._t_last is not None:
            self._pause_start = time.perf_counter()

    def on_validation_end(self, fit, module) -> None:
        if self._pause_start is not None:
            self._paused += time.perf_counter() - self._pause_start
            self._pause_start = None

    def on_log(self, fit, module, metrics, step) -> None:
        if self._t_last is None or not _is_training_round(metrics) or step <= self._step_last:
            return
        now = time.perf_counter()
        seconds = now - self._t_last - self._paused
        steps = step - self._step_last
        samples = tokens = flops = 0.0
        has_tokens = has_flops = True
        while self._per_step and self._per_step[0][0] <= step:
            _, s, t, f = self._per_step.popleft()
            samples += s
            has_tokens &= t is not None
            has_flops &= f is not None
            tokens += t or 0.0
            flops += f or 0.0
        self._t_last, self._step_last, self._paused = now, step, 0.0
        if seconds <= 0:
            return
        self._windows.append((seconds, steps, samples, tokens if has_tokens else -1.0,
                              flops if has_flops else -1.0))
        fit.log_metrics(self._rates(seconds, steps, samples, tokens if has_tokens else None,
                                    flops if has_flops else None), step)

    def _rates(self, seconds, steps, samples, tokens, flops) -> dict[str, float]:
        out = {"throughput/steps_per_sec": steps / seconds,
               "throughput/samples_per_sec": samples / seconds}
        if tokens is not None:
            out["throughput/tokens_per_sec"] = tokens / seconds
        if flops is not None:
            achieved = flops / seconds
            out["throughput/flops_per_sec"] = achieved
            out["throughput/flops_per_sec_per_device"] = achieved / self._devices
            peak = self.peak()
            if peak:
                out["throughput/mfu"] = achieved / (peak * self._devices)
            else:
                kind = jax.devices()[0].device_kind
                self._note("peak", f"ThroughputMonitor: no peak FLOP/s known for device kind "
                                   f"{kind!r}; pass peak_flops_per_device=... to log MFU.")
        return out

    def on_train_end(self, fit, module) -> None:
        windows = self._windows[1:] or self._windows  # the first window holds one-off costs
        if not windows:
            return
        seconds, steps, samples = (sum(w[i] for w in windows) for i in range(3))
        tokens = None if any(w[3] < 0 for w in windows) else sum(w[3] for w in windows)
        flops = None if any(w[4] < 0 for w in windows) else sum(w[4] for w in windows)
        self.summary = self._rates(seconds, steps, samples, tokens, flops)


class DeviceStatsMonitor(Callback):
    """Logs device memory at every log step, per local device, where the backend reports it.

    From `device.memory_stats()`: `memory/dev<id>/in_use_gib` and `memory/dev<id>/peak_gib`
    (and `limit_gib`). Backends without allocator statistics (CPU) report none; one line says
    so. At the start of training it also logs the compiled step's static footprint per device
    (`memory/step_arguments_gib`, `memory/step_temp_gib`, `memory/step_outputs_gib`) from
    `memory_analysis()`, which every backend gives. Reading allocator counters does not wait
    for the device.

    Example:
        >>> monitor = DeviceStatsMonitor()
    """

    def __init__(self) -> None:
        self.static: dict[str, float] = {}
        self._noted = False

    def on_train_start(self, fit, module) -> None:
        compiled = fit.compiled_train_step
        try:
            stats = compiled.memory_analysis() if compiled is not None else None
        except Exception:  # noqa: BLE001 - not every executable implements it
            stats = None
        if stats is not None:
            self.static = {
                "memory/step_arguments_gib": stats.argument_size_in_bytes / _GIB,
                "memory/step_outputs_gib": stats.output_size_in_bytes / _GIB,
                "memory/step_temp_gib": stats.temp_size_in_bytes / _GIB,
                "memory/step_aliased_gib": stats.alias_size_in_bytes / _GIB,
            }
            fit.log_metrics(self.static, fit.global_step)

    def device_metrics(self) -> dict[str, float]:
        """Allocator statistics of this process's devices, as metrics (empty on CPU)."""
        out: dict[str, float] = {}
        for device in jax.local_devices():
            stats: Any = device.memory_stats()
            if not stats:
                continue
            prefix = f"memory/dev{device.id}"
            for key, name in (("bytes_in_use", "in_use_gib"), ("peak_bytes_in_use", "peak_gib"),
                              ("bytes_limit", "limit_gib")):
                if key in stats:
                    out[f"{prefix}/{name}"] = stats[key] / _GIB
        return out

    def on_log(self, fit, module, metrics, step) -> None:
        if not _is_training_round(metrics):
            return
        out = self.device_metrics()
        if out:
            fit.log_metrics(out, step)
        elif not self._noted:
            self._noted = True
            if jax.process_index() == 0:
                print(f"jaxlight: DeviceStatsMonitor: the {jax.devices()[0].platform} backend "
                      "reports no allocator statistics; only the step's static footprint is "
                      "logged.", file=sys.stderr)
