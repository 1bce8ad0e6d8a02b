"""Pipeline schedules of `GPipe(mpmd=True)`: which microbatch's forward or backward pass each
device runs next (GPipe, 1F1B, ZB-H1), their textbook timelines, and the traced step's
operations put in that order.

GPipe runs every microbatch's forward pass before any backward pass, so each device holds the
activations of all m microbatches. 1F1B (PipeDream-flush, Megatron's default, torchtitan's
`Schedule1F1B`) lets device d run only p − d forward passes ahead, then alternates one forward
and one backward pass: a device holds at most p − d microbatches' activations whatever m is,
with GPipe's bubble (p − 1)/(m + p − 1). ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline
Parallelism") splits each backward pass into the input gradient (B, which the previous stage
waits for) and the weight gradient (W, which nobody waits for), and runs device d's W passes d
microbatches late so that they fill the bubble at the end of the step: the same activation
memory as 1F1B, and with B and W of equal cost a bubble of (p − 1)/(3m + p − 1) against
1F1B's 3(p − 1)/(3(m + p − 1)).

How a schedule is applied (the runtime is `_mpmd_runtime.MpmdProgram`):

1. The step's gradient runs one microbatch at a time (`microbatch_gradients`): m
   `value_and_grad` calls, each inside a name scope `jaxlight_microbatch_<i>`, the gradients
   summed at least in float32. Each microbatch then has its own loss, so its backward pass can start
   as soon as its forward pass has left the last stage (a whole-batch loss would wait for
   every microbatch's forward pass).
2. Every stage call of the traced step is tagged with its microbatch (the name scope) and its
   kind: F, or B for a transposed call (`transpose(` in its name stack); ZB-H1 splits each B
   into B and W (`_mpmd_split.py`).
3. `order_ops` gives each stage call the start time of its (device, kind, microbatch) in the
   schedule's textbook timeline (`timeline`), every other operation the time its latest
   input is ready (a stage call's output at the call's end: gradient sums, the loss, as soon
   as possible) or, when it reads only the step's
   inputs, that of its first consumer (microbatch slices: as late as possible; one pass
   earlier for a consumer on another device), and sorts the
   operations by that time. The times grow along every edge, so the sorted program is still
   in dependency order; the runtime then cuts and dispatches it as before, and every device
   receives its stage calls in the schedule's order.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.nn._mpmd import MpmdConfig, active_mpmd, mpmd_context
from jaxlight.step._microbatch import widened
from jaxlight.strategies._mpmd_trace import Key

#: The schedules of `GPipe(mpmd=True)`, with what each holds and costs (the error lists them).
SCHEDULES = {
    "gpipe": "every forward pass, then every backward pass: m microbatches' activations held",
    "1f1b": "one forward, one backward: at most p microbatches' activations, GPipe's bubble",
    "zb-h1": "1F1B with the backward split into input and weight gradients, the weight "
             "gradients filling the bubble: 1F1B's memory, about a third of its bubble",
    "interleaved-1f1b": "1F1B over v = S/p chunks per device (stage s on device s mod p): "
                        "bubble (p − 1)/(v·m + p − 1) for v times the copies; m a multiple of p",
}
#: The name scope around each microbatch's gradient (its index follows).
MICROBATCH = "jaxlight_microbatch_"
_MICROBATCH = re.compile(MICROBATCH + r"(\d+)")


def check_schedule(schedule: Any, who: str, supported: Sequence[str] = tuple(SCHEDULES),
                   why: str = "") -> str:
    """The schedule's canonical name; a clear error for an unknown or unsupported one."""
    name = schedule.lower().replace("_", "-") if isinstance(schedule, str) else schedule
    if name in supported:
        return name
    known = isinstance(name, str) and name in SCHEDULES
    listed = ", ".join(f"{s!r} ({SCHEDULES[s]})" for s in supported)
    raise ConfigurationError(
        f"{who}: schedule={schedule!r} is "
        f"{'not supported here' + why if known else 'not a pipeline schedule'}. Supported: "
        f"{listed}.{'' if known else suggest(str(name), supported)}")


