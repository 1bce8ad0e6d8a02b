"""Auto: chooses the layout (DP, FSDP, TP×FSDP, pipeline, ...) by compiling candidates.

`Fit("auto")` (or `Fit(strategies.Auto(...))`) does not guess. Once it knows the model (built
abstractly, no parameter materialized) and the first batch's shapes, Auto:

1. enumerates the layouts of the devices: every `data × fsdp × tp × pipe` factorization of the
   device count, `tp` only when the model has parameters the rules map to `tp`, `pipe` only
   for `jaxlight.nn.Stacked` models and stage counts that divide their layers;
2. screens each without compiling: its shardings (refused where a dimension does not divide,
   e.g. 4 heads over tp=8), its batch split, and its exact argument bytes per device
   (parameters, optimizer state and batch shards), skipping layouts whose arguments alone
   exceed the memory budget;
3. compiles the survivors' training steps ahead of time on abstract inputs, least sharded
   first, and reads per-device bytes from `compiled.memory_analysis()` (arguments + outputs +
   temporaries - aliased), FLOPs (`jaxlight._flops`, loops counted in full), bytes accessed
   (`cost_analysis()`) and collective traffic from the HLO (`jaxlight._hlo`);
4. predicts each step's time with a roofline per device kind (`DEVICE_TABLE`):
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

import dataclasses
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxlight._errors import ConfigurationError, JaxlightError
from jaxlight._flops import compiled_flops
from jaxlight._hlo import collectives
from jaxlight._layout import axes_of
from jaxlight.distributed._agreement import agree_max
from jaxlight.strategies._base import Strategy
from jaxlight.strategies._paths import place
from jaxlight.strategies._rules import DEFAULT_RULES, normalize_rules
from jaxlight.strategies._spmd import FSDP, DataParallel, Hybrid, SingleDevice

_log = logging.getLogger("jaxlight.strategies")

# -- the device table -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What the roofline needs to know about one device kind (per device, bytes and seconds).

    Attributes:
        name: the table's name for the kind.
        peak_flops: dense peak FLOP/s (bf16 for accelerators).
        memory_bandwidth: bytes/s between the device's memory and its cores.
        link_bandwidth: bytes/s a ring collective moves per device between devices of one host
            or slice (NVLink, ICI).
        dcn_bandwidth: bytes/s per device between hosts (InfiniBand, data-center network).
        memory_bytes: memory per device, used when the device does not report its own.
    """

    name: str
    peak_flops: float
    memory_bandwidth: float
    link_bandwidth: float
    dcn_bandwidth: float
    memory_bytes: int | None = None


GB = 10**9

#: Per-device figures from the vendors' data sheets and the JAX scaling book. TPU ICI figures
#: are one link, both directions; the CPU row describes simulated devices sharing one host's
#: cores and memory (a rough figure: it ranks layouts, it does not time them).
DEVICE_TABLE: dict[str, DeviceSpec] = {
    "H100": DeviceSpec("H100", 989.4e12, 3.35e12, 450e9, 50e9, 80 * GB),
    "H200": DeviceSpec("H200", 989.4e12, 4.8e12, 450e9, 50e9, 141 * GB),
    "A100": DeviceSpec("A100", 312e12, 2.04e12, 300e9, 25e9, 80 * GB),
    "TPU v4": DeviceSpec("TPU v4", 275e12, 1.2e12, 9e10, 6.25e9, 32 * 2**30),
    "TPU v5e": DeviceSpec("TPU v5e", 197e12, 8.1e11, 9e10, 6.25e9, 16 * 2**30),
    "TPU v5p": DeviceSpec("TPU v5p", 459e12, 2.76e12, 1.8e11, 6.25e9, 95 * 2**30),
    "cpu": DeviceSpec("cpu", 5e10, 2e10, 1e10, 1e9, None),
}


def table_key(device_kind: str) -> str | None:
    """The `DEVICE_TABLE` row of a `jax.Device.device_kind` string, or None if unknown.

    Example:
        >>> table_key("NVIDIA H100 80GB HBM3"), table_key("TPU v5 lite"), table_key("cpu")
        ('H100', 'TPU v5e', 'cpu')
    """
    kind = device_kind.lower()
    for key in ("H200", "H100", "A100"):
        if key.lower() in kind:
            return key
    if "tpu" in kind:
        if "v5" in kind:
            return "TPU v5e" if ("lite" in kind or "v5e" in kind) else "TPU v5p"
        if "v4" in kind:
            return "TPU v4"
    if kind == "cpu":
        return "cpu"
    return None


