"""FLOPs of a compiled step, with loop bodies counted once per iteration, and peak FLOP/s.

XLA's `compiled.cost_analysis()` counts the body of a `while` loop once, whatever its trip
count; a model whose layers run under `scan` (or a step that scans over microbatches) is then
undercounted by the number of iterations. `compiled_flops` corrects it: it parses the optimized
HLO (`compiled.as_text()`), reads each loop's trip count from its `known_trip_count` backend
config, counts the FLOPs of every instruction the way XLA's cost analysis does (dots and
convolutions exactly, elementwise ops one per element), and adds `(trips - 1) x body` for every
loop, nested loops multiplied through, to XLA's own figure.

Example:
    >>> import jax, jax.numpy as jnp
    >>> def f(ws, x):
    ...     return jax.lax.scan(lambda h, w: (h @ w, None), x, ws)[0]
    >>> ws, x = jnp.ones((4, 64, 64)), jnp.ones((8, 64))
    >>> count = compiled_flops(jax.jit(f).lower(ws, x).compile())
    >>> round(count.flops / (4 * 2 * 8 * 64 * 64), 2)
    1.0
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from jaxlight.analysis._hlo_text import (
    Instr,
    attr_ints,
    backend_config,
    called_computations,
    dims,
    elements,
    parse_module,
    trip_count,
)

#: Dense bf16 peak FLOP/s per chip, from the vendors' data sheets (sparsity excluded).
PEAK_FLOPS: dict[str, float] = {
    "H100 SXM": 989.4e12,
    "H100 PCIe": 756.0e12,
    "H100 NVL": 835.5e12,
    "H200": 989.4e12,
    "A100": 312.0e12,
    "TPU v4": 275.0e12,
    "TPU v5e": 197.0e12,
    "TPU v5p": 459.0e12,
    "TPU v6e": 918.0e12,
}


def device_peak_flops(device: Any) -> float | None:
    """Dense bf16 peak FLOP/s of `device` (a `jax.Device` or its `device_kind`), if known.

    Example:
        >>> device_peak_flops("NVIDIA H100 80GB HBM3")
        989400000000000.0
        >>> device_peak_flops("cpu") is None
        True
    """
    entry = device_peak_entry(device)
    return None if entry is None else PEAK_FLOPS[entry]


def device_peak_entry(device: Any) -> str | None:
    """The row of `PEAK_FLOPS` that `device` (a `jax.Device` or its `device_kind`) reads.

    Example:
        >>> device_peak_entry("NVIDIA H200")
        'H200'
    """
    kind = (device if isinstance(device, str) else getattr(device, "device_kind", "")).lower()
    if "h200" in kind:
        return "H200"
    if "h100" in kind:
        if "pcie" in kind:
            return "H100 PCIe"
        return "H100 NVL" if "nvl" in kind else "H100 SXM"
    if "a100" in kind:
        return "A100"
    # TPU device_kind strings: "TPU v4", "TPU v5 lite" (v5e), "TPU v5" / "TPU v5p", "TPU v6 lite".
    if "tpu" in kind:
        if "v6" in kind:
            return "TPU v6e"
        if "v5" in kind:
            return "TPU v5e" if ("lite" in kind or "v5e" in kind) else "TPU v5p"
        if "v4" in kind:
            return "TPU v4"
    return None


@dataclasses.dataclass(frozen=True)
class Loop:
    """One `while` loop of the HLO: its trip count (None if unknown) and its body's FLOPs."""

    name: str
    trip_count: int | None
    body_flops: float  # one iteration, nested loops inside it included
    multiplicity: int  # how many times the loop itself runs (trip counts of enclosing loops)


@dataclasses.dataclass(frozen=True)
class FlopCount:
    """FLOPs of one execution of a compiled computation, on one device.

    Attributes:
        flops: XLA's count with every loop body counted once per iteration.
        xla_flops: `cost_analysis()["flops"]`, every loop body counted once.
        parsed_flops: this module's own count of the HLO, loops multiplied out.
        parsed_flops_once: this module's own count with every loop body once (compare with
            `xla_flops` to see how close the two cost models are).
        loops: the loops found, outermost first.
    """

    flops: float
    xla_flops: float | None
    parsed_flops: float
    parsed_flops_once: float
    loops: tuple[Loop, ...]

    @property
    def unknown_trip_counts(self) -> int:
        """Loops whose trip count XLA could not determine (counted once)."""
        return sum(1 for loop in self.loops if loop.trip_count is None)


# -- counting ----------------------------------------------------------------------------------

#: Ops XLA's cost analysis counts as one FLOP per output element.
_ELEMENTWISE = frozenset({
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "remainder", "negate", "abs",
    "sign", "floor", "ceil", "round-nearest-afz", "round-nearest-even", "compare", "select",
    "clamp", "and", "or", "xor", "not", "convert", "shift-left", "shift-right-logical",
    "shift-right-arithmetic", "real", "imag", "complex", "is-finite", "popcnt",
    "count-leading-zeros", "stochastic-convert", "reduce-precision",
})


def _dot_flops(out_shape: str, lhs_shape: str | None, contracting: list[int]) -> float:
    out = elements(out_shape)
    lhs = dims(lhs_shape)[0] if lhs_shape and dims(lhs_shape) else None
    if lhs is None:
        return 2.0 * out
    if not contracting and lhs:
        contracting = [len(lhs) - 1]
    k = math.prod(lhs[d] for d in contracting if d < len(lhs))
    return 2.0 * out * k