# -- the textbook schedules ------------------------------------------------------------------


def device_orders(schedule: str, p: int, m: int) -> list[list[tuple[str, int]]]:
    """Per device, the schedule's `(kind, microbatch)` passes in order: kind F (forward), B
    (backward; under ZB-H1 the input gradient only) or W (ZB-H1's weight gradient)."""
    orders = []
    for d in range(p):
        if schedule == "gpipe":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in reversed(range(m))])
            continue
        warm = min(p - d - 1, m)
        order = [("F", i) for i in range(warm)]
        lag = d if schedule == "zb-h1" else None
        w = 0
        for i in range(m):
            if warm + i < m:
                order.append(("F", warm + i))
            order.append(("B", i))
            while lag is not None and w <= i - lag:
                order.append(("W", w))
                w += 1
        order += [("W", j) for j in range(w, m)] if lag is not None else []
        orders.append(order)
    return orders


def interleaved_orders(p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Interleaved 1F1B (Megatron's virtual pipeline): per device d, `(kind, microbatch,
    stage)` in order, stage c·p + d being d's c-th chunk. Forward passes go through groups of
    p microbatches chunk by chunk; device d runs 2(p − d − 1) + (v − 1)·p of them ahead, then
    alternates one forward and one backward pass (m must be a multiple of p)."""
    orders = []
    for d in range(p):
        def one(k, forward, d=d):
            c = (k // p) % v
            return ("F" if forward else "B", (k // (p * v)) * p + k % p,
                    (c if forward else v - 1 - c) * p + d)
        n = m * v
        warm = min(2 * (p - d - 1) + (v - 1) * p, n)
        order = [one(k, True) for k in range(warm)]
        for j in range(n - warm):
            order += [one(warm + j, True), one(j, False)]
        orders.append(order + [one(j, False) for j in range(n - warm, n)])
    return orders


def timeline(schedule: str, p: int, m: int, cost: Callable[[str], float] = lambda kind: 1.0,
             v: int = 1) -> dict[tuple[int, str, int], tuple[float, float]]:
    """`{(slot, kind, microbatch): (start, end)}` when every device runs its passes in the
    schedule's order, each as soon as its inputs exist, taking `cost(kind)`: F after the
    previous slot's F of the microbatch, B after the next slot's B (the last slot's after its
    own F), W after its own B. A slot is a device (its stages together), or under interleaved
    1F1B one of the p·v stages (stage s on device s mod p)."""
    if schedule == "interleaved-1f1b":
        orders = interleaved_orders(p, m, v)
    else:
        orders = [[(kind, i, d) for kind, i in order]
                  for d, order in enumerate(device_orders(schedule, p, m))]
    last = p * v - 1 if schedule == "interleaved-1f1b" else p - 1
    done: dict = {}
    free = [0.0] * p
    at = [0] * p
    left = sum(len(o) for o in orders)
    while left:
        moved = False
        for d in range(p):
            while at[d] < len(orders[d]):
                kind, i, s = orders[d][at[d]]
                need = {"F": (s - 1, "F", i) if s else None,
                        "B": (s + 1, "B", i) if s < last else (s, "F", i),
                        "W": (s, "B", i)}[kind]
                if need is not None and need not in done:
                    break
                start = max(free[d], done[need][1] if need else 0.0)
                done[(s, kind, i)] = (start, start + cost(kind))
                free[d] = start + cost(kind)
                at[d] += 1
                left -= 1
                moved = True
        if not moved:  # (each order respects the dependencies: cannot happen)
            raise AssertionError(f"schedule {schedule} deadlocks at p={p}, m={m}, v={v}")
    return done


def makespan(schedule: str, p: int, m: int, v: int = 1) -> int:
    """The textbook step length in units of one pass per stage: F = B = 1 for GPipe and 1F1B
    (2(m + p − 1)); F = B = W = 1 for ZB-H1 (3m + p − 1 when m ≥ p; with fewer microbatches
    the last microbatch's chain of passes, 2m + 2p − 1, is longer); interleaved 1F1B in passes
    of one chunk (1/v of a device's stages), 2(v·m + p − 1)."""
    if schedule == "zb-h1":
        return 3 * m + p - 1 + max(0, p - m)
    if schedule == "interleaved-1f1b":
        return 2 * (v * m + p - 1)
    return 2 * (m + p - 1)


def bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The fraction of the step each device idles: (p − 1)/(m + p − 1) for GPipe and 1F1B;
    (p − 1)/(3m + p − 1) for ZB-H1 when m ≥ p; (p − 1)/(v·m + p − 1) interleaved."""
    work = {"zb-h1": 3 * m, "interleaved-1f1b": 2 * v * m}.get(schedule, 2 * m)
    return 1 - work / makespan(schedule, p, m, v)


# -- the gradient, one microbatch at a time --------------------------------------------------


def microbatch_gradients(grad_fn: Callable, m: int, devices: int, remat: bool) -> Callable:
    """`grad_fn(params, rest, batch)` as m calls on contiguous microbatches of the batch, each
    in a `jaxlight_microbatch_<i>` name scope with `Stages` running it as one microbatch;
    gradients summed at least in float32 (`widened`: float64 in float64) and divided by m,
    loss and metrics averaged in float32, `rest` threaded through the microbatches in order (as
    `callbacks.Microbatches`)."""

    def run(params, rest, batch):
        outer = active_mpmd()
        rows = jax.tree.leaves(batch)[0].shape[0]
        size = rows // m
        total = losses = metrics_sum = None
        for i in range(m):
            part = jax.tree.map(lambda v, i=i: _rows(v, i * size, size), batch)
            with jax.named_scope(f"{MICROBATCH}{i}"), \
                    mpmd_context(MpmdConfig(devices, 1, remat)) as inner:
                (loss, (metrics, rest)), grads = grad_fn(params, rest, part)
            if outer is not None:
                outer.calls += inner.calls
            grads = jax.tree.map(widened, grads)
            total = grads if total is None else jax.tree.map(jnp.add, total, grads)
            loss = loss.astype(jnp.float32)
            metrics = jax.tree.map(_as_float32, metrics)  # as the loss, and Microbatches'
            losses = loss if losses is None else losses + loss
            metrics_sum = metrics if metrics_sum is None else jax.tree.map(
                jnp.add, metrics_sum, metrics)
        grads = jax.tree.map(lambda g, p: (g / m).astype(jnp.result_type(p)), total, params)
        metrics = jax.tree.map(lambda v: v / m, metrics_sum)
        return (losses / m, (metrics, rest)), grads

    return run


def _rows(value, start: int, size: int):
    """`value[start:start + size]`, the offset an array constant (an input of the executable
    that slices, not a number in its program): the stage call the slice joins (`merge_glue`)
    then compiles once for every microbatch, not once each. One constant per leaf, so that
    the labels' slice runs where the labels are read."""
    offset = jnp.asarray(np.full((1,), start, np.int32))[0]
    return jax.lax.dynamic_slice_in_dim(value, offset, size)


def _as_float32(x):
    return x.astype(jnp.float32) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x


# -- the step's operations in the schedule's order -------------------------------------------


def tag(op) -> tuple[str, int | None]:
    """A stage call's `(kind, microbatch)` from its name stack: B for a transposed call, else
    F; microbatch None outside a microbatch scope (GPipe's whole-batch gradient, evaluation)."""
    stack = str(op.eqn.source_info.name_stack)
    found = _MICROBATCH.search(stack)
    return ("B" if "transpose(" in stack else "F"), None if found is None else int(found.group(1))


def order_ops(ops: list, schedule: str, p: int, m: int, stages: int, who: str) -> list:
    """`ops` (placed, each stage call tagged with `kind` and `microbatch`) sorted into the
    schedule's order (see the module docstring, step 3); unchanged for GPipe or an untagged
    program."""
    calls = [op for op in ops if op.stage is not None]
    if schedule == "gpipe" or not calls or all(op.microbatch is None for op in calls):
        return ops
    k = max(1, stages // p)
    interleaved = schedule == "interleaved-1f1b"
    times = timeline(schedule, p, m, v=k if interleaved else 1)
    seen: set = set()
    for op in calls:
        key = (op.stage, op.kind, op.microbatch)
        if op.microbatch is None or key in seen or op.microbatch >= m:
            raise ConfigurationError(
                f"{who}: the step calls stage {op.stage} "
                f"{'outside the per-microbatch gradient' if op.microbatch is None else 'twice'}"
                f" ({op.kind}, microbatch {op.microbatch}), so the {schedule!r} schedule "
                "cannot order it. Call the Stages module once per training step, or use "
                "schedule='gpipe'.")
        seen.add(key)
    prio: list = [None] * len(ops)
    when: dict = {}
    users: dict = {}
    for j, op in enumerate(ops):
        ins = [a for a in op.ins if isinstance(a, Key) and a in when]
        ready = None
        if op.stage is not None:
            sub = 0 if interleaved else (op.stage % k if op.kind == "F" else k - 1 - op.stage % k)
            start, end = times[(op.stage if interleaved else op.device, op.kind, op.microbatch)]
            prio[j], ready = (start, sub), (end, sub)
        elif ins:
            prio[j] = ready = max(when[a] for a in ins)
        for a in op.ins:
            if isinstance(a, Key):
                users.setdefault(a, []).append(j)
        if ready is not None:  # what reads a stage call's outputs waits for its end
            when.update((key, ready) for key in op.outs if key is not None)
    for j in reversed(range(len(ops))):
        if prio[j] is None:
            # For a reader on another device, one pass earlier: the value must be made before
            # this device starts the stage call that runs while the reader waits for it (the
            # labels of a microbatch, sliced where the batch is, for the loss beside the last
            # stage).
            later = [prio[u] if ops[u].device == ops[j].device else (prio[u][0] - 1, 0)
                     for key in ops[j].outs if key is not None
                     for u in users.get(key, ()) if prio[u] is not None]
            prio[j] = min(later, default=(-1.0, 0))
    return _ready_first(ops, [(prio[j], j) for j in range(len(ops))])


def _ready_first(ops: list, keys: list) -> list:
    """The ops in order of `keys`, except that none comes before an op it reads from (Kahn's
    topological sort, the smallest key among the ready ones first). With keys that grow along
    every edge this is the plain sort; a step whose microbatches depend on each other (state
    threaded from one microbatch's last stage into the next one's first) stays correct."""
    producer: dict = {}
    for j, op in enumerate(ops):
        producer.update((key, j) for key in op.outs if key is not None)
    needs = [{producer[a] for a in op.ins if isinstance(a, Key) and a in producer}
             for op in ops]
    waiting = [len(n) for n in needs]
    readers: dict = {}
    for j, n in enumerate(needs):
        for i in n:
            readers.setdefault(i, []).append(j)
    ready = [keys[j] for j in range(len(ops)) if not waiting[j]]
    heapq.heapify(ready)
    out = []
    while ready:
        key = heapq.heappop(ready)
        j = key[-1]
        out.append(ops[j])
        for r in readers.get(j, ()):
            waiting[r] -= 1
            if not waiting[r]:
                heapq.heappush(ready, keys[r])
    return out


__all__ = ["MICROBATCH", "SCHEDULES", "bubble", "check_schedule", "device_orders",
           "interleaved_orders", "makespan",
           "microbatch_gradients", "order_ops", "tag", "timeline"]