def device_spec(device: Any, table: Mapping[str, DeviceSpec] | None = None) -> DeviceSpec:
    """The table row of `device` (a `jax.Device` or a device_kind string); unknown kinds are
    refused with the table's names, since a guessed roofline would pick layouts blindly."""
    table = dict(DEVICE_TABLE if table is None else table)
    kind = device if isinstance(device, str) else device.device_kind
    if kind in table:
        return table[kind]
    key = table_key(kind)
    if key is None or key not in table:
        raise ConfigurationError(
            f"Auto: no roofline figures for device kind {kind!r}; the table has "
            f"{sorted(table)}. Pass device_table={{{kind!r}: strategies.DeviceSpec(...)}} "
            "or device='H100' (a row of the table) to use one."
        )
    return table[key]


# -- candidates ---------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass
class Candidate:
    """One layout Auto considered, and what it learned about it.

    Attributes:
        layout: `"data=4,fsdp=2"`-style mesh (plus `reshard` for FSDP's per-layer variant).
        strategy: the strategy that implements it.
        status: `chosen`, `fits`, `too big`, `args exceed budget`, `not compiled`, or
            `refused` (its layout cannot hold the model or the batch; see `reason`).
        reason: why it was skipped or refused ("" otherwise).
        argument_bytes: parameters, optimizer state and batch per device (exact, before
            compiling; equals `memory_analysis().argument_size_in_bytes`).
        bytes_per_device: compiled arguments + outputs + temporaries - aliased (None: not
            compiled).
        collective_bytes: ring traffic of the step's collectives per device (None: not
            compiled).
        flops: FLOPs per device and step (None: not compiled).
        predicted_s: the roofline's step time (None: not compiled).
        fits: bytes_per_device within the usable budget (None: not compiled).
        compile_s: seconds its compile took.
        memory: `compiled.memory_analysis()` per device (`argument`, `output`, `temp`,
            `alias`), when compiled.
    """

    layout: str
    strategy: Strategy
    status: str = "pending"
    reason: str = ""
    argument_bytes: int | None = None
    bytes_per_device: int | None = None
    collective_bytes: float | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    predicted_s: float | None = None
    fits: bool | None = None
    compile_s: float = 0.0
    memory: dict[str, int] | None = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("strategy")
        return out


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"


