"""The MPMD program's structure: the traced step flattened, placed on devices and cut into
segments (steps 1 to 3 of `_mpmd_runtime.py`, which compiles and runs them).

1. **Trace** the step (`jax.make_jaxpr`, `trace`). `jaxlight.nn.Stages` calls each stage as a
   `jax.jit` function named `jaxlight_stage_<s>`, per microbatch; autodiff keeps the name on the
   forward and the transposed call, so every stage computation is one named equation. Calls
   that hold stage calls are inlined; every other equation stays whole (an `Op`).
2. **Place** every equation on a device (`place`): a stage call on its stage's device (stage s
   of S on device s·p/S); any other equation where most of its input bytes already are (the
   optimizer update of a leaf beside the leaf, the loss beside the last stage's output);
   equations with no placed input (constants, iota, random keys) where their first consumer
   runs; equations of the step's inputs alone (a microbatch's labels) where their readers run.
3. **Cut** the program into segments (`cut_segments`): each stage call alone, and runs of other
   equations of one device merged while no equation needs another device's open run.
4. **Join** each run of other equations to a stage call of its device where the schedule
   allows (`merge_glue`): a microbatch's loss, its slice of the labels and the gradient sums
   run inside the stage call's executable, not as dispatches of their own between stage
   calls (1F1B, p = 3, m = 6: 38 dispatches per step, 62 before).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxlight._errors import ConfigurationError
from jaxlight.nn._mpmd import STAGE_PREFIX

_STAGE = re.compile(STAGE_PREFIX + r"(\d+)")
#: A value every device holds (replicated inputs, constants): placed on no one device.
ANY = -1
_CALLS = ("pjit", "jit", "closed_call", "core_call")


class Key:
    """One value of the flattened program (a jaxpr variable, renamed where inlined)."""

    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval


@dataclasses.dataclass
class Op:
    eqn: Any
    ins: list  # Key or a Literal
    outs: list  # Key or None (a dropped output)
    stage: int | None
    device: int | None = None
    kind: str | None = None  # a stage call's pass: F, B or W (`_mpmd_schedule.tag`)
    microbatch: int | None = None


@dataclasses.dataclass
class Segment:
    device: int
    ops: list
    stage: int | None = None
    inputs: list = dataclasses.field(default_factory=list)
    outputs: list = dataclasses.field(default_factory=list)
    donate: tuple = ()
    executable: Any = None
    # How the runtime fetches each input and what it drops after the segment (`_plan`).
    fetch: list = dataclasses.field(default_factory=list)
    drop: list = dataclasses.field(default_factory=list)
    drop_copies: list = dataclasses.field(default_factory=list)

    @property
    def call(self) -> Op | None:
        """The stage call a segment runs (None for a run of other equations only)."""
        return next((op for op in self.ops if op.stage is not None), None)


def _stage_of(eqn) -> int | None:
    if eqn.primitive.name not in _CALLS:
        return None
    found = _STAGE.search(str(eqn.params.get("name", "")))
    return None if found is None else int(found.group(1))


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _has_stage(jaxpr) -> bool:
    return any(_stage_of(e) is not None or any(_has_stage(j) for j in _sub_jaxprs(e))
               for e in jaxpr.eqns)


def nbytes(aval) -> int:
    return math.prod(getattr(aval, "shape", ())) * getattr(aval, "dtype", np.dtype("u1")).itemsize


def _flatten(jaxpr, env: dict, ops: list) -> None:
    """Appends `jaxpr`'s equations to `ops`, inlining calls that contain stage calls."""
    for eqn in jaxpr.eqns:
        stage = _stage_of(eqn)
        ins = [_read(a, env) for a in eqn.invars]
        if stage is None and eqn.primitive.name in _CALLS and any(
                _has_stage(j) for j in _sub_jaxprs(eqn)):
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            body = inner.jaxpr if isinstance(inner, jex_core.ClosedJaxpr) else inner
            consts = inner.consts if isinstance(inner, jex_core.ClosedJaxpr) else []
            inner_env = dict(zip(body.constvars, [Const(c) for c in consts], strict=True))
            inner_env.update(zip(body.invars, ins, strict=True))
            _flatten(body, inner_env, ops)
            for out, atom in zip(eqn.outvars, body.outvars, strict=True):
                env[out] = _read(atom, inner_env)
            continue
        if stage is None and any(_has_stage(j) for j in _sub_jaxprs(eqn)):
            raise ConfigurationError(
                f"GPipe(mpmd=True): a pipeline stage runs inside a `{eqn.primitive.name}` of "
                "the step (a loop, a condition, a remat or custom derivative around the whole "
                "model, e.g. callbacks.GradientAccumulation's scan over microbatches), which "
                "one device's program cannot hold. Let the pipeline's own microbatches split "
                "the batch (GPipe(microbatches=...)) instead, or use GPipe without mpmd.")
        outs = [None if isinstance(v, jex_core.DropVar) else Key(v.aval) for v in eqn.outvars]
        for var, key in zip(eqn.outvars, outs, strict=True):
            if key is not None:
                env[var] = key
        ops.append(Op(eqn, ins, outs, stage))


