"""One traced step run as a program per device (MPMD): the pipeline stages of `GPipe(mpmd=True)`.

SPMD arrays split evenly, so under `jax.jit` every pipeline device holds the same shape of
every parameter. Stages of different sizes need each device to hold its own stages' arrays and
nothing else, which means a different program per device. jax has no MPMD runtime, so this
module builds one from pieces jax has:

1. **Trace** the step (`jax.make_jaxpr`). `jaxlight.nn.Stages` calls each stage as a `jax.jit`
   function named `jaxlight_stage_<s>`, per microbatch; autodiff keeps the name on the
   forward and the transposed call, so every stage computation is one named equation.
2. **Place** every equation on a device: a stage call on its stage's device (stage s of S on
   device s·p/S); any other equation where most of its input bytes already are (the optimizer
   update of a leaf beside the leaf, the loss beside the last stage's output); equations with no
   placed input (constants, iota, random keys) where their first consumer runs.
3. **Cut** the program into segments: each stage call alone, and runs of other equations of one
   device merged while no equation needs another device's open run. Each segment is one
   `jax.jit` executable committed to its device (identical stage calls share one).
4. **Run** the segments in program order from the host. jax dispatches asynchronously, so
   while device 1 runs microbatch 0 of its stage, device 0 already runs microbatch 1 of its
   own: the GPipe schedule (forward m + p − 1 slots, then the backward in reverse). Values
   cross devices with `jax.device_put` (a copy of exactly the boundary's bytes); a value is
   dropped after its last use, and a donated input is donated to the segment that last reads
   it when an output of that segment can take its buffer.

No collectives are compiled: the only communication is the copies, which `transfers` lists.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxlight._errors import ConfigurationError
from jaxlight.analysis._flops import compiled_flops
from jaxlight.nn._mpmd import STAGE_PREFIX
from jaxlight.strategies._roofline import bytes_accessed

_STAGE = re.compile(STAGE_PREFIX + r"(\d+)")
#: A value every device holds (replicated inputs, constants): placed on no one device.
ANY = -1
_CALLS = ("pjit", "jit", "closed_call", "core_call")


class _Key:
    """One value of the flattened program (a jaxpr variable, renamed where inlined)."""

    __slots__ = ("aval",)

    def __init__(self, aval):
        self.aval = aval


@dataclasses.dataclass
class _Op:
    eqn: Any
    ins: list  # _Key or a Literal
    outs: list  # _Key or None (a dropped output)
    stage: int | None
    device: int | None = None


@dataclasses.dataclass
class _Segment:
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


def _nbytes(aval) -> int:
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
            inner_env = dict(zip(body.constvars, [_Const(c) for c in consts], strict=True))
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
        outs = [None if isinstance(v, jex_core.DropVar) else _Key(v.aval) for v in eqn.outvars]
        for var, key in zip(eqn.outvars, outs, strict=True):
            if key is not None:
                env[var] = key
        ops.append(_Op(eqn, ins, outs, stage))


def _read(atom, env):
    """A jaxpr atom's value in `env` (a literal is its own value)."""
    return atom if isinstance(atom, jex_core.Literal) else env[atom]


class _Const(_Key):
    """A constant of the traced program (placed on each device that reads it, once)."""

    __slots__ = ("value",)

    def __init__(self, value):
        super().__init__(jax.typeof(value))
        self.value = value


def _run_ops(ops: Sequence[_Op], inputs: Sequence[_Key], outputs: Sequence[_Key]) -> Callable:
    def run(*args):
        env = dict(zip(inputs, args, strict=True))
        for op in ops:
            vals = [a.val if isinstance(a, jex_core.Literal) else env[a] for a in op.ins]
            params = op.eqn.primitive.get_bind_params(op.eqn.params)
            with op.eqn.ctx.manager:
                out = op.eqn.primitive.bind(*vals, **params)
            out = out if op.eqn.primitive.multiple_results else [out]
            for key, value in zip(op.outs, out, strict=True):
                if key is not None:
                    env[key] = value
        return [env[k] for k in outputs]
    return run


@dataclasses.dataclass
class Transfer:
    """A device-to-device copy per call: `nbytes` from device `source` to `target`."""
    source: int
    target: int
    nbytes: int


