"""The roofline Auto ranks layouts with: per-device figures of each device kind and the
predicted step time of a compiled layout.

`predicted_step_seconds`: `max(FLOPs / peak, bytes accessed / memory bandwidth) + sum(collective
traffic / bandwidth of the link its group crosses)`, communication not overlapped (a
pessimistic bound that ranks layouts; it does not time them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxlight._errors import ConfigurationError
from jaxlight.strategies._base import Strategy


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


def bytes_accessed(compiled) -> float | None:
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - some backends do not implement cost analysis
        return None
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else None
    value = (analysis or {}).get("bytes accessed")
    return None if value is None else float(value)


def axis_links(strategy: Strategy, spec: DeviceSpec) -> dict[str, tuple[int, float]]:
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


def group_bandwidth(group: int, links: dict[str, tuple[int, float]], spec: DeviceSpec
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


def predicted_step_seconds(flops: float, accessed: float | None, collectives: Sequence,
                           strategy: Strategy, spec: DeviceSpec) -> float:
    """The roofline step time of a compiled layout on `spec`'s devices.

    Args:
        flops: FLOPs per device and step (loops counted in full).
        accessed: bytes accessed per device and step (`cost_analysis()`), or None.
        collectives: the step's collectives (`jaxlight.analysis._hlo.collectives`).
        strategy: the layout's strategy, set up (its mesh says which links a group crosses).
        spec: the device kind's figures.
    """
    links = axis_links(strategy, spec)
    comm = sum(x.total_traffic_bytes / group_bandwidth(x.group_size, links, spec)
               for x in collectives)
    compute = max(flops / spec.peak_flops, (accessed or 0.0) / spec.memory_bandwidth)
    return compute + comm