def _read(atom, env):
    """A jaxpr atom's value in `env` (a literal is its own value)."""
    return atom if isinstance(atom, jex_core.Literal) else env[atom]


class Const(Key):
    """A constant of the traced program (placed on each device that reads it, once)."""

    __slots__ = ("value",)

    def __init__(self, value):
        super().__init__(jax.typeof(value))
        self.value = value


def trace(fn: Callable, abstract_args: tuple) -> tuple[list[Op], list[Key], list, Any]:
    """The step as one flat list of equations, calls holding stage calls inlined: `(ops, the
    inputs' keys, the outputs (keys or literals), the outputs' shapes)`."""
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract_args)
    env: dict = {}
    inputs = [Key(v.aval) for v in closed.jaxpr.invars]
    env.update(zip(closed.jaxpr.invars, inputs, strict=True))
    env.update((v, Const(c)) for v, c in zip(closed.jaxpr.constvars, closed.consts,
                                              strict=True))
    ops: list[Op] = []
    _flatten(closed.jaxpr, env, ops)
    outputs = [_read(a, env) for a in closed.jaxpr.outvars]
    return ops, inputs, outputs, out_shape


def device_of_sharding(sharding, devices: Sequence[jax.Device]) -> int:
    """The index in `devices` of the one device `sharding` places on; ANY for a sharding over
    several devices or none."""
    if sharding is None:
        return ANY
    found = sharding.device_set
    if len(found) == 1:
        (device,) = found
        return devices.index(device) if device in devices else 0
    return ANY


