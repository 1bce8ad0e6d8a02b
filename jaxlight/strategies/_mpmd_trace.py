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
   runs.
3. **Cut** the program into segments (`cut_segments`): each stage call alone, and runs of other
   equations of one device merged while no equation needs another device's open run.
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
    for op in reversed(ops):
        if op.device is None:
            users = [first_use[key] for key in op.outs if key in first_use]
            users = [d for d in users if d not in (ANY, None)]
            op.device = users[0] if users else 0
        for a in op.ins:
            if isinstance(a, Key):
                first_use[a] = op.device  # (reversed: the earliest consumer wins)


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
