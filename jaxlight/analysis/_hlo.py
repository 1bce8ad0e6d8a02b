"""Collectives in compiled HLO text: what a step communicates, counted per execution.

`collectives(compiled.as_text())` lists every collective instruction with its buffers, the
size of its device groups and how many times it runs per step: instructions inside `while`
loops (a `jaxlight.nn.Stacked` scan, a gradient-accumulation loop) count once per iteration,
using the trip count XLA records (`known_trip_count`). `summarize` totals them by kind.

Byte conventions (per device, per execution), for a group of N devices and a buffer of
`buffer_bytes` (the full, unsharded array the collective reduces or assembles):

| kind | `buffer_bytes` | `traffic_bytes` (ring algorithm) |
|---|---|---|
| all-reduce | the reduced array | 2(N−1)/N × buffer |
| all-gather | the gathered (output) array | (N−1)/N × buffer |
| reduce-scatter | the reduced (input) array | (N−1)/N × buffer |
| all-to-all | the exchanged array | (N−1)/N × buffer |
| collective-permute | the sent array | buffer |

Example:
    >>> import jax, jax.numpy as jnp
    >>> text = jax.jit(lambda x: x * 2).lower(jnp.ones(4)).compile().as_text()
    >>> collectives(text)
    []
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

#: The collective kinds jaxlight reports, in this order.
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1,
}
_SHAPE = re.compile(r"\b(pred|[a-z]+[0-9]+[a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,{} ]*\})\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_REPLICAS = re.compile(r"replica_count=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
        kind: one of `KINDS`.
        name: the HLO instruction name.
        computation: the HLO computation holding it (a loop body, or the entry).
        shapes: `(dtype, dims)` of each result buffer (several for a combined collective).
        result_bytes: bytes of the result buffers on one device.
        group_size: devices in each replica group (N).
        executions: how many times it runs per call of the program (loop trip counts).
        op_name: the JAX operation it came from (from the HLO metadata), or "".
    """

    kind: str
    name: str
    computation: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    result_bytes: int
    group_size: int
    executions: int
    op_name: str = ""

    @property
    def in_loop(self) -> bool:
        """True when the instruction sits in a computation that runs more than once per call."""
        return self.executions > 1

    @property
    def buffer_bytes(self) -> int:
        """The full array the collective acts on, per execution (see the module table)."""
        if self.kind == "reduce-scatter":
            return self.result_bytes * self.group_size
        return self.result_bytes

    @property
    def traffic_bytes(self) -> float:
        """Bytes each device sends per execution under the ring algorithm."""
        n = self.group_size
        if self.kind == "collective-permute":
            return float(self.buffer_bytes)
        factor = 2.0 if self.kind == "all-reduce" else 1.0
        return factor * (n - 1) / n * self.buffer_bytes if n > 1 else 0.0

    @property
    def total_buffer_bytes(self) -> int:
        return self.buffer_bytes * self.executions

    @property
    def total_traffic_bytes(self) -> float:
        return self.traffic_bytes * self.executions


def _shape_bytes(dtype: str, dims: tuple[int, ...]) -> int:
    size = 1
    for d in dims:
        size *= d
    return size * _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)


def _split_type(rest: str) -> tuple[str, str]:
    """Splits `TYPE opcode(...)...` into the type and the remainder (tuples nest parens)."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1:].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail.lstrip()


def _group_size(line: str, default: int) -> int:
    m = _GROUPS_MESH.search(line)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        names = re.findall(r"'([^']+)'", m.group(2))
        size = 1
        for name in names:
            size *= int(sizes.get(name, 1))
        return size
    m = _GROUPS_IOTA.search(line)
    if m:
        dims = [int(d) for d in m.group(1).split(",") if d]
        return dims[-1] if dims else default
    m = _GROUPS_LIST.search(line)
    if m:
        first = re.search(r"\{([0-9, ]*)\}", m.group(1))
        if first and first.group(1).strip():
            return len(first.group(1).split(","))
    return default


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in `hlo_text` (from `compiled.as_text()`), with its execution count.

    Asynchronous pairs (`all-gather-start`/`-done`) count once, at the start.
    """
    partitions = _PARTITIONS.search(hlo_text)
    replicas = _REPLICAS.search(hlo_text)
    default_group = max(int(partitions.group(1)) if partitions else 1,
                        int(replicas.group(1)) if replicas else 1)

    found: list[tuple[str, str, str, str]] = []  # (computation, name, type, line)
    calls: dict[str, list[tuple[str, int]]] = {}  # caller -> [(callee, times per call)]
    entry = None
    current = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            if header.group(1):
                entry = current
            calls.setdefault(current, [])
            continue
        if current is None:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, rest = m.groups()
        type_str, body = _split_type(rest)
        opcode = body.split("(", 1)[0].strip()
        trip = _TRIP.search(line)
        loop_body = _BODY.search(line)
        for callee in _CALLEE.findall(line):
            times = 1
            if opcode == "while" and loop_body and callee == loop_body.group(1):
                times = int(trip.group(1)) if trip else 1
            calls[current].append((callee, times))
        branches = _BRANCHES.search(line)
        if branches:
            for callee in re.findall(r"%?([\w.\-]+)", branches.group(1)):
                calls[current].append((callee, 1))
        base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
        if base in KINDS:
            found.append((current, name, type_str, line, base, opcode))

    executions: dict[str, int] = {}

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if depth > 64:  # malformed text; HLO call graphs are acyclic
            return
        executions[comp] = executions.get(comp, 0) + times
        for callee, mult in calls.get(comp, ()):
            visit(callee, times * mult, depth + 1)

    if entry is not None:
        visit(entry, 1)

    out: list[Collective] = []
    for comp, name, type_str, line, kind, opcode in found:
        shapes = [(dt, tuple(int(d) for d in dims.split(",") if d))
                  for dt, dims in _SHAPE.findall(type_str)]
        if opcode in ("all-gather-start", "collective-permute-start") and len(shapes) >= 2:
            shapes = [shapes[1]]  # (operand, output, ...): the output buffer
        op_name = _OP_NAME.search(line)
        out.append(Collective(
            kind=kind,
            name=name,
            computation=comp,
            shapes=tuple(shapes),
            result_bytes=sum(_shape_bytes(dt, dims) for dt, dims in shapes),
            group_size=_group_size(line, default_group),
            executions=executions.get(comp, 1 if entry is None else 0),
            op_name=op_name.group(1) if op_name else "",
        ))
    return out


def summarize(items: Iterable[Collective]) -> dict[str, dict[str, Any]]:
    """Totals per kind: `count` (executions), `buffer_bytes` and `traffic_bytes` per step.

    Example:
        >>> summarize([])["all-reduce"]
        {'count': 0, 'buffer_bytes': 0, 'traffic_bytes': 0.0}
    """
    totals = {k: {"count": 0, "buffer_bytes": 0, "traffic_bytes": 0.0} for k in KINDS}
    for c in items:
        t = totals[c.kind]
        t["count"] += c.executions
        t["buffer_bytes"] += c.total_buffer_bytes
        t["traffic_bytes"] += c.total_traffic_bytes
    return totals
