"""The sharding plan: what one training step costs per device, read from the compiled step.

`Fit.plan(module, example_batch)` compiles the training step exactly as `fit` would (same
strategy, callbacks and shardings) without running it, and reports:

- per parameter: shape, dtype, PartitionSpec, bytes and bytes per device, and what placed it
  (its annotation, the path rule that matched it, or nothing);
- per device: argument, output, temporary and aliased bytes (`compiled.memory_analysis()`);
- per step: collectives by kind with their buffer and ring-traffic bytes (`jaxlight.analysis._hlo`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jaxlight.analysis._hlo import KINDS, Collective, collectives, summarize
from jaxlight.sharding._layout import PathRule
from jaxlight.strategies._ddp import DDP
from jaxlight.strategies._mpmd import MpmdGPipe


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    """How one parameter is laid out."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes: int
    bytes_per_device: int
    #: What gave it its layout: "annotation", a path rule ("rules[2]"), or "none".
    rule: str = "none"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The numbers behind `Fit.plan`; `str(plan)` is the printed table.

    Attributes:
        strategy: the strategy's `describe()` (name, mesh, rules).
        params: one `ParamPlan` per trainable parameter.
        param_bytes: all parameters, unsharded.
        param_bytes_per_device: parameters one device holds.
        opt_state_bytes_per_device: optimizer state one device holds.
        memory: per-device bytes from `compiled.memory_analysis()` (`argument`, `output`,
            `temp`, `alias`, `generated_code`).
        collectives: every collective of the step (`jaxlight.analysis._hlo.Collective`).
        collective_totals: per kind: `count`, `buffer_bytes`, `traffic_bytes` per step.
        rules: the path rules named in `ParamPlan.rule` ("rules[2]" -> the rule, as text).
        unmatched: parameters with no annotation that no path rule matched (when the strategy
            has path rules).
    """

    strategy: dict
    params: tuple[ParamPlan, ...]
    param_bytes: int
    param_bytes_per_device: int
    opt_state_bytes_per_device: int
    memory: dict[str, int]
    collectives: tuple[Collective, ...]
    collective_totals: dict[str, dict[str, Any]]
    rules: dict[str, str] = dataclasses.field(default_factory=dict)
    unmatched: tuple[str, ...] = ()
    #: How `strategies.Auto` chose the layout (`AutoChoice`), when it did.
    auto: Any = None

    def to_dict(self) -> dict:
        """A JSON-able dict of the plan."""
        out = dataclasses.asdict(dataclasses.replace(self, auto=None))
        out["auto"] = None if self.auto is None else self.auto.to_dict()
        out["collectives"] = [dict(dataclasses.asdict(c), buffer_bytes=c.buffer_bytes,
                                   traffic_bytes=c.traffic_bytes) for c in self.collectives]
        return out

    def table(self) -> str:
        mesh = self.strategy.get("mesh", {})
        lines = [self.auto.table(), ""] if self.auto is not None else []
        lines += [f"Sharding plan: {self.strategy.get('name')} on mesh {mesh}", ""]
        pipe = self.strategy.get("pipeline")
        if pipe:  # GPipe / Hybrid with a pipe axis: the schedule the step runs
            lines += [f"pipeline: {pipe.get('schedule', 'gpipe')} schedule, {pipe['stages']} "
                      f"stages × {pipe.get('repeats', 1)} chunks, {pipe['microbatches']} "
                      f"microbatches, {pipe['iterations']} iterations, bubble "
                      f"{pipe['bubble_fraction']:.1%}", ""]
            if pipe.get("mpmd"):
                lines[-1:-1] = [
                    f"  a program per device (mpmd): parameter bytes per device "
                    f"{pipe.get('param_bytes_by_device')}; per step "
                    f"{pipe.get('copies', 0)} device-to-device copies, "
                    f"{_fmt_bytes(pipe.get('copy_bytes', 0))}"]
        lines += _context_lines(self.strategy, self.collectives)
        lines.append(f"{'parameter':<50} {'shape':<18} {'spec':<28} {'bytes':>10} "
                     f"{'per device':>11}  placed by")
        for p in self.params:
            lines.append(f"{p.path:<50} {str(p.shape):<18} {p.spec:<28} "
                         f"{_fmt_bytes(p.bytes):>10} {_fmt_bytes(p.bytes_per_device):>11}  "
                         f"{p.rule}")
        lines += [f"{label}: {text}" for label, text in self.rules.items()]
        if self.unmatched:
            shown = ", ".join(self.unmatched[:10])
            more = len(self.unmatched) - 10
            lines.append(f"matched no rule and carry no annotation ({len(self.unmatched)}): "
                         + shown + (f" and {more} more" if more > 0 else ""))
        lines.append(f"parameters: {_fmt_bytes(self.param_bytes)}, per device "
                     f"{_fmt_bytes(self.param_bytes_per_device)}; optimizer state per device "
                     f"{_fmt_bytes(self.opt_state_bytes_per_device)}")
        lines += ["", "memory per device: " + ", ".join(
            f"{k} {_fmt_bytes(v)}" for k, v in self.memory.items())]
        lines += ["", f"{'collective':<20} {'count/step':>10} {'buffer bytes':>14} "
                      f"{'ring traffic':>14}"]
        for kind in KINDS:
            t = self.collective_totals[kind]
            lines.append(f"{kind:<20} {t['count']:>10} {_fmt_bytes(t['buffer_bytes']):>14} "
                         f"{_fmt_bytes(t['traffic_bytes']):>14}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _context_lines(strategy: dict, found: tuple[Collective, ...]) -> list[str]:
    """Context parallelism's line: the algorithm, the split and its attention collectives
    (the shard_map collectives of `jaxlight.nn._context_attention`)."""
    algorithm = strategy.get("context_attention")
    n = strategy.get("mesh", {}).get("context", 1)
    if not algorithm or n == 1:
        return []
    ops = ("ppermute", "all_gather", "reduce_scatter")
    mine = [c for c in found if "shard_map" in c.op_name and any(o in c.op_name for o in ops)]
    kinds = sorted({c.kind for c in mine})
    count = sum(c.executions for c in mine)
    traffic = sum(c.total_traffic_bytes for c in mine)
    return [f"context: {algorithm} attention, each sequence split over {n} devices (1/{n} of "
            f"its activations per device); attention collectives: {count} "
            f"{'/'.join(kinds) or 'none'} per step, {_fmt_bytes(traffic)} ring traffic", ""]


def _spec_text(strategy, sharding) -> str:
    if isinstance(strategy, DDP):
        return "replicated (pmap)"
    if isinstance(strategy, MpmdGPipe):
        (device,) = sharding.device_set
        return f"whole on pipe device {strategy.pipeline_devices.index(device)}"
    spec = tuple(getattr(sharding, "spec", ()))
    if not any(s is not None for s in spec):
        return "replicated"
    return "P(" + ", ".join("None" if s is None else repr(s) for s in spec) + ")"


def _has_path_rules(strategy) -> bool:
    return any(isinstance(r, PathRule) for r in getattr(strategy, "user_rules", ()))


def _placed_by(strategy, abstract, logical_axes) -> tuple[dict[str, str], dict[str, str]]:
    """Per parameter path, what placed it, and the text of each path rule that placed any."""
    place = getattr(strategy, "place", None)  # SPMD strategies; DDP replicates everything
    if place is None:
        return {}, {}
    arrays = [p for p in place(abstract, logical_axes).arrays if p.collection == "params"]
    rules = {p.label: f"{p.rule!r}" + (f" ({p.rule.group})" if p.rule.group else "")
             for p in arrays if p.rule is not None}
    return {p.path: p.label for p in arrays}, dict(sorted(rules.items(), key=_rule_order))


def _rule_order(item: tuple[str, str]) -> int:
    return int(item[0].removeprefix("rules[").removesuffix("]"))


def _memory(compiled) -> dict[str, int]:
    try:
        stats = compiled.memory_analysis()
    except Exception:  # some backends cannot analyse; the plan still reports the rest
        stats = None
    if stats is None:
        return {}
    names = ("argument", "output", "temp", "alias", "generated_code")
    return {n: int(getattr(stats, f"{n}_size_in_bytes", 0) or 0) for n in names}


def plan(session, abstract_batch: Any, *, verbose: bool = True) -> Plan:
    """Compiles a set-up session's training step for `abstract_batch` and reports its costs.

    `session` is a `jaxlight._fit.Session` after `setup(module)`; `abstract_batch` holds the
    global batch's shapes. Nothing runs and no state is created. The compiled step is not
    kept: a later `fit.fit` compiles its own (its batches may differ from the example).
    """
    session.choose_layout(abstract_batch)
    strategy = session.strategy
    strategy.check_batch(abstract_batch)
    compiled, _ = session.compile_train_step(abstract_batch, keep=False)

    abstract, shardings = session.spec.abstract_state, session.shardings
    placed, rules = _placed_by(strategy, abstract, session.spec.logical_axes)
    params = []
    flat_sh = jax.tree.leaves(shardings.params)
    for (path, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(abstract.params),
                                      flat_sh, strict=True):
        shape = tuple(leaf.shape)
        itemsize = np.dtype(leaf.dtype).itemsize
        local = strategy.shard_shape(shape, sharding)
        params.append(ParamPlan(
            path=jax.tree_util.keystr(path), shape=shape, dtype=str(np.dtype(leaf.dtype)),
            spec=_spec_text(strategy, sharding), bytes=math.prod(shape) * itemsize,
            bytes_per_device=math.prod(local) * itemsize,
            rule=placed.get(jax.tree_util.keystr(path), "none"),
        ))
    found = tuple(collectives(compiled.as_text()))
    result = Plan(
        strategy=strategy.describe(),
        params=tuple(params),
        param_bytes=sum(p.bytes for p in params),
        param_bytes_per_device=strategy.bytes_per_device(abstract.params, shardings.params),
        opt_state_bytes_per_device=strategy.bytes_per_device(abstract.opt_state,
                                                            shardings.opt_state),
        memory=_memory(compiled),
        collectives=found,
        collective_totals=summarize(found),
        rules=rules,
        unmatched=tuple(p.path for p in params if p.rule == "none")
        if _has_path_rules(strategy) else (),
        auto=None if session.auto is None else session.auto.choice,
    )
    if isinstance(strategy, MpmdGPipe):
        per = {d: 0 for d in strategy.pipeline_devices}
        for p, sharding in zip(params, flat_sh, strict=True):
            per[next(iter(sharding.device_set))] += p.bytes
        copies = compiled.transfers()
        result.strategy["pipeline"].update(param_bytes_by_device=list(per.values()),
                                           copies=len(copies),
                                           copy_bytes=sum(c.nbytes for c in copies))
    if verbose and jax.process_index() == 0:
        print(result.table())
    return result
