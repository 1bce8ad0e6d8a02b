"""Multi-process batch checks: every process feeds an equal, contiguous share of the global
batch, with the same shapes and dtypes, and the mesh places each share on its own process."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxlight._errors import DataError, ShardingError
from jaxlight.distributed._agreement import _nproc, all_gather_json


def check_batch_agreement(batch: Any, what: str = "training batch",
                          num_batches: int | None = None) -> None:
    """Refuses per-process batches whose shapes or dtypes differ between processes.

    The global batch is assembled from equal shares; a process feeding more or fewer examples
    than the others would make them compile different programs and wait forever in the first
    collective, and one whose data runs out first leaves the others waiting at the next step.
    Called once, on the first batch, before compiling; `num_batches` is `len(data)` if known.
    """
    nproc, _ = _nproc()
    if nproc == 1:
        return
    desc = {jax.tree_util.keystr(p): f"{tuple(np.shape(x))} {np.asarray(x).dtype}"
            for p, x in jax.tree_util.tree_leaves_with_path(batch)}
    values = all_gather_json(f"batch:{what}", {"batch": desc, "len": num_batches})
    share = f"global batch size / {nproc} processes"
    if any(v["batch"] != values[0]["batch"] for v in values):
        listed = "; ".join(f"process {i}: " + ", ".join(f"{k or 'batch'} {d}"
                                                         for k, d in v["batch"].items())
                           for i, v in enumerate(values))
        raise DataError(
            f"the per-process {what} differs between processes ({listed}). Every process must "
            f"feed the same number of examples ({share}) with the same shapes; "
            "jaxlight.data.ArrayLoader does this given the global batch size."
        )
    if any(v["len"] != values[0]["len"] for v in values):
        listed = ", ".join(f"process {i}: {v['len']}" for i, v in enumerate(values))
        raise DataError(
            f"the processes' {what} iterables have different lengths ({listed} batches): the "
            "process whose data ends first would leave the others waiting in the next step. "
            "Give every process the same number of batches (jaxlight.data.ArrayLoader does)."
        )


def check_batch_layout(shardings: Any, abstract_batch: Any, what: str = "batch") -> None:
    """Checks that process p's devices hold rows [p*B/P, (p+1)*B/P) of every batch leaf.

    Each process feeds a contiguous share of the global batch (in process order), which is
    right when the mesh's batch axes run over processes in device order. A mesh that
    replicates the batch over processes, or interleaves them, needs a different feeding;
    it is refused here, before compiling, instead of training on misplaced rows.
    """
    nproc, _ = _nproc()
    if nproc == 1:
        return
    leaves = jax.tree_util.tree_leaves_with_path(abstract_batch)
    shards = jax.tree.leaves(shardings)
    for (path, leaf), sharding in zip(leaves, shards, strict=False):
        rows = int(leaf.shape[0])
        share = rows // nproc
        held: dict[int, set[tuple[int, int]]] = {}
        spec = getattr(sharding, "spec", None)
        if spec is not None and len(spec) != len(leaf.shape):
            continue  # a strategy's own view of the batch (DDP's (devices, B/devices, ...))
        for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
            start, stop, _ = index[0].indices(rows)
            held.setdefault(device.process_index, set()).add((start, stop))
        for p in range(nproc):
            spans = sorted(held.get(p, ()))
            lo = min((s for s, _ in spans), default=0)
            hi = max((e for _, e in spans), default=0)
            covered = sum(e - s for s, e in _merge(spans))
            if (lo, hi) != (p * share, (p + 1) * share) or covered != share:
                mesh = getattr(sharding, "mesh", None)
                shape = dict(mesh.shape) if mesh is not None else "?"
                raise ShardingError(
                    f"{what} leaf {jax.tree_util.keystr(path)}: on mesh {shape} the devices of "
                    f"process {p} hold batch rows {_format_spans(spans)} of {rows}, but each "
                    f"process feeds rows [{p * share}, {(p + 1) * share}) (its contiguous 1/"
                    f"{nproc} share). The batch axes (data, fsdp) must span the processes in "
                    "device order: make the data-parallel degree a multiple of the process count "
                    "and keep model axes (tp, pipe) within a process."
                )


def _merge(spans):
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _format_spans(spans) -> str:
    merged = _merge(spans)
    return ", ".join(f"[{s}, {e})" for s, e in merged) or "none"
