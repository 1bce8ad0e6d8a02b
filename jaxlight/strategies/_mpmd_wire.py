"""What each segment of an MPMD program reads, writes, donates and drops, worked out once when
`_mpmd_runtime.MpmdProgram` is built, so that a call only looks things up (its host work per
segment is one executable call and, for a value made on another device, one copy)."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from jaxlight.strategies._mpmd_trace import ANY, Const, Key, Segment

#: How a call fetches a segment's input: a value on the segment's device, a copy of a value
#: made on another device (once per device), or a constant placed on the device beforehand.
LOCAL, COPY, CONST = "local", "copy", "const"


def wire(segments: Sequence[Segment], home: dict, outputs: Sequence,
         donated: set) -> tuple[dict, set]:
    """Sets each segment's `inputs`, `outputs` and `donate`: `(the last segment reading each
    value, the step's outputs)`. `home`: each value's device."""
    for seg in segments:
        defined: set = set()
        needed: dict = {}
        for op in seg.ops:
            needed.update((a, None) for a in op.ins if isinstance(a, Key) and a not in defined)
            defined.update(k for k in op.outs if k is not None)
        seg.inputs = list(needed)
    last_use: dict = {}
    for i, seg in enumerate(segments):
        for key in seg.inputs:
            last_use[key] = i
    final = {k for k in outputs if isinstance(k, Key)}
    for i, seg in enumerate(segments):
        outs = [k for op in seg.ops for k in op.outs if k is not None]
        seg.outputs = [k for k in outs if k in final or last_use.get(k, -1) > i]
        free = list(seg.outputs)
        donate = []
        for j, key in enumerate(seg.inputs):
            # Only the caller's donated inputs (the state), not the step's intermediate values:
            # XLA keeps a donated buffer that it still reads after an output took it by copying
            # it (the input x of a backward pass, read for the weight gradient after the input
            # gradient took its buffer; the summed gradients, read by Adam's two moments), so
            # donating those adds two copies of each per call to save a buffer that is freed
            # when the call ends anyway.
            if (last_use[key] != i or key in final or key not in donated
                    or home[key] == ANY):
                continue
            match = next((o for o in free if o.aval.shape == key.aval.shape
                          and o.aval.dtype == key.aval.dtype), None)
            if match is not None:
                free.remove(match)
                donate.append(j)
        seg.donate = tuple(donate)
    return last_use, final


def plan_fetches(segments: Sequence[Segment], home: dict, last_use: dict, final: set,
                 devices: Sequence[jax.Device]) -> None:
    """Sets each segment's `fetch` (how each input is taken: `LOCAL`, `COPY` or `CONST`, with
    the constant placed on the device here), `drop` (values no later segment reads) and
    `drop_copies` (copies no later segment of that device reads)."""
    last_read: dict = {}  # (key, device) -> the last segment reading it there
    for i, seg in enumerate(segments):
        for key in seg.inputs:
            last_read[(key, seg.device)] = i
    consts: dict = {}
    for i, seg in enumerate(segments):
        d = seg.device
        seg.fetch = []
        for key in seg.inputs:
            if isinstance(key, Const):
                if (key, d) not in consts:
                    consts[(key, d)] = jax.device_put(key.value, devices[d])
                seg.fetch.append((CONST, consts[(key, d)]))
            else:
                seg.fetch.append((LOCAL if home.get(key) == d else COPY, key))
        seg.drop = [k for k in seg.inputs if last_use[k] == i and k not in final
                    and not isinstance(k, Const)]
        seg.drop_copies = [(k, d) for how, k in seg.fetch if how is COPY
                           and last_read[(k, d)] == i]


__all__ = ["CONST", "COPY", "LOCAL", "plan_fetches", "wire"]
