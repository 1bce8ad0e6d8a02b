"""Auto: chooses the layout (DP, FSDP, TP×FSDP, pipeline, ...) by compiling candidates.

`Fit("auto")` (or `Fit(strategies.Auto(...))`) does not guess. Once it knows the model (built
abstractly, no parameter materialized) and the first batch's shapes, Auto:

1. enumerates the layouts of the devices: every `data × fsdp × tp × pipe` factorization of the
   device count, `tp` only when the model has parameters the rules map to `tp`, `pipe` only
   for `jaxlight.nn.Stacked` models and stage counts that divide their layers, and
   `data × context` (context parallelism) when the batch holds long token sequences
   (`_auto_candidates.long_sequence`: 2048 tokens or more, or 64 or more per sequence of the
   batch), and `data × fsdp × expert` for a model with mixture-of-experts layers (expert
   degrees that divide its experts per layer);
2. screens each without compiling: its shardings (refused where a dimension does not divide,
   e.g. 4 heads over tp=8), its batch split, and its exact argument bytes per device
   (parameters, optimizer state and batch shards), skipping layouts whose arguments alone
   exceed the memory budget;
3. compiles the survivors' training steps ahead of time on abstract inputs, least sharded
   first, and reads per-device bytes from `compiled.memory_analysis()` (arguments + outputs +
   temporaries - aliased), FLOPs (`jaxlight.analysis._flops`, loops counted in full), bytes accessed
   (`cost_analysis()`) and collective traffic from the HLO (`jaxlight.analysis._hlo`);
4. predicts each step's time with a roofline per device kind (`DEVICE_TABLE`,
   `jaxlight/strategies/_roofline.py`):
   `max(FLOPs / peak, bytes accessed / memory bandwidth) + sum(collective traffic / bandwidth
   of the link its group crosses)`, communication not overlapped (a pessimistic bound);
5. picks the fastest prediction among the layouts that fit the budget with `headroom`.

Compiles are bounded: layouts whose arguments alone exceed the budget are never compiled; the
rest go least sharded first (the least communication) while the first compiled one fits, and
most sharded first (the fewest argument bytes) once it does not (memory binds); after the first
layout that fits, only `explore` more are compiled, and never more than `max_compiles` in all.
A model whose arguments take at most `shortcut` of the budget under data parallelism gets
DataParallel without any compile (every small model: the common case stays as cheap as it
was). `Auto.choice` keeps the table of candidates; Fit prints it, and `Fit.plan` shows it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxlight._errors import ConfigurationError
from jaxlight.analysis._flops import compiled_flops
from jaxlight.analysis._hlo import collectives
from jaxlight.distributed._agreement import agree_max
from jaxlight.strategies._auto_candidates import (
    Candidate,
    enumerate_candidates,
    first_sentence,
    screen,
)
from jaxlight.strategies._auto_choice import AutoChoice, fmt_bytes, fmt_time, nothing_fits
from jaxlight.strategies._base import Strategy
from jaxlight.strategies._mpmd_runtime import MpmdProgram
from jaxlight.strategies._roofline import (
    DEVICE_TABLE,
    DeviceSpec,
    bytes_accessed,
    device_spec,
    predicted_step_seconds,
)
from jaxlight.strategies._rules import normalize_rules
from jaxlight.strategies._spmd import SingleDevice

_log = logging.getLogger("jaxlight.strategies")

# -- Auto ---------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any, who: str = "memory_budget") -> int:
    """Bytes from an int/float or a string such as `"16GiB"` or `"500 MB"`.

    Example:
        >>> parse_bytes("1.5 GiB"), parse_bytes(4096)
        (1610612736, 4096)
    """
    if isinstance(value, bool):
        raise ConfigurationError(f"Auto: {who} must be bytes (a number or '16GiB'), got {value}.")
    if isinstance(value, int | float) and value > 0:
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if m and m.group(2).lower() in _UNITS and float(m.group(1)) > 0:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigurationError(
        f"Auto: {who}={value!r} is not a positive amount of bytes; give a number of bytes or a "
        "string such as '16GiB', '500MB'."
    )


def _host_memory_per_device(devices: Sequence[jax.Device]) -> int:
    """Physical memory of this host shared by its local devices (CPU devices report none)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = sum(1 for d in devices if d.process_index == jax.process_index()) or 1
    return total // local


