"""Batch checks: every batch matches the one the step was compiled for (structure, shapes,
dtypes); every process feeds an equal, contiguous share of the global batch, with the same
shapes and dtypes, and the mesh places each share on its own process."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from jaxlight._errors import DataError, ShardingError
from jaxlight.distributed._agreement import all_gather_json, process_count_and_index


class BatchSignature(NamedTuple):
    """What a compiled step fixes about its batch: tree structure and each leaf's shape and
    dtype (as JAX canonicalizes it: float64 becomes float32 unless x64 is enabled, so such a
    change is not a change for the compiled step)."""

    treedef: Any
    leaves: tuple[tuple[str, tuple[int, ...], np.dtype], ...]
    origin: str  # where the reference batch came from, for messages

    def describe(self) -> str:
        return "{" + ", ".join(f"{p}: {s} {d}" for p, s, d in self.leaves) + "}"


def _dtype(x: Any) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = np.asarray(x).dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def len_or_none(data: Any) -> int | None:
    """`len(data)`, or None for data without a length (a generator, an iterable dataset)."""
    try:
        return len(data)
    except TypeError:
        return None


def matches(batch: Any, reference: BatchSignature) -> bool:
    """Whether `batch` has exactly `reference`'s structure, shapes and dtypes: the per-batch
    check of the training loop, without building a signature (no leaf paths) when it does."""
    leaves, treedef = jax.tree.flatten(batch)
    if treedef != reference.treedef:
        return False
    # A leaf's own dtype equal to the canonical one needs no canonicalizing (the common case).
    return all(tuple(np.shape(x)) == shape
               and (getattr(x, "dtype", None) == dtype or _dtype(x) == dtype)
               for x, (_, shape, dtype) in zip(leaves, reference.leaves, strict=True))


def batch_signature(batch: Any, origin: str) -> BatchSignature:
    """The signature of `batch`; `origin` says where it came from ('batch 0 of epoch 0')."""
    leaves = tuple((jax.tree_util.keystr(p) or "batch", tuple(np.shape(x)), _dtype(x))
                   for p, x in jax.tree_util.tree_leaves_with_path(batch))
    return BatchSignature(jax.tree.structure(batch), leaves, origin)


def check_same_signature(batch: Any, reference: BatchSignature, where: str, advice: str) -> None:
    """Refuses a batch whose structure, shapes or dtypes differ from `reference`.

    Without this, a changed shape recompiles (or fails deep in XLA) and a changed dtype fails as
    JAX's 'Argument types differ ... different enable_x64 mode' TypeError, naming neither the
    batch nor what to do.

    Args:
        batch: the host batch about to be transferred.
        reference: the signature the step was compiled for.
        where: this batch's place in the data, for example 'training batch 3 of epoch 1'.
        advice: what to do about a shape or structure change (the dtype advice is fixed).
    """
    got = batch_signature(batch, where)
    if got == reference._replace(origin=where):
        return
    if got.treedef == reference.treedef:
        for (path, shape, dtype), (_, ref_shape, ref_dtype) in zip(got.leaves, reference.leaves,
                                                                   strict=True):
            if shape != ref_shape:
                raise DataError(
                    f"{where} has leaf {path} of shape {shape}, but the step was compiled for "
                    f"shape {ref_shape} (from {reference.origin}). Whole batch: "
                    f"{got.describe()}; compiled for {reference.describe()}. {advice}"
                )
            if dtype != ref_dtype:
                raise DataError(
                    f"{where} has leaf {path} of dtype {dtype}, but the step was compiled for "
                    f"dtype {ref_dtype} (from {reference.origin}). Every batch must keep its "
                    f"dtypes: cast in the data pipeline (for example x.astype(np.{ref_dtype})) "
                    "so that every batch yields the same dtype for each leaf."
                )
    raise DataError(
        f"{where} has structure {got.describe()}, but the step was compiled for "
        f"{reference.describe()} (from {reference.origin}). {advice}"
    )


def partial_rows(batch: Any, reference: BatchSignature) -> int | None:
    """The rows of `batch` if it is a short (partial) batch of `reference`'s kind, else None.

    A partial batch has the reference's structure and dtypes, and every leaf's shape equal to
    the reference's but for a smaller leading dimension common to all leaves (the last batch
    of a loader that keeps its remainder, as torch's `DataLoader(drop_last=False)`).
    """
    got = batch_signature(batch, reference.origin)
    if got.treedef != reference.treedef:
        return None
    rows = set()
    for (_, shape, dtype), (_, ref_shape, ref_dtype) in zip(got.leaves, reference.leaves,
                                                            strict=True):
        if dtype != ref_dtype or len(shape) != len(ref_shape) or not shape:
            return None
        if shape[1:] != ref_shape[1:] or shape[0] >= ref_shape[0]:
            return None
        rows.add(shape[0])
    return rows.pop() if len(rows) == 1 and len({s[0] for _, s, _ in reference.leaves}) == 1 \
        else None


def check_batch_agreement(batch: Any, what: str = "training batch",
                          num_batches: int | None = None) -> None:
    """Refuses per-process batches whose shapes or dtypes differ between processes.

    The global batch is assembled from equal shares; a process feeding more or fewer examples
    than the others would make them compile different programs and wait forever in the first
    collective, and one whose data runs out first leaves the others waiting at the next step.
    Called once, on the first batch, before compiling; `num_batches` is `len(data)` if known.
    """
    nproc, _ = process_count_and_index()
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
    nproc, _ = process_count_and_index()
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