def place(ops: Sequence[Op], inputs: Sequence[Key], outputs: Sequence, in_flat: Sequence,
          out_flat: Sequence, devices: Sequence[jax.Device], stages: int,
          round_robin: bool = False) -> None:
    """Sets each op's device (see the module docstring, step 2); `round_robin` puts stage s
    on device s mod p (interleaved 1F1B) instead of contiguous groups."""
    home: dict = {k: device_of_sharding(s, devices) for k, s in zip(inputs, in_flat, strict=True)}
    k = max(1, stages // len(devices)) if stages else 1
    staged: set = set()  # values computed from a stage call's output
    for op in ops:
        if op.stage is not None:
            op.device = op.stage % len(devices) if round_robin else op.stage // k
        else:
            # Equal bytes on two devices (a loss reading the last stage's output and labels as
            # large): the stage's side, where the schedule expects it (1F1B's backward pass
            # starts there as soon as the forward pass ends).
            weight: dict[int, tuple[int, int]] = {}
            for a in op.ins:
                d = home.get(a, ANY) if isinstance(a, Key) else ANY
                if d not in (ANY, None):
                    n, s = weight.get(d, (0, 0))
                    weight[d] = (n + nbytes(a.aval), s + (nbytes(a.aval) if a in staged else 0))
            op.device = max(weight, key=lambda d: (*weight[d], -d)) if weight else None
        if op.stage is not None or any(isinstance(a, Key) and a in staged for a in op.ins):
            staged.update(key for key in op.outs if key is not None)
        for key in op.outs:
            if key is not None:
                home[key] = op.device
    # Equations without a placed input run where their first consumer runs.
    first_use: dict = {}
    for key, sharding in zip(outputs, out_flat, strict=True):
        if isinstance(key, Key):
            first_use.setdefault(key, device_of_sharding(sharding, devices))
    returned = dict(first_use)
    for op in reversed(ops):
        if op.device is None:
            users = [first_use[key] for key in op.outs if key in first_use]
            users = [d for d in users if d not in (ANY, None)]
            op.device = users[0] if users else 0
        for a in op.ins:
            if isinstance(a, Key):
                first_use[a] = op.device  # (reversed: the earliest consumer wins)
    _to_readers(ops, {k: home[k] for k in inputs}, returned)


def _to_readers(ops: Sequence[Op], inputs: dict, outputs: dict) -> None:
    """Moves each equation computed from the step's inputs alone (a microbatch's labels sliced
    from the batch) whose every reader runs on one other device to that device, where the
    input is copied once instead of each result (1F1B's m label slices: one copy of the
    labels, and no slicing on the first device between its stage calls); not when the inputs
    copied would outweigh the results (a small slice of a large input). `inputs`, `outputs`:
    the device of each step input and output."""
    pure = set(inputs)
    readers: dict = {}
    for op in ops:
        if op.stage is None and all(isinstance(a, Const) or a in pure
                                    for a in op.ins if isinstance(a, Key)):
            pure.update(k for k in op.outs if k is not None)
        for a in op.ins:
            if isinstance(a, Key):
                readers.setdefault(a, []).append(op)
    moved: dict = {}  # op index -> its device before
    for j in reversed(range(len(ops))):
        op = ops[j]
        if op.stage is not None or not any(k in pure for k in op.outs if k is not None):
            continue
        where = {r.device for k in op.outs if k is not None for r in readers.get(k, ())}
        where.update(outputs[k] for k in op.outs if k in outputs)
        if len(where) == 1 and (d := where.pop()) not in (ANY, None, op.device):
            moved[j] = op.device
            op.device = d
    saved: dict = {}  # (step input, device) -> bytes of the moved readers' results
    for j in moved:
        for a in dict.fromkeys(a for a in ops[j].ins if isinstance(a, Key) and a in inputs):
            if inputs[a] not in (ANY, ops[j].device):
                key = (a, ops[j].device)
                saved[key] = saved.get(key, 0) + sum(nbytes(k.aval) for k in ops[j].outs
                                                     if k is not None)
    for (a, d), n in saved.items():
        if nbytes(a.aval) > n:
            for j in moved:
                if ops[j].device == d and any(b is a for b in ops[j].ins):
                    ops[j].device = moved[j]


def broadcast(prefix: Any, tree: Any) -> list:
    """`prefix` (shardings, or None) broadcast to the leaves of `tree`."""
    if prefix is None:
        return [None] * len(jax.tree.leaves(tree))
    out = []
    for s, sub in zip(jax.tree.leaves(prefix, is_leaf=lambda x: x is None),
                      _prefix_subtrees(prefix, tree), strict=True):
        out.extend([s] * len(jax.tree.leaves(sub)))
    return out


def _prefix_subtrees(prefix, tree) -> list:
    subtrees = []
    jax.tree.map(lambda _, sub: subtrees.append(sub), prefix, tree,
                 is_leaf=lambda x: x is None)
    return subtrees


def cut_segments(ops: list[Op]) -> list[Segment]:
    """Cuts the placed program into segments (see the module docstring, step 3)."""
    done: list[Segment] = []
    open_: dict[int, Segment] = {}
    where: dict = {}  # key -> the segment producing it

    def close(d):
        seg = open_.pop(d, None)
        if seg is not None:
            done.append(seg)

    for op in ops:
        for a in op.ins:
            seg = where.get(a) if isinstance(a, Key) else None
            if seg is not None and seg.device != op.device and open_.get(seg.device) is seg:
                close(seg.device)
        if op.stage is not None:
            close(op.device)
            seg = Segment(op.device, [op], stage=op.stage)
            done.append(seg)
        else:
            seg = open_.get(op.device)
            if seg is None:
                seg = open_[op.device] = Segment(op.device, [])
            seg.ops.append(op)
        for key in op.outs:
            if key is not None:
                where[key] = seg
    for d in list(open_):
        close(d)
    return done


def merge_glue(segments: list[Segment]) -> list[Segment]:
    """Joins each run of other equations (a microbatch's loss, a gradient sum) to a segment of
    its device, so that a stage call and the equations around it are one dispatch (see the
    module docstring, step 4). A run joins

    - the backward call before it on its device when it adds that call's gradients and reads
      only what the device holds by then (that call's outputs and inputs, the device's
      earlier values, the step's inputs): the microbatch's gradients never outlive the call,
      and the run's results come no later than before;
    - else the segment after it on its device when no other device reads its results (a
      microbatch's loss, with the last stage's backward call): that segment starts when it
      would have (every input of the run is ready before it), and only this device waits for
      the run's results;
    - else the stage call before it, on the same condition as the first.

    Either way no stage call starts later in the schedule's timeline (`MpmdProgram.simulate`
    with free equations), so each device still runs the schedule's order."""
    readers: dict = {}  # key -> the devices reading it
    for seg in segments:
        for op in seg.ops:
            for a in op.ins:
                if isinstance(a, Key):
                    readers.setdefault(a, set()).add(seg.device)
    maker: dict = {}  # key -> the segment (as merged) making it
    out: list = []
    latest: dict = {}  # device -> its latest segment in `out`
    pending: dict = {}  # device -> ops of runs waiting for the device's next segment
    for seg in segments:
        d = seg.device
        made = [k for op in seg.ops for k in op.outs if k is not None]
        if seg.stage is None:
            prev = latest.get(d)
            joins_prev = (prev is not None and prev.stage is not None and d not in pending
                          and all(_held(a, prev, maker) for a in _reads(seg)))
            # A gradient sum joins the backward pass whose gradients it adds: they never
            # outlive that call.
            if joins_prev and prev.call.kind in ("B", "W") and any(
                    maker.get(a) is prev for a in _reads(seg)):
                prev.ops = prev.ops + seg.ops
                maker.update((k, prev) for k in made)
                continue
            if all(readers.get(k, set()) <= {d} for k in made):
                pending.setdefault(d, []).extend(seg.ops)
                continue
            if joins_prev:
                prev.ops = prev.ops + seg.ops
                maker.update((k, prev) for k in made)
                continue
        if d in pending:
            seg.ops = pending.pop(d) + seg.ops
        maker.update((k, seg) for op in seg.ops for k in op.outs if k is not None)
        latest[d] = seg
        out.append(seg)
    # Runs with no later segment on their device: where they were, at the end (no other
    # device reads them).
    out.extend(Segment(d, ops) for d, ops in pending.items())
    return out


def _reads(seg: Segment) -> list:
    """The keys `seg` reads that it does not make."""
    made = {k for op in seg.ops for k in op.outs if k is not None}
    return [a for op in seg.ops for a in op.ins if isinstance(a, Key) and a not in made]


def _held(key, prev: Segment, maker: dict) -> bool:
    """Whether `key` is on `prev`'s device when `prev` runs."""
    seg = maker.get(key)
    return (seg is None or seg is prev or seg.device == prev.device
            or any(a is key for op in prev.ops for a in op.ins))


def _param_key(value, printed: dict) -> Any:
    """An equation parameter as a hashable key equal only for equal parameters: plain values
    by type and value, sequences element-wise, a closed jaxpr by its printed equations and
    its constants' identities (each microbatch's traced stage call is a jaxpr object of its
    own; `printed` keeps each object's text), anything else (shardings) by identity."""
    if value is None or isinstance(value, (bool, int, float, str, np.dtype)):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_param_key(v, printed) for v in value))
    if isinstance(value, jex_core.ClosedJaxpr):
        if id(value) not in printed:
            text = str(value.jaxpr)
            # An elided array or a host callback prints alike for different values.
            printed[id(value)] = (None if "..." in text or "callback" in text else
                                  ("jaxpr", text, tuple(id(c) for c in value.consts)))
        return printed[id(value)] or ("id", id(value))
    return ("id", id(value))