class Auto(Strategy):
    """Chooses the layout by compiling candidate layouts and predicting their step time.

    See the module docstring for how it decides. After `Fit` has chosen, `Fit.strategy` is
    the chosen strategy and `auto.choice` (an `AutoChoice`) holds the candidate table.

    Without a training batch (`validate`/`test`/`predict` before any `fit`, or resuming from a
    checkpoint) nothing can be compiled: Auto then takes the least sharded layout whose
    parameters and optimizer state take at most a quarter of the usable memory, else the one
    with the fewest of those bytes per device.

    Args:
        memory_budget: bytes per device (or `"16GiB"`); default: what the device reports
            (`memory_stats()["bytes_limit"]`), else the table's figure, else (CPU) the host's
            memory divided among its devices.
        headroom: fraction of the budget kept free (fragmentation, runtime buffers).
        device_table: rows to add to or replace in `DEVICE_TABLE` (kind -> `DeviceSpec`).
        device: the table row to use instead of the devices' own kind (`"H100"`).
        layouts: restrict the candidates to these mesh axes combinations, for example
            `["data", "fsdp", "fsdp+tp"]` (default: all).
        max_compiles: at most this many candidates are compiled.
        explore: after the first candidate that fits, compile this many more.
        shortcut: DataParallel is chosen without compiling when its arguments take at most
            this fraction of the usable budget (0 always searches).
        rules: logical-axis rules for the sharded candidates (see `FSDP`, `Hybrid`).
        verbose: print the candidate table on process 0.
        devices: the devices to use (default: all).

    Example:
        >>> from jaxlight import strategies
        >>> auto = strategies.Auto(memory_budget="16GiB", device="H100")
    """

    name = "auto"

    def __init__(self, *, memory_budget: Any = None, headroom: float = 0.1,
                 device_table: Mapping[str, DeviceSpec] | None = None,
                 device: str | DeviceSpec | None = None, layouts: Sequence[str] | None = None,
                 max_compiles: int = 4, explore: int = 2, shortcut: float = 0.01, rules=None,
                 verbose: bool = True, devices: Sequence[jax.Device] | None = None):
        super().__init__()
        self.memory_budget = None if memory_budget is None else parse_bytes(memory_budget)
        if not 0.0 <= headroom < 1.0:
            raise ConfigurationError(f"Auto: headroom is a fraction in [0, 1), got {headroom}.")
        for name, value in (("max_compiles", max_compiles), ("explore", explore)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigurationError(f"Auto: {name} must be an int >= 0, got {value!r}.")
        if not 0.0 <= shortcut <= 1.0:
            raise ConfigurationError(f"Auto: shortcut is a fraction in [0, 1], got {shortcut}.")
        self.headroom = headroom
        self.table = {**DEVICE_TABLE, **dict(device_table or {})}
        for key, spec in self.table.items():
            if not isinstance(spec, DeviceSpec):
                raise ConfigurationError(
                    f"Auto: device_table[{key!r}] must be a strategies.DeviceSpec, got "
                    f"{type(spec).__name__}.")
        self.device = device
        self.layouts = None if layouts is None else tuple(self._norm_layout(x) for x in layouts)
        self.max_compiles = max_compiles
        self.explore = explore
        self.shortcut = shortcut
        self.rules = normalize_rules(rules, "Auto")
        self.verbose = verbose
        self._devices = devices
        #: The chosen strategy (None until Fit has chosen).
        self.chosen: Strategy | None = None
        #: The decision and its candidate table (None until Fit has chosen).
        self.choice: AutoChoice | None = None

    @staticmethod
    def _norm_layout(text: str) -> str:
        axes = sorted(a.strip() for a in str(text).replace("×", "+").split("+") if a.strip())
        bad = [a for a in axes if a not in ("data", "fsdp", "tp", "pipe", "context", "expert")]
        if bad or not axes:
            raise ConfigurationError(
                f"Auto: layouts entry {text!r} is not a '+'-joined set of mesh axes data, fsdp, "
                "tp, pipe, context, expert (for example 'fsdp+tp').")
        return "+".join(axes)

    # -- the Strategy interface: the chosen strategy's -------------------------------------------

    def _require_chosen(self) -> Strategy:
        if self.chosen is None:
            raise ConfigurationError(
                "Auto has not chosen a layout yet: it chooses when Fit sees the model and the "
                "first batch (fit, plan). Use fit.strategy afterwards, or pick a strategy "
                "yourself (strategies.FSDP(), ...).")
        return self.chosen

    def setup(self, devices: Sequence[jax.Device] | None = None) -> None:
        if devices is not None:
            self._devices = list(devices)

    @property
    def data_parallel_size(self) -> int:
        return self._require_chosen().data_parallel_size

    def describe(self) -> dict[str, Any]:
        if self.chosen is None:
            return {"name": self.name, "mesh": {}}
        return {**self.chosen.describe(), "chosen_by": "auto"}

    def state_shardings(self, abstract_state, logical_axes):
        return self._require_chosen().state_shardings(abstract_state, logical_axes)

    def batch_shardings(self, abstract_batch):
        return self._require_chosen().batch_shardings(abstract_batch)

    def put_batch(self, batch, shardings):
        return self._require_chosen().put_batch(batch, shardings)

    def step_input(self, batch, shardings):
        return self._require_chosen().step_input(batch, shardings)

    def compile(self, fn, abstract_args, in_shardings, out_shardings, donate_argnums=()):
        return self._require_chosen().compile(fn, abstract_args, in_shardings, out_shardings,
                                              donate_argnums)

    # -- the decision ----------------------------------------------------------------------

    def _device_list(self) -> list[jax.Device]:
        return list(self._devices if self._devices is not None else jax.devices())

    def _spec(self, devices) -> DeviceSpec:
        if isinstance(self.device, DeviceSpec):
            return self.device
        return device_spec(self.device if self.device is not None else devices[0], self.table)

    def _budget(self, devices, spec: DeviceSpec) -> int:
        if self.memory_budget is not None:
            return self.memory_budget
        stats = None
        try:
            stats = devices[0].memory_stats()
        except Exception:  # noqa: BLE001 - some backends do not implement memory_stats
            stats = None
        if stats and stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
        if spec.memory_bytes and devices[0].platform != "cpu":
            return int(spec.memory_bytes)
        return _host_memory_per_device(devices)

    def candidates(self, abstract_state, logical_axes, num_devices: int,
                   abstract_batch=None) -> list[Candidate]:
        """Every layout of `num_devices` the model's annotations allow, least sharded first
        (with `data × context` layouts when `abstract_batch` holds long sequences)."""
        return enumerate_candidates(self.rules, self.layouts, abstract_state, logical_axes,
                                    num_devices, abstract_batch)

    def choose(self, abstract_state, logical_axes, abstract_batch,
               make_step: Callable[[Strategy], Callable] | None, *, defer: bool = False
               ) -> Strategy | None:
        """Picks the layout; returns the chosen strategy, set up, and records `self.choice`.

        Args:
            abstract_state: the train state's ShapeDtypeStructs (`ModelSpec.abstract_state`).
            logical_axes: its logical axis names (`ModelSpec.logical_axes`).
            abstract_batch: the global batch's ShapeDtypeStructs, or None (no compile then).
            make_step: builds the training step function for a candidate strategy.
            defer: without a batch, return None instead of deciding from state bytes when
                the shortcut does not apply (Fit asks again with the first batch).
        """
        start = time.perf_counter()
        devices = self._device_list()
        spec = self._spec(devices)
        budget = self._budget(devices, spec)
        if jax.process_count() > 1:
            # Every process must choose the same layout: they agree on the smallest budget
            # (the rest of the decision is a deterministic function of the compiled programs).
            budget = -agree_max("auto_memory_budget", -budget)
        usable = int(budget * (1.0 - self.headroom))
        if len(devices) == 1:
            cands = [Candidate("single", SingleDevice(devices[0]))]
        else:
            cands = self.candidates(abstract_state, logical_axes, len(devices), abstract_batch)
        for c in cands:
            screen(c, devices, abstract_state, logical_axes, abstract_batch, usable)
        viable = [c for c in cands if c.status == "pending"]
        compiles = 0
        reason = ""
        chosen: Candidate | None = None
        dp = next((c for c in viable if c.layout in ("single", f"data={len(devices)}")), None)
        if dp is not None and dp.argument_bytes <= self.shortcut * usable:
            chosen = dp
            share = dp.argument_bytes / max(usable, 1)
            what = "optimizer state" + (" and batch" if abstract_batch is not None else "")
            reason = (f"its parameters, {what} take {share:.2%} of the usable "
                      f"memory (at most {self.shortcut:.0%}: chosen without compiling; "
                      f"Auto(shortcut=0) always searches)")
            for c in viable:
                c.status, c.reason = "not compiled", "shortcut"
        elif abstract_batch is None and defer:
            return None
        elif abstract_batch is None or make_step is None:
            for c in viable:
                c.status = "not compiled"
            # A step's temporaries measured 1-4x its arguments (gradients, gathered parameters,
            # activations): without a compile, leave room for them.
            roomy = [c for c in viable if c.argument_bytes <= usable / 4]
            if roomy:
                chosen = roomy[0]
                reason = ("no training batch to compile with: the least sharded layout whose "
                          "parameters and optimizer state take at most a quarter of the usable "
                          "memory")
            elif viable:
                chosen = min(viable, key=lambda c: c.argument_bytes)
                reason = ("no training batch to compile with: the layout with the fewest bytes "
                          "of parameters and optimizer state per device")
        else:
            # Speed order (least sharded first) while memory is plentiful; once the first
            # compiled layout does not fit, memory binds: the most sharded (fewest argument
            # bytes) go next, so that a layout that fits is found in few compiles.
            queue = list(viable)
            first_fit = None
            while queue:
                c = queue.pop(0)
                if compiles >= self.max_compiles:
                    c.status, c.reason = "not compiled", f"max_compiles={self.max_compiles}"
                    continue
                if first_fit is not None and compiles - first_fit >= self.explore:
                    c.status, c.reason = "not compiled", (
                        f"explore={self.explore} candidates after the first that fits")
                    continue
                compiles += 1
                self._measure(c, abstract_state, logical_axes, abstract_batch, make_step, spec,
                              usable)
                if c.fits and first_fit is None:
                    first_fit = compiles
                if compiles == 1 and c.fits is False:
                    queue.sort(key=lambda x: x.argument_bytes)  # stable: speed order in ties
            fitting = [c for c in viable if c.fits]
            if fitting:
                chosen = min(fitting, key=lambda c: c.predicted_s)
                others = [c for c in fitting if c is not chosen]
                reason = (f"the fastest predicted step ({fmt_time(chosen.predicted_s)}) of "
                          f"{len(fitting)} compiled layouts that fit "
                          f"{fmt_bytes(usable)}")
                if others:
                    runner = min(others, key=lambda c: c.predicted_s)
                    reason += f"; next: {runner.layout} at {fmt_time(runner.predicted_s)}"
        if chosen is None:
            raise ConfigurationError(nothing_fits(cands, budget, usable, self.headroom,
                                                  len(devices)))
        chosen.status, chosen.reason = "chosen", ""
        choice = AutoChoice(chosen.layout, reason, cands, budget, usable, spec, len(devices),
                            compiles, time.perf_counter() - start)
        self.choice = choice
        self.chosen = chosen.strategy
        if chosen.strategy.mesh is None:
            chosen.strategy.setup(devices)
        _log.info("auto chose %s: %s (%d compiles, %.2f s)", choice.chosen, reason, compiles,
                  choice.seconds)
        if self.verbose and jax.process_index() == 0 and len(devices) > 1:
            if compiles:
                print(choice.table(), flush=True)
            else:  # nothing measured: one line, not a table of untried layouts
                print(f"jaxlight: auto chose {choice.chosen}: {reason}.", flush=True)
        return chosen.strategy

    def _measure(self, c: Candidate, abstract_state, logical_axes, abstract_batch, make_step,
                 spec: DeviceSpec, usable: int) -> None:
        """Compiles `c`'s training step on abstract inputs; reads its bytes, FLOPs, traffic."""
        s = c.strategy
        t0 = time.perf_counter()
        try:
            shardings = s.state_shardings(abstract_state, logical_axes)
            batch_sh = s.batch_shardings(abstract_batch)
            compiled = s.compile(make_step(s), (abstract_state, abstract_batch),
                                 in_shardings=(shardings, batch_sh),
                                 out_shardings=(shardings, s.replicated()), donate_argnums=(0,))
        except Exception as err:  # noqa: BLE001 - a layout that cannot compile is skipped
            c.status = "refused"
            c.reason = f"{type(err).__name__}: {first_sentence(str(err))}"
            c.compile_s = time.perf_counter() - t0
            return
        c.compile_s = time.perf_counter() - t0
        if isinstance(compiled, MpmdProgram):
            self._measure_mpmd(c, compiled, spec, usable)
            return
        mem = compiled.memory_analysis()
        if mem is not None:
            c.memory = {k: int(getattr(mem, f"{k}_size_in_bytes"))
                        for k in ("argument", "output", "temp", "alias")}
            m = c.memory
            c.bytes_per_device = m["argument"] + m["output"] + m["temp"] - m["alias"]
        found = collectives(compiled.as_text())
        c.collective_bytes = float(sum(x.total_traffic_bytes for x in found))
        c.flops = compiled_flops(compiled).flops
        c.bytes_accessed = bytes_accessed(compiled)
        c.predicted_s = predicted_step_seconds(c.flops, c.bytes_accessed, found, s, spec)
        c.fits = c.bytes_per_device is not None and c.bytes_per_device <= usable
        c.status = "fits" if c.fits else "too big"

    @staticmethod
    def _measure_mpmd(c: Candidate, program: MpmdProgram, spec: DeviceSpec, usable: int
                      ) -> None:
        """A program per device: the busiest device's bytes and FLOPs; the step time is the
        pipeline's makespan with every executable at its roofline time and every copy at the
        link bandwidth (`MpmdProgram.roofline_seconds`); the copies stand for collectives."""
        rows = program.device_bytes()
        c.memory = {"argument": max(r["argument"] for r in rows),
                    "output": max(r["output"] for r in rows),
                    "temp": max(r["intermediate"] for r in rows), "alias": 0}
        c.bytes_per_device = max(r["argument"] + r["output"] + r["intermediate"] for r in rows)
        costs = program.device_costs()
        c.flops = max(d["flops"] for d in costs)
        c.bytes_accessed = max(d["bytes_accessed"] for d in costs)
        c.collective_bytes = float(sum(t.nbytes for t in program.transfers()))
        c.predicted_s = program.roofline_seconds(spec.peak_flops, spec.memory_bandwidth,
                                                 spec.link_bandwidth)
        c.fits = c.bytes_per_device <= usable
        c.status = "fits" if c.fits else "too big"
