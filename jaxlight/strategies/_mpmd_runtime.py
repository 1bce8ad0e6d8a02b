"""One traced step run as a program per device (MPMD): the pipeline stages of `GPipe(mpmd=True)`.

SPMD arrays split evenly, so under `jax.jit` every pipeline device holds the same shape of
every parameter. Stages of different sizes need each device to hold its own stages' arrays and
nothing else, which means a different program per device. jax has no MPMD runtime, so
`MpmdProgram` builds one from pieces jax has:

1. **Trace**, 2. **place** and 3. **cut** (`_mpmd_trace.py`): the step traced once
   (`jax.make_jaxpr`), every equation placed on a device (each pipeline stage's call on its
   stage's device), the program cut into segments: each stage call with the equations around
   it that the schedule lets it take (a microbatch's loss, the gradient sums), the rest in
   runs per device. Each segment is one `jax.jit` executable committed to its device
   (segments that lower alike share one), compiled here.
4. **Run** the segments in program order from the host. jax dispatches asynchronously, so
   while device 1 runs microbatch 0 of its stage, device 0 already runs microbatch 1 of its
   own: the GPipe schedule (forward m + p − 1 slots, then the backward in reverse). Values
   cross devices with `jax.device_put` (a copy of exactly the boundary's bytes); a value is
   dropped after its last use, and a donated input (the state) is donated to the segment that
   last reads it when an output of that segment can take its buffer. What each segment reads,
   copies, donates and drops is worked out once (`_mpmd_wire.py`): a call's host work is one
   executable call per segment and one copy per value crossing devices.

No collectives are compiled: the only communication is the copies, which `transfers` lists.

Replayed without running, the program also gives its cost model: the timeline of a schedule
(`simulate`, `roofline_seconds`, which `Auto` ranks by), per-device FLOPs and bytes
(`device_costs`, `device_bytes`, `memory_analysis`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

from jaxlight._errors import ConfigurationError
from jaxlight.analysis._flops import compiled_flops
from jaxlight.nn._mpmd import STAGE_PREFIX
from jaxlight.strategies._mpmd_schedule import order_ops, tag
from jaxlight.strategies._mpmd_split import split_backward
from jaxlight.strategies._mpmd_trace import (
    ANY,
    Const,
    Key,
    Op,
    Segment,
    broadcast,
    cut_segments,
    device_of_sharding,
    merge_glue,
    nbytes,
    place,
    structure_key,
    trace,
)
from jaxlight.strategies._mpmd_wire import COPY, LOCAL, plan_fetches, wire
from jaxlight.strategies._roofline import bytes_accessed


def _run_ops(ops: Sequence[Op], inputs: Sequence[Key], outputs: Sequence[Key]) -> Callable:
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
                 devices: Sequence[jax.Device], donate_argnums: tuple[int, ...] = (),
                 schedule: str = "gpipe", microbatches: int = 1, who: str = "GPipe(mpmd=True)"):
        self.devices = list(devices)
        self.schedule = schedule
        ops, inputs, outputs, out_shape = trace(fn, abstract_args)
        for op in ops:
            if op.stage is not None:
                op.kind, op.microbatch = tag(op)
        if schedule == "zb-h1":
            ops = split_backward(ops)
        self._out_tree = jax.tree.structure(out_shape)
        in_flat = broadcast(in_shardings, abstract_args)
        out_flat = broadcast(out_shardings, out_shape)
        self._out_shardings = out_flat
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
        place(ops, inputs, outputs, in_flat, out_flat, self.devices, self.stages,
              round_robin=schedule == "interleaved-1f1b")
        ops = order_ops(ops, schedule, p, microbatches, self.stages, who)
        self.segments = merge_glue(cut_segments(ops))
        self._home = {k: device_of_sharding(s, self.devices)
                      for k, s in zip(inputs, in_flat, strict=True)}
        self._home.update((k, seg.device) for seg in self.segments for op in seg.ops
                          for k in op.outs if k is not None)
        #: Bytes of placed inputs (the state) that a stage on another device reads per call.
        given = set(inputs)
        self.misplaced_bytes = sum(
            nbytes(a.aval) for op in ops if op.stage is not None
            for a in dict.fromkeys(a for a in op.ins if isinstance(a, Key))
            if a in given and self._home.get(a, ANY) not in (ANY, op.device))
        self._last_use, self._final = wire(self.segments, self._home, outputs, donated)
        self._compile()
        plan_fetches(self.segments, self._home, self._last_use, self._final, self.devices)
        self._plan()

    # -- wiring and compiling ---------------------------------------------------------------

    def _compile(self) -> None:
        """One executable per segment; segments that lower to the same program (a stage's
        call on every microbatch, the gradient sums between them) share one. A segment whose
        `structure_key` was lowered before is not lowered again (lowering was a third of the
        build of a 1F1B program of 24 microbatches)."""
        by_call: dict = {}
        by_text: dict = {}
        by_structure: dict = {}
        printed: dict = {}  # id of a stage call's jaxpr -> its key (`structure_key`)
        self.lowered = 0  # segments lowered (the rest share an executable by their keys)
        for seg in self.segments:
            sharding = jax.sharding.SingleDeviceSharding(self.devices[seg.device])
            abstract = [jax.ShapeDtypeStruct(k.aval.shape, k.aval.dtype, sharding=sharding)
                        for k in seg.inputs]
            call = None
            if seg.stage is not None and len(seg.ops) == 1:
                call = (id(seg.ops[0].eqn.params["jaxpr"]), seg.device, seg.donate,
                        tuple((a.shape, str(a.dtype)) for a in abstract))
                if call in by_call:
                    seg.executable = by_call[call]
                    continue
            key = structure_key(seg, printed)
            if key is not None and key in by_structure:
                seg.executable = by_structure[key]
                continue
            run = _run_ops(seg.ops, seg.inputs, seg.outputs)
            run.__name__ = (f"{STAGE_PREFIX}{seg.stage}" if seg.stage is not None
                            else f"mpmd_device_{seg.device}")
            lowered = jax.jit(run, donate_argnums=seg.donate).lower(*abstract)
            self.lowered += 1
            text = (seg.device, lowered.as_text())
            if text not in by_text:
                by_text[text] = lowered.compile()
            seg.executable = by_text[text]
            if call is not None:
                by_call[call] = seg.executable
            if key is not None:
                by_structure[key] = seg.executable
        self._executables = list({id(s.executable): s.executable for s in self.segments}
                                 .values())

    # -- running ----------------------------------------------------------------------------

    def _plan(self) -> None:
        """Where `_run` takes each step input from, and which outputs it places or copies: a
        value returned twice (Adam's two zero moments, one value in the traced program) or a
        constant of the program comes back as a buffer of its own, as from `jax.jit`, so that
        donating one output (the next step's state) cannot delete another or the constant."""
        self._in_homes = [(k, self._home[k], None if self._home[k] == ANY
                           else jax.sharding.SingleDeviceSharding(self.devices[self._home[k]]))
                          for k in self._inputs]
        made = {k: seg.device for seg in self.segments for k in seg.outputs}
        self._out_plan = []
        seen: set = set()
        for key, sharding in zip(self._outputs, self._out_shardings, strict=True):
            fresh = isinstance(key, Const) or (isinstance(key, Key) and key in seen)
            if isinstance(key, Key):
                seen.add(key)
            placed = sharding is None or (
                isinstance(key, Key) and key in made
                and isinstance(sharding, jax.sharding.SingleDeviceSharding)
                and sharding.device_set == {self.devices[made[key]]})
            self._out_plan.append((key, None if placed and not fresh else sharding, fresh))

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
        env: dict = {}
        for (key, d, sharding), value in zip(self._in_homes, jax.tree.leaves(args),
                                             strict=True):
            env[key] = (value if d == ANY or (isinstance(value, jax.Array)
                                              and value.sharding == sharding)
                        else self._on(value, d))
        copies: dict = {}
        for seg in self.segments:
            d = seg.device
            vals = []
            for how, key in seg.fetch:
                if how is LOCAL:
                    vals.append(env[key])
                elif how is COPY:
                    value = copies.get((key, d))
                    if value is None:
                        value = copies[(key, d)] = self._on(env[key], d)
                    vals.append(value)
                else:
                    vals.append(key)  # a constant, already on the device
            for key in seg.drop:  # what no later segment reads
                env.pop(key, None)
            for pair in seg.drop_copies:
                copies.pop(pair, None)
            if times is not None:
                jax.block_until_ready(vals)
                start = time.perf_counter()
            results = seg.executable(*vals)
            if times is not None:
                jax.block_until_ready(results)
                times.append((seg.device, seg.stage, time.perf_counter() - start))
            env.update(zip(seg.outputs, results, strict=True))
            del vals, results
        out = []
        for key, sharding, fresh in self._out_plan:
            value = key.val if isinstance(key, jex_core.Literal) else (
                key.value if isinstance(key, Const) else env[key])
            out.append(jax.device_put(value, sharding, may_alias=False) if fresh
                       else value if sharding is None else _put(value, sharding))
        return jax.tree.unflatten(self._out_tree, out)

    def simulate(self, cost: Callable[[Segment], float],
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
                at += copy_seconds(nbytes(key.aval))
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
                out.append(Transfer(src, seg.device, nbytes(key.aval)))
        return out

    def device_bytes(self) -> list[dict[str, int]]:
        """Per device, over one call replayed in the program's order: `argument` (its inputs),
        `output`, `temp` (the peak of its live values plus the running segment's temporaries,
        the copies it receives included), `intermediate` (the same peak without the step's
        inputs and outputs: activations kept for the backward pass, gradients) and
        `activations` (the peak of the forward stage calls' outputs alone, copies included:
        what a pipeline schedule keeps for the backward pass)."""
        p = len(self.devices)
        args, outs = [0] * p, [0] * p
        for key in self._inputs:
            d = self._home[key]
            for dev in (range(p) if d == ANY else (d,)):
                args[dev] += nbytes(key.aval)
        for key in self._final:
            d = self._home.get(key, 0)
            outs[0 if d == ANY else d] += nbytes(key.aval)
        temps = {id(e): e.memory_analysis().temp_size_in_bytes for e in self._executables}
        live, mid, act = [0] * p, [0] * p, [0] * p
        peak, peak_mid, peak_act = [0] * p, [0] * p, [0] * p
        held: dict = {}
        forward = {k for seg in self.segments if seg.stage is not None
                   and seg.call.kind == "F" for k in seg.call.outs if k in seg.outputs}
        for i, seg in enumerate(self.segments):
            d = seg.device
            new = [k for k in seg.inputs if self._home.get(k) != d and (k, d) not in held]
            new += [k for k in seg.outputs if (k, d) not in held]
            for key in new:
                held[(key, d)] = nbytes(key.aval)
                live[d] += held[(key, d)]
                if key not in self._final:
                    mid[d] += held[(key, d)]
                if key in forward:
                    act[d] += held[(key, d)]
                    peak_act[d] = max(peak_act[d], act[d])
            temp = temps[id(seg.executable)]
            peak[d] = max(peak[d], live[d] + temp)
            peak_mid[d] = max(peak_mid[d], mid[d] + temp)
            for key in seg.inputs:
                if self._last_use.get(key) == i and key not in self._final:
                    for dev in range(p):
                        size = held.pop((key, dev), 0)
                        live[dev] -= size
                        mid[dev] -= size
                        act[dev] -= size if key in forward else 0
        return [{"argument": args[d], "output": outs[d], "temp": peak[d],
                 "intermediate": peak_mid[d], "activations": peak_act[d]} for d in range(p)]

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
