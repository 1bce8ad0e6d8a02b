"""Exact evaluation totals, accumulated on device: weighted scalar means and clu-style
mergeable metrics, one batch at a time (`self.log` is collected by the metrics module).

A returned scalar is weighted by the batch's number of examples (its leading dimension), or by
`self.log(..., batch_size=w)`, so the result is the exact mean over the dataset; a mergeable
metric (a `clu.metrics.Metric` or `Collection`, or any pytree with `merge` and `compute`) is
merged on device across batches (and, under DDP, across replicas with `all_gather` and
`reduce`) and computed once on the host at the end (`finish`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlight._errors import ConfigurationError, StepOutputError
from jaxlight.metrics._metrics import LogCollector, as_scalar, is_mergeable


class EvalSpec:
    """What an evaluation step reports, filled while it is traced (names, how to finish them)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.prog_bar: set[str] = set()
        #: Names logged with `logger=False` (kept from the loggers and `logged_metrics`).
        self.hidden: set[str] = set()
        #: Mergeable metrics whose `compute()` dict is spread into prefixed names (a returned
        #: Collection) rather than `name_key`.
        self.spread: set[str] = set()

    def name(self, key: str) -> str:
        return key if key.startswith(f"{self.prefix}_") else f"{self.prefix}_{key}"


def eval_outputs(out: Any, logs: LogCollector, spec: EvalSpec, rows: int, where: str) -> dict:
    """One batch's totals: `{"mean": {name: (sum, weight)}, "merge": {name: metric}}`.

    Returned dict keys get the prefix (`loss` -> `val_loss`); `self.log` names stay as logged.
    A returned scalar is weighted by `rows` (the examples in the batch the step saw).
    """
    means: dict[str, tuple] = {}
    merges: dict[str, Any] = {}

    def put(name, value, weight, origin):
        if name in means or name in merges:
            raise ConfigurationError(
                f"{where} reports {name!r} twice ({origin}); give each metric one name."
            )
        if is_mergeable(value):
            merges[name] = value
        else:
            value = as_scalar(value, f"{where} metric {name!r}")
            w = jnp.asarray(rows if weight is None else weight, jnp.float32)
            # where, not multiply: a NaN with zero weight (an empty token mask) adds nothing.
            means[name] = (jnp.where(w > 0, value * w, 0.0), w)

    if isinstance(out, dict):
        for key, value in out.items():
            put(spec.name(key), value, None, "returned")
    elif is_mergeable(out):
        name = f"{spec.prefix}_"
        spec.spread.add(name)
        merges[name] = out
    elif out is not None:
        raise StepOutputError(
            f"{where} returned a {type(out).__name__}; return a dict of scalars (and clu "
            "metrics), a clu.metrics.Collection, or nothing after self.log(...)."
        )
    for name, entry in logs.entries.items():
        put(name, entry.value, entry.batch_size, "returned and logged")
        if entry.options.prog_bar:
            spec.prog_bar.add(name)
        if not entry.options.logger:
            spec.hidden.add(name)
    if not means and not merges:
        raise StepOutputError(
            f"{where} reported no metric: return a dict such as {{'loss': ...}} or call "
            "self.log('val_loss', ...) inside it."
        )
    return {"mean": means, "merge": merges}


def gather_replicas(totals: dict, strategy) -> dict:
    """Makes one replica's batch totals global: sums for means, gather + reduce for metrics.

    Under SPMD the step already sees the global batch and this changes nothing.
    """
    means = strategy.reduce_metrics(totals["mean"], op="sum")
    merges = {}
    for name, metric in totals["merge"].items():
        stacked = strategy.gather_replicas(metric)
        merges[name] = metric if stacked is None else _reduce(stacked)
    return {"mean": means, "merge": merges}


def _reduce(stacked: Any) -> Any:
    """Merges metrics stacked on a leading axis (clu's `reduce`, else merge one by one)."""
    if callable(getattr(stacked, "reduce", None)):
        return stacked.reduce()
    n = jax.tree.leaves(stacked)[0].shape[0]
    out = jax.tree.map(lambda x: x[0], stacked)
    for i in range(1, n):
        out = out.merge(jax.tree.map(lambda x, i=i: x[i], stacked))
    return out


def accumulate(totals: dict, batch: dict, first: jax.Array, where: str) -> dict:
    """`totals` plus one batch's totals; `first` discards the (zero) `totals` of a fresh run."""
    means = jax.tree.map(lambda a, b: jnp.where(first, b, a + b), totals["mean"], batch["mean"])
    merges = {}
    for name, new in batch["merge"].items():
        old = totals["merge"][name]
        try:
            merged = old.merge(new)
        except Exception as err:  # the metric's own refusal (clu's CollectingMetric raises)
            raise StepOutputError(
                f"{where} metric {name!r} ({type(new).__name__}) cannot be merged inside the "
                f"compiled evaluation step ({type(err).__name__}: {err}). Use a fixed-size "
                "metric (counts, a histogram, a confusion matrix) that merges by arithmetic."
            ) from err
        if jax.tree.structure(merged) != jax.tree.structure(new) or any(
                np.shape(a) != np.shape(b)
                for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(new), strict=True)):
            raise StepOutputError(
                f"{where} metric {name!r} ({type(new).__name__}) changes shape when merged "
                f"({_shapes(new)} -> {_shapes(merged)}); jaxlight merges metrics on device in "
                "fixed shapes. Use a fixed-size metric (counts, a histogram, a confusion matrix) "
                "instead of one that collects values."
            )
        merges[name] = jax.tree.map(lambda a, b: jnp.where(first, b, a), merged, new)
    return {"mean": means, "merge": merges}


def _shapes(tree: Any) -> list:
    return [tuple(np.shape(x)) for x in jax.tree.leaves(tree)]


def finish(host: dict, spec: EvalSpec, where: str) -> dict[str, float]:
    """The exact results from host totals: weighted means, and each metric's `compute()`."""
    out: dict[str, float] = {}
    for name, (total, weight) in host["mean"].items():
        weight = float(weight)
        if weight <= 0:
            raise StepOutputError(
                f"{where} metric {name!r} had a total weight of {weight:g} over the whole "
                "evaluation (its batch_size was 0 on every batch), so it has no mean."
            )
        out[name] = float(total) / weight
    for name, metric in host["merge"].items():
        value = metric.compute()
        if isinstance(value, dict):
            for key, v in value.items():
                out[spec.name(key) if name in spec.spread else f"{name}_{key}"] = _float(
                    v, f"{where} metric {name!r}[{key!r}]")
        else:
            out[name] = _float(value, f"{where} metric {name!r}")
    return out


def _float(value: Any, what: str) -> float:
    arr = np.asarray(value)
    if arr.shape != ():
        raise StepOutputError(f"{what}.compute() returned shape {arr.shape}; metrics must "
                              "compute to scalars (or a dict of scalars).")
    return float(arr)
