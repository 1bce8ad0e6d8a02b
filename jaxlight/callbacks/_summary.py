"""ModelSummary: the parameter table (clu.parameter_overview) with totals, at fit start."""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxlight.callbacks._base import Callback


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def parameter_rows(params, shardings=None, strategy=None) -> tuple[list[tuple], dict]:
    """`(name, shape, dtype, bytes, bytes per device)` per parameter, and a dict of totals."""
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
    rows = []
    total_bytes = per_device_total = 0
    total_count = 0
    shard_flat = (dict(zip(flat, jax.tree.leaves(shardings), strict=True))
                  if shardings is not None else {})
    for name, x in flat.items():
        shape = tuple(np.shape(x))
        nbytes = math.prod(shape) * np.dtype(x.dtype).itemsize
        sharding = shard_flat.get(name)
        if sharding is not None:
            local_shape = (strategy.shard_shape(shape, sharding) if strategy is not None
                           else sharding.shard_shape(shape))
            per_device = math.prod(local_shape) * np.dtype(x.dtype).itemsize
        else:
            per_device = nbytes
        total_bytes += nbytes
        per_device_total += per_device
        total_count += math.prod(shape)
        rows.append((name, shape, str(np.dtype(x.dtype)), nbytes, per_device))
    totals = {"parameters": total_count, "bytes": total_bytes, "bytes_per_device": per_device_total}
    return rows, totals


def totals_line(totals: dict) -> str:
    return (f"Total: {totals['parameters']:,} parameters, {_bytes(totals['bytes'])}; "
            f"per device {_bytes(totals['bytes_per_device'])}")


def parameter_table(params, shardings=None, strategy=None) -> tuple[str, dict]:
    """A text table of parameters and a dict of totals; per-device bytes when sharded."""
    rows, totals = parameter_rows(params, shardings, strategy)
    lines = [f"{'name':<48} {'shape':<18} {'dtype':<9} {'bytes':>10} {'per device':>11}"]
    lines += [f"{name:<48} {str(shape):<18} {dtype:<9} {_bytes(nbytes):>10} "
              f"{_bytes(per_device):>11}" for name, shape, dtype, nbytes, per_device in rows]
    lines.append(totals_line(totals))
    return "\n".join(lines), totals


class ModelSummary(Callback):
    """Prints the model's parameters at fit start: shape, dtype, bytes and bytes per device.

    Args:
        max_depth: passed to `clu.parameter_overview` for the compact overview (-1: the table).
    """

    def __init__(self, max_depth: int = -1):
        self.max_depth = max_depth
        self.totals: dict | None = None
        self.text: str | None = None

    def on_fit_start(self, fit, module) -> None:
        spec = fit.session.spec
        shardings = fit.session.shardings.params if fit.session.shardings is not None else None
        self.text, self.totals = parameter_table(spec.abstract_state.params, shardings,
                                                 fit.strategy)
        if jax.process_index() == 0:
            if self.max_depth >= 0:
                # Only for the optional compact overview (max_depth >= 0): saves import time.
                from clu import parameter_overview

                print(parameter_overview.get_parameter_overview(
                    spec.abstract_state.params, include_stats=False))
            print(self.text)