def _conv_flops(instr: Instr, shapes: dict[str, str]) -> float:
    out = elements(instr.shape)
    kernel_shape = shapes.get(instr.operands[1]) if len(instr.operands) > 1 else None
    kernel = dims(kernel_shape)[0] if kernel_shape and dims(kernel_shape) else None
    labels = re.search(r"dim_labels=\w+_(\w+)->", instr.attrs)
    if kernel is None or labels is None or "o" not in labels.group(1):
        return 2.0 * out
    out_features = kernel[labels.group(1).index("o")]
    return 2.0 * out * math.prod(kernel) / max(out_features, 1)


def _custom_call_flops(instr: Instr, shapes: dict[str, str]) -> float:
    target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
    target = target.group(1).lower() if target else ""
    if not any(word in target for word in ("gemm", "matmul", "dot")):
        return 0.0  # unknown kernels (attention, collectives) are not counted, as in XLA
    config = backend_config(instr.attrs)
    numbers = (config.get("gemm_backend_config", {}).get("dot_dimension_numbers")
               or config.get("dot_dimension_numbers") or {})
    contracting = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    lhs = shapes.get(instr.operands[0]) if instr.operands else None
    # cuBLAS custom calls return (result, workspace): the result is the first array.
    result = dims(instr.shape)[0] if dims(instr.shape) else []
    fake_out = "f32[" + ",".join(map(str, result)) + "]"
    return _dot_flops(fake_out, lhs, contracting)


class _Counter:
    def __init__(self, comps: dict[str, list[Instr]]):
        self.comps = comps
        self.loops: list[Loop] = []

    def flops(self, comp: str, multiplicity: int, once: bool, record: bool) -> float:
        """FLOPs of one execution of `comp`; loops multiplied out unless `once`."""
        instrs = self.comps.get(comp, [])
        shapes = {i.name: i.shape for i in instrs}
        total = 0.0
        for instr in instrs:
            total += self.instr_flops(instr, shapes, multiplicity, once, record)
        return total

    def instr_flops(self, instr: Instr, shapes: dict[str, str], multiplicity: int, once: bool,
                    record: bool) -> float:
        op = instr.opcode
        if op == "dot":
            lhs = shapes.get(instr.operands[0]) if instr.operands else None
            return _dot_flops(instr.shape, lhs, attr_ints(instr.attrs, "lhs_contracting_dims"))
        if op == "convolution":
            return _conv_flops(instr, shapes)
        if op == "custom-call":
            return _custom_call_flops(instr, shapes)
        if op in _ELEMENTWISE:
            return float(elements(instr.shape))
        if op in ("reduce", "reduce-window", "all-reduce", "reduce-scatter"):
            if op in ("all-reduce", "reduce-scatter"):
                return 0.0  # communication, not model FLOPs (XLA agrees)
            operand = shapes.get(instr.operands[0]) if instr.operands else None
            return float(elements(operand)) if operand else 0.0
        if op == "while":
            trips = trip_count(instr)
            n = 1 if (once or trips is None) else trips
            body = called_computations(instr.attrs, "body")
            cond = called_computations(instr.attrs, "condition")
            if record:  # outer loops first; nested ones are recorded by the recursion below
                full_body = sum(self.flops(c, 1, False, False) for c in body)
                self.loops.append(Loop(instr.name, trips, full_body, multiplicity))
            inner = multiplicity * (trips or 1)
            body_flops = sum(self.flops(c, inner, once, record) for c in body)
            cond_flops = sum(self.flops(c, inner, once, False) for c in cond)
            # The condition runs once more than the body; XLA's once-only count runs it once.
            return n * body_flops + (1 if once else n + 1) * cond_flops
        if op == "conditional":
            branches = (called_computations(instr.attrs, "branch_computations")
                        or called_computations(instr.attrs, "true_computation")
                        + called_computations(instr.attrs, "false_computation"))
            return max((self.flops(c, multiplicity, once, record) for c in branches), default=0.0)
        called = (called_computations(instr.attrs, "calls")
                  if op in ("fusion", "async-start", "call") else [])
        if op == "call":
            called = called or called_computations(instr.attrs, "to_apply")
        return sum(self.flops(c, multiplicity, once, record) for c in called)


def hlo_flops(hlo_text: str) -> tuple[float, float, tuple[Loop, ...]]:
    """Counts an optimized HLO module's FLOPs: (loops multiplied out, loops once, loops).

    Dots, convolutions and cuBLAS/oneDNN matmul custom calls count `2 x output elements x
    contracted size`; elementwise ops one per output element; reductions one per input element;
    transcendentals, data movement and collectives nothing (as in XLA's `HloCostAnalysis`).
    """
    comps, entry = parse_module(hlo_text)
    if entry is None:
        raise ValueError("no ENTRY computation found in the HLO text")
    counter = _Counter(comps)
    full = counter.flops(entry, 1, once=False, record=False)
    once = counter.flops(entry, 1, once=True, record=True)
    return full, once, tuple(counter.loops)


def _xla_flops(compiled: Any) -> float | None:
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends and pmap executables do not implement it
        return None
    if isinstance(analysis, list | tuple):  # older JAX: one dict per computation
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"])


def compiled_flops(compiled: Any) -> FlopCount:
    """FLOPs of one call of a `jax.stages.Compiled`, on one device, loops counted in full.

    Returns XLA's `cost_analysis()` figure plus `(trips - 1) x body` for every loop, the body
    counted from the HLO; where XLA gives no cost analysis, the count from the HLO alone.
    """
    full, once, loops = hlo_flops(compiled.as_text())
    xla = _xla_flops(compiled)
    flops = full if xla is None else xla + (full - once)
    return FlopCount(flops=flops, xla_flops=xla, parsed_flops=full, parsed_flops_once=once,
                     loops=loops)