@dataclasses.dataclass
class AutoChoice:
    """What Auto decided and why: the candidate table, the budget, the cost of choosing.

    `str(choice)` is the printed table.
    """

    chosen: str
    reason: str
    candidates: list[Candidate]
    budget_bytes: int
    usable_bytes: int
    device: DeviceSpec
    num_devices: int
    compiles: int
    seconds: float

    def to_dict(self) -> dict:
        return {
            "chosen": self.chosen, "reason": self.reason, "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes, "device": dataclasses.asdict(self.device),
            "num_devices": self.num_devices, "compiles": self.compiles,
            "seconds": round(self.seconds, 3),
            "candidates": [c.to_dict() for c in self.candidates],
        }

    def table(self) -> str:
        lines = [f"Auto layout over {self.num_devices} {self.device.name} devices, memory budget "
                 f"{_fmt_bytes(self.budget_bytes)} per device ({_fmt_bytes(self.usable_bytes)} "
                 f"usable); {self.compiles} compiles in {self.seconds:.2f} s",
                 f"{'layout':<26} {'args/device':>12} {'bytes/device':>13} "
                 f"{'collective/step':>16} {'predicted step':>15} {'fits':>5}  status"]
        for c in self.candidates:
            fits = "-" if c.fits is None else ("yes" if c.fits else "no")
            status = c.status + (f": {c.reason}" if c.reason else "")
            lines.append(f"{c.layout:<26} {_fmt_bytes(c.argument_bytes):>12} "
                         f"{_fmt_bytes(c.bytes_per_device):>13} "
                         f"{_fmt_bytes(c.collective_bytes):>16} {_fmt_time(c.predicted_s):>15} "
                         f"{fits:>5}  {status}")
        lines.append(f"chose {self.chosen}: {self.reason}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


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
        bad = [a for a in axes if a not in ("data", "fsdp", "tp", "pipe")]
        if bad or not axes:
            raise ConfigurationError(
                f"Auto: layouts entry {text!r} is not a '+'-joined set of mesh axes data, fsdp, "
                "tp, pipe (for example 'fsdp+tp').")
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

    def candidates(self, abstract_state, logical_axes, num_devices: int) -> list[Candidate]:
        """Every layout of `num_devices` the model's annotations allow, least sharded first."""
        rules = self.rules + DEFAULT_RULES
        # Logical names from annotations and from path rules (rules=strategies.rules.NNX).
        names = {n for p in place(rules, abstract_state, logical_axes).arrays
                 if p.collection == "params" and p.logical for n in p.logical if n is not None}
        first = {}
        for name, target in rules:
            if isinstance(name, str):
                first.setdefault(name, axes_of(target))
        tp_ok = any("tp" in first.get(n, ()) for n in names)
        layers = _stacked_layers(abstract_state.params, logical_axes.params)
        out: list[Candidate] = []
        n = num_devices
        for tp in _divisors(n) if tp_ok else [1]:
            for pipe in _divisors(n // tp) if layers else [1]:
                if layers and layers % pipe:
                    continue
                for data in _divisors(n // (tp * pipe)):
                    fsdp = n // (tp * pipe * data)
                    mesh = {a: s for a, s in (("data", data), ("pipe", pipe), ("fsdp", fsdp),
                                              ("tp", tp)) if s > 1}
                    out.extend(self._layouts(mesh))
        if self.layouts is not None:
            out = [c for c in out
                   if "+".join(sorted(_axes_key(c.layout))) in self.layouts]
        # Least sharded first: data parallelism communicates least when it fits; then more
        # fsdp (gathers added), then tensor parallelism (activation all-reduces), then pipes.
        def rank(c: Candidate):
            mesh = {a: (n if s == -1 else s) for a, s in c.strategy.mesh_shape.items()}
            return (n // mesh.get("data", 1), mesh.get("tp", 1), mesh.get("pipe", 1),
                    "reshard" in c.layout)
        return sorted(out, key=rank)

    def _layouts(self, mesh: dict[str, int]) -> list[Candidate]:
        text = ",".join(f"{a}={s}" for a, s in mesh.items()) or "single"
        rules = self.rules or None
        if not mesh:
            return [Candidate("single", SingleDevice())]
        if list(mesh) == ["data"]:
            return [Candidate(text, DataParallel(devices=None))]
        if list(mesh) == ["fsdp"]:
            return [Candidate(text, FSDP(rules=rules)),
                    Candidate(text + " reshard", FSDP(rules=rules, reshard_after_forward=True))]
        return [Candidate(text, Hybrid(mesh, rules=rules))]

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
            cands = self.candidates(abstract_state, logical_axes, len(devices))
        for c in cands:
            self._screen(c, devices, abstract_state, logical_axes, abstract_batch, usable)
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
                reason = (f"the fastest predicted step ({_fmt_time(chosen.predicted_s)}) of "
                          f"{len(fitting)} compiled layouts that fit "
                          f"{_fmt_bytes(usable)}")
                if others:
                    runner = min(others, key=lambda c: c.predicted_s)
                    reason += f"; next: {runner.layout} at {_fmt_time(runner.predicted_s)}"
        if chosen is None:
            raise ConfigurationError(self._nothing_fits(cands, budget, usable))
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

    def _screen(self, c: Candidate, devices, abstract_state, logical_axes, abstract_batch,
                usable: int) -> None:
        """Refuses what cannot hold the model or batch; exact argument bytes, no compile."""
        s = c.strategy
        try:
            s.setup(devices)
            shardings = s.state_shardings(abstract_state, logical_axes)
            state_bytes = _bytes_per_device(s, abstract_state, shardings)
            batch_bytes = 0
            if abstract_batch is not None:
                s.check_batch(abstract_batch)
                batch_bytes = _bytes_per_device(s, abstract_batch,
                                                s.batch_shardings(abstract_batch))
        except JaxlightError as err:
            c.status, c.reason = "refused", _first_sentence(str(err))
            return
        c.argument_bytes = state_bytes + batch_bytes
        if c.argument_bytes > usable:
            c.status = "args exceed budget"

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
            c.reason = f"{type(err).__name__}: {_first_sentence(str(err))}"
            c.compile_s = time.perf_counter() - t0
            return
        c.compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        if mem is not None:
            c.memory = {k: int(getattr(mem, f"{k}_size_in_bytes"))
                        for k in ("argument", "output", "temp", "alias")}
            m = c.memory
            c.bytes_per_device = m["argument"] + m["output"] + m["temp"] - m["alias"]
        found = collectives(compiled.as_text())
        c.collective_bytes = float(sum(x.total_traffic_bytes for x in found))
        c.flops = compiled_flops(compiled).flops
        c.bytes_accessed = _bytes_accessed(compiled)
        links = _axis_links(s, spec)
        comm = sum(x.total_traffic_bytes / _group_bandwidth(x.group_size, links, spec)
                   for x in found)
        compute = max(c.flops / spec.peak_flops, (c.bytes_accessed or 0.0)
                      / spec.memory_bandwidth)
        c.predicted_s = compute + comm
        c.fits = c.bytes_per_device is not None and c.bytes_per_device <= usable
        c.status = "fits" if c.fits else "too big"

    def _nothing_fits(self, cands, budget, usable) -> str:
        compiled = [c for c in cands if c.bytes_per_device is not None]
        sized = [c for c in cands if c.argument_bytes is not None]
        if compiled:
            best = min(compiled, key=lambda c: c.bytes_per_device)
            need = (f" The smallest compiled layout, {best.layout}, needs "
                    f"{_fmt_bytes(best.bytes_per_device)} per device.")
        elif sized:
            best = min(sized, key=lambda c: c.argument_bytes)
            need = (f" The smallest layout, {best.layout}, holds "
                    f"{_fmt_bytes(best.argument_bytes)} of parameters, optimizer state and "
                    "batch per device before any temporary.")
        else:
            need = ""
        return (f"Auto: no layout of the model fits the memory budget of {_fmt_bytes(budget)} "
                f"per device ({_fmt_bytes(usable)} usable after headroom={self.headroom}) over "
                f"{len(self._device_list())} devices.{need} Use more devices, a smaller batch "
                "(or GradientAccumulation), bf16 parameters, or a larger memory_budget.\n"
                + "\n".join(f"  {c.layout}: {c.status}{': ' + c.reason if c.reason else ''}"
                            for c in cands))


# -- helpers ------------------------------------------------------------------------------------


def _first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    cut = line.find(". ")
    return line if cut < 0 else line[:cut + 1]


def _axes_key(layout: str) -> list[str]:
    return [part.split("=")[0] for part in layout.split(" ")[0].split(",") if "=" in part]


def _stacked_layers(params, logical) -> int:
    """The layer count of the model's `Stacked` blocks (their `layers` axis), 0 if none."""
    sizes = set()
    flat_axes = jax.tree.leaves(logical, is_leaf=lambda x: x is None or isinstance(x, tuple))
    for leaf, names in zip(jax.tree.leaves(params), flat_axes, strict=True):
        if isinstance(names, tuple) and "layers" in names:
            sizes.add(leaf.shape[names.index("layers")])
    return math.gcd(*sizes) if sizes else 0


def _bytes_per_device(strategy: Strategy, abstract, shardings) -> int:
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings),
                              strict=True):
        local = strategy.shard_shape(tuple(leaf.shape), sharding)
        total += math.prod(local) * np.dtype(leaf.dtype).itemsize
    return total


def _bytes_accessed(compiled) -> float | None:
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement cost analysis
        return None
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    value = (analysis or {}).get("bytes accessed")
    return None if value is None else float(value)


def _axis_links(strategy: Strategy, spec: DeviceSpec) -> dict[str, tuple[int, float]]:
    """Per mesh axis of size > 1: its size and the bandwidth of the links it crosses (between
    hosts when its devices belong to different processes, within a host or slice otherwise)."""
    mesh = strategy.mesh
    out: dict[str, tuple[int, float]] = {}
    if mesh is None:
        return out
    grid = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    for i, axis in enumerate(mesh.axis_names):
        size = mesh.devices.shape[i]
        if size == 1:
            continue
        rows = np.moveaxis(grid, i, -1).reshape(-1, size)
        crosses = bool((rows != rows[:, :1]).any())
        out[axis] = (size, spec.dcn_bandwidth if crosses else spec.link_bandwidth)
    return out


def _group_bandwidth(group: int, links: dict[str, tuple[int, float]], spec: DeviceSpec
                     ) -> float:
    """The bandwidth of a collective over `group` devices: the slowest link of the mesh axes
    whose sizes multiply to `group` (the slowest such set when several do)."""
    names = list(links)
    best = None
    for mask in range(1, 2 ** len(names)):
        subset = [names[i] for i in range(len(names)) if mask >> i & 1]
        if math.prod(links[a][0] for a in subset) == group:
            bw = min(links[a][1] for a in subset)
            best = bw if best is None else min(best, bw)
    if best is None:
        best = min((bw for _, bw in links.values()), default=spec.link_bandwidth)
    return best