def structure_key(seg: Segment, printed: dict) -> tuple | None:
    """A key equal for two segments only if they lower to the same program: the same device,
    donation, input shapes, and equations (primitive, parameters, context, wiring); None for
    a segment with effects. `MpmdProgram` lowers one segment per key (a stage's call on every
    microbatch with its glue), not every segment."""
    local = {k: ("in", i) for i, k in enumerate(seg.inputs)}
    ops = []
    for op in seg.ops:
        eqn = op.eqn
        if eqn.effects:
            return None
        ins = []
        for a in op.ins:
            if isinstance(a, jex_core.Literal):
                ins.append(("lit", type(a.val), repr(a.val), str(a.aval)))
            elif a in local:
                ins.append(local[a])
            else:
                return None
        for k in op.outs:
            if k is not None:
                local[k] = ("v", len(local))
        ops.append((eqn.primitive, id(eqn.ctx), tuple(ins),
                    tuple(k is None for k in op.outs),
                    tuple((n, _param_key(v, printed)) for n, v in sorted(eqn.params.items()))))
    if any(k not in local for k in seg.outputs):
        return None
    return (seg.device, seg.stage, tuple(seg.donate),
            tuple((tuple(k.aval.shape), str(k.aval.dtype)) for k in seg.inputs),
            tuple(ops), tuple(local[k] for k in seg.outputs))