class MpmdProgram:
    """A step traced once and run as one program per device (see the module docstring).

    Called like the `jax.jit` executable it replaces: `program(*args)` returns the step's
    outputs, placed by `out_shardings`.
    """

    def __init__(self, fn: Callable, abstract_args: tuple, in_shardings: Any, out_shardings: Any,
                 devices: Sequence[jax.Device], donate_argnums: tuple[int, ...] = ()):
        self.devices = list(devices)
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract_args)
        self._out_tree = jax.tree.structure(out_shape)
        in_flat = _broadcast(in_shardings, abstract_args)
        out_flat = _broadcast(out_shardings, out_shape)
        self._out_shardings = out_flat
        env: dict = {}
        inputs = [_Key(v.aval) for v in closed.jaxpr.invars]
        env.update(zip(closed.jaxpr.invars, inputs, strict=True))
        env.update((v, _Const(c)) for v, c in zip(closed.jaxpr.constvars, closed.consts,
                                                   strict=True))
        ops: list[_Op] = []
        _flatten(closed.jaxpr, env, ops)
        outputs = [_read(a, env) for a in closed.jaxpr.outvars]
        self._inputs, self._outputs = inputs, outputs
        donated = set()
        offsets = np.cumsum([0] + [len(jax.tree.leaves(a)) for a in abstract_args])
        for i in donate_argnums:
            donated.update(inputs[offsets[i]:offsets[i + 1]])
        self.stages = 1 + max((op.stage for op in ops if op.stage is not None), default=-1)
        p = len(self.devices)
        if self.stages and self.stages % p:
            raise ConfigurationError(
                f"GPipe(mpmd=True): the model's Stages has {self.stages} stages, which do not "
                f"split into {p} pipeline devices. Use a stage count that is a multiple of "
                f"{p}, or stages = a divisor of {self.stages}.")
        self._place(ops, inputs, outputs, in_flat, out_flat)
        self.segments = _segments(ops)
        self._home = {k: self._device_of_sharding(s) for k, s in zip(inputs, in_flat,
                                                                      strict=True)}
        self._home.update((k, seg.device) for seg in self.segments for op in seg.ops
                          for k in op.outs if k is not None)
        self._consts: dict = {}
        #: Bytes of placed inputs (the state) that a stage on another device reads per call.
        given = set(inputs)
        self.misplaced_bytes = sum(
            _nbytes(a.aval) for op in ops if op.stage is not None
            for a in dict.fromkeys(a for a in op.ins if isinstance(a, _Key))
            if a in given and self._home.get(a, ANY) not in (ANY, op.device))
        self._wire(inputs, outputs, donated)
        self._compile()

    # -- placing and cutting ----------------------------------------------------------------

    def _device_of_sharding(self, sharding) -> int:
        if sharding is None:
            return ANY
        devices = sharding.device_set
        if len(devices) == 1:
            (device,) = devices
            return self.devices.index(device) if device in self.devices else 0
        return ANY

    def _place(self, ops, inputs, outputs, in_flat, out_flat) -> None:
        home: dict = {k: self._device_of_sharding(s) for k, s in zip(inputs, in_flat, strict=True)}
        k = max(1, self.stages // len(self.devices)) if self.stages else 1
        for op in ops:
            if op.stage is not None:
                op.device = op.stage // k
            else:
                weight: dict[int, int] = {}
                for a in op.ins:
                    d = home.get(a, ANY) if isinstance(a, _Key) else ANY
                    if d not in (ANY, None):
                        weight[d] = weight.get(d, 0) + _nbytes(a.aval)
                op.device = max(weight, key=lambda d: (weight[d], -d)) if weight else None
            for key in op.outs:
                if key is not None:
                    home[key] = op.device
        # Equations without a placed input run where their first consumer runs.
        first_use: dict = {}
        for key, sharding in zip(outputs, out_flat, strict=True):
            if isinstance(key, _Key):
                first_use.setdefault(key, self._device_of_sharding(sharding))
        for op in reversed(ops):
            if op.device is None:
                users = [first_use[key] for key in op.outs if key in first_use]
                users = [d for d in users if d not in (ANY, None)]
                op.device = users[0] if users else 0
            for a in op.ins:
                if isinstance(a, _Key):
                    first_use[a] = op.device  # (reversed: the earliest consumer wins)

    def _wire(self, inputs, outputs, donated) -> None:
        """Each segment's inputs and outputs; when each value is last read; what is donated."""
        for seg in self.segments:
            defined: set = set()
            needed: dict = {}
            for op in seg.ops:
                needed.update((a, None) for a in op.ins
                              if isinstance(a, _Key) and a not in defined)
                defined.update(k for k in op.outs if k is not None)
            seg.inputs = list(needed)
        last_use: dict = {}
        for i, seg in enumerate(self.segments):
            for key in seg.inputs:
                last_use[key] = i
        final = {k for k in outputs if isinstance(k, _Key)}
        inputs_set = set(inputs)
        for i, seg in enumerate(self.segments):
            outs = [k for op in seg.ops for k in op.outs if k is not None]
            seg.outputs = [k for k in outs if k in final or last_use.get(k, -1) > i]
            free = list(seg.outputs)
            donate = []
            for j, key in enumerate(seg.inputs):
                if (last_use[key] != i or key in final or isinstance(key, _Const)
                        or (key in inputs_set and key not in donated)
                        or self._home[key] == ANY):
                    continue
                match = next((o for o in free if o.aval.shape == key.aval.shape
                              and o.aval.dtype == key.aval.dtype), None)
                if match is not None:
                    free.remove(match)
                    donate.append(j)
            seg.donate = tuple(donate)
        self._last_use = last_use
        self._final = final

    def _compile(self) -> None:
        """One executable per segment; segments that lower to the same program (a stage's
        call on every microbatch, the gradient sums between them) share one."""
        by_call: dict = {}
        by_text: dict = {}
        for seg in self.segments:
            sharding = jax.sharding.SingleDeviceSharding(self.devices[seg.device])
            abstract = [jax.ShapeDtypeStruct(k.aval.shape, k.aval.dtype, sharding=sharding)
                        for k in seg.inputs]
            call = None
            if seg.stage is not None:
                call = (id(seg.ops[0].eqn.params["jaxpr"]), seg.device, seg.donate,
                        tuple((a.shape, str(a.dtype)) for a in abstract))
                if call in by_call:
                    seg.executable = by_call[call]
                    continue
            run = _run_ops(seg.ops, seg.inputs, seg.outputs)
            run.__name__ = (f"{STAGE_PREFIX}{seg.stage}" if seg.stage is not None
                            else f"mpmd_device_{seg.device}")
            lowered = jax.jit(run, donate_argnums=seg.donate).lower(*abstract)
            text = (seg.device, lowered.as_text())
            if text not in by_text:
                by_text[text] = lowered.compile()
            seg.executable = by_text[text]
            if call is not None:
                by_call[call] = seg.executable
        self._executables = list({id(s.executable): s.executable for s in self.segments}
                                 .values())

    # -- running ----------------------------------------------------------------------------

    def _on(self, value, d: int):
        device = self.devices[d]
        if isinstance(value, jax.Array):
            if value.sharding.device_set == {device}:
                return value
            for shard in value.addressable_shards:
                if shard.device == device and value.sharding.is_fully_replicated:
                    return shard.data
        return jax.device_put(value, device)

    def __call__(self, *args):
        return self._run(args)

    def segment_seconds(self, *args) -> tuple[Any, list[tuple[int, int | None, float]]]:
        """Runs one call with each segment waited for before the next is dispatched (no
        overlap): `(outputs, [(device, stage or None, seconds) per segment])`, the serial
        costs a schedule's predicted step time is built from."""
        times: list = []
        return self._run(args, times), times

    def _run(self, args, times: list | None = None):
        flat = jax.tree.leaves(args)
        env: dict = {}
        for key, value in zip(self._inputs, flat, strict=True):
            d = self._home[key]
            env[key] = value if d == ANY else self._on(value, d)
        copies: dict = {}
        for i, seg in enumerate(self.segments):
            vals = []
            for key in seg.inputs:
                if isinstance(key, _Const):
                    value = self._consts.get((key, seg.device))
                    if value is None:
                        value = self._consts[(key, seg.device)] = jax.device_put(
                            key.value, self.devices[seg.device])
                    vals.append(value)
                    continue
                if self._home.get(key) == seg.device:
                    vals.append(env[key])
                    continue
                value = copies.get((key, seg.device))
                if value is None:
                    value = copies[(key, seg.device)] = self._on(env[key], seg.device)
                vals.append(value)
            for key in seg.inputs:  # drop what no later segment reads
                if self._last_use.get(key) == i and key not in self._final:
                    env.pop(key, None)
                    copies.pop((key, seg.device), None)
            if times is not None:
                jax.block_until_ready(vals)
                start = time.perf_counter()
            results = seg.executable(*vals)
            if times is not None:
                jax.block_until_ready(results)
                times.append((seg.device, seg.stage, time.perf_counter() - start))
            for key, value in zip(seg.outputs, results, strict=True):
                env[key] = value
            del vals, results
        out = []
        for key, sharding in zip(self._outputs, self._out_shardings, strict=True):
            value = key.val if isinstance(key, jex_core.Literal) else (
                key.value if isinstance(key, _Const) else env[key])
            out.append(value if sharding is None else _put(value, sharding))
        return jax.tree.unflatten(self._out_tree, out)

    def simulate(self, cost: Callable[[_Segment], float],
                 copy_seconds: Callable[[int], float] | None = None) -> dict[str, Any]:
        """The step's timeline if every device ran its segments in dispatch order, each as soon
        as its inputs exist, taking `cost(segment)`, a value read on another device arriving
        `copy_seconds(bytes)` after it is made (default: at once): `makespan` and each
        device's `busy` time. With unit-cost stage calls (`lambda s: s.stage is not None`)
        the GPipe schedule gives a makespan of 2(m + p − 1) and busy 2m per device."""
        free = [0.0] * len(self.devices)
        ready: dict = {}
        busy = [0.0] * len(self.devices)

        def arrives(key, d):
            at = ready.get(key, 0.0)
            if copy_seconds is not None and self._home.get(key, ANY) not in (ANY, d):
                at += copy_seconds(_nbytes(key.aval))
            return at

        for seg in self.segments:
            start = max([free[seg.device], *(arrives(k, seg.device) for k in seg.inputs)])
            end = start + cost(seg)
            free[seg.device] = end
            busy[seg.device] += end - start
            for key in seg.outputs:
                ready[key] = end
        return {"makespan": max(free), "busy": busy}

    @functools.cached_property
    def _costs(self) -> dict[int, tuple[float, float]]:
        """Per executable (by id): FLOPs (loops counted in full) and bytes accessed."""
        return {id(e): (compiled_flops(e).flops, bytes_accessed(e) or 0.0)
                for e in self._executables}

    def device_costs(self) -> list[dict[str, float]]:
        """Per device, per call: FLOPs and bytes accessed, summed over the executables it runs
        (each as often as it runs)."""
        out = [{"flops": 0.0, "bytes_accessed": 0.0} for _ in self.devices]
        for seg in self.segments:
            flops, accessed = self._costs[id(seg.executable)]
            out[seg.device]["flops"] += flops
            out[seg.device]["bytes_accessed"] += accessed
        return out

    def roofline_seconds(self, peak_flops: float, memory_bandwidth: float,
                         link_bandwidth: float) -> float:
        """The step's makespan (`simulate`) with each segment taking its roofline time (FLOPs
        at `peak_flops` or bytes at `memory_bandwidth`, the slower) and each copy its bytes at
        `link_bandwidth`: the pipeline's bubble and copies included."""
        costs = self._costs

        def cost(seg):
            flops, accessed = costs[id(seg.executable)]
            return max(flops / peak_flops, accessed / memory_bandwidth)

        return self.simulate(cost, lambda n: n / link_bandwidth)["makespan"]

    # -- what it compiled -------------------------------------------------------------------

    def transfers(self) -> list[Transfer]:
        """Every device-to-device copy one call makes (each value to each device, once)."""
        seen, out = set(), []
        for seg in self.segments:
            for key in seg.inputs:
                src = self._home.get(key, ANY)
                if src in (ANY, seg.device) or (key, seg.device) in seen:
                    continue
                seen.add((key, seg.device))
                out.append(Transfer(src, seg.device, _nbytes(key.aval)))
        return out

    def device_bytes(self) -> list[dict[str, int]]:
        """Per device, over one call replayed in the program's order: `argument` (its inputs),
        `output`, `temp` (the peak of its live values plus the running segment's temporaries,
        the copies it receives included) and `intermediate` (the same peak without the step's
        inputs and outputs: activations kept for the backward pass, gradients)."""
        p = len(self.devices)
        args, outs = [0] * p, [0] * p
        for key in self._inputs:
            d = self._home[key]
            for dev in (range(p) if d == ANY else (d,)):
                args[dev] += _nbytes(key.aval)
        for key in self._final:
            d = self._home.get(key, 0)
            outs[0 if d == ANY else d] += _nbytes(key.aval)
        temps = {id(e): e.memory_analysis().temp_size_in_bytes for e in self._executables}
        live, mid = [0] * p, [0] * p
        peak, peak_mid = [0] * p, [0] * p
        held: dict = {}
        for i, seg in enumerate(self.segments):
            d = seg.device
            new = [k for k in seg.inputs if self._home.get(k) != d and (k, d) not in held]
            new += [k for k in seg.outputs if (k, d) not in held]
            for key in new:
                held[(key, d)] = _nbytes(key.aval)
                live[d] += held[(key, d)]
                if key not in self._final:
                    mid[d] += held[(key, d)]
            temp = temps[id(seg.executable)]
            peak[d] = max(peak[d], live[d] + temp)
            peak_mid[d] = max(peak_mid[d], mid[d] + temp)
            for key in seg.inputs:
                if self._last_use.get(key) == i and key not in self._final:
                    for dev in range(p):
                        size = held.pop((key, dev), 0)
                        live[dev] -= size
                        mid[dev] -= size
        return [{"argument": args[d], "output": outs[d], "temp": peak[d],
                 "intermediate": peak_mid[d]} for d in range(p)]

    def memory_analysis(self) -> Any:
        """The device with the most bytes, in `jax.stages.Compiled.memory_analysis`'s fields
        (`temp`: its peak of values that are neither the step's inputs nor its outputs)."""
        rows = self.device_bytes()
        top = max(rows, key=lambda r: r["argument"] + r["output"] + r["intermediate"])
        return _MemoryStats(argument_size_in_bytes=top["argument"],
                            output_size_in_bytes=top["output"],
                            temp_size_in_bytes=top["intermediate"], alias_size_in_bytes=0,
                            generated_code_size_in_bytes=0)

    def as_text(self) -> str:
        """Every distinct executable's optimized HLO, one after another."""
        return "\n\n".join(e.as_text() for e in self._executables)

    def cost_analysis(self) -> dict[str, float]:
        """Summed over the segments one call runs (flops, bytes accessed)."""
        total: dict[str, float] = {}
        for seg in self.segments:
            costs = seg.executable.cost_analysis()
            for item in costs if isinstance(costs, list) else [costs]:
                for name, value in (item or {}).items():
                    total[name] = total.get(name, 0.0) + float(value)
        return total


@dataclasses.dataclass
class _MemoryStats:
    argument_size_in_bytes: int
    output_size_in_bytes: int
    temp_size_in_bytes: int
    alias_size_in_bytes: int
    generated_code_size_in_bytes: int


def _put(value, sharding):
    if isinstance(value, jax.Array) and value.sharding == sharding:
        return value
    return jax.device_put(value, sharding)


def _broadcast(prefix: Any, tree: Any) -> list:
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


def _segments(ops: list[_Op]) -> list[_Segment]:
    """Cuts the placed program into segments (see the module docstring, step 3)."""
    done: list[_Segment] = []
    open_: dict[int, _Segment] = {}
    where: dict = {}  # key -> the segment producing it

    def close(d):
        seg = open_.pop(d, None)
        if seg is not None:
            done.append(seg)

    for op in ops:
        for a in op.ins:
            seg = where.get(a) if isinstance(a, _Key) else None
            if seg is not None and seg.device != op.device and open_.get(seg.device) is seg:
                close(seg.device)
        if op.stage is not None:
            close(op.device)
            seg = _Segment(op.device, [op], stage=op.stage)
            done.append(seg)
        else:
            seg = open_.get(op.device)
            if seg is None:
                seg = open_[op.device] = _Segment(op.device, [])
            seg.ops.append(op)
        for key in op.outs:
            if key is not None:
                where[key] = seg
    for d in list(open_):
        close(d)
    return done
