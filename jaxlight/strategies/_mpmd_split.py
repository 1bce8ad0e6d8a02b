"""ZB-H1's split backward pass: each transposed stage call cut into the input gradient (B) and
the weight gradient (W), for `GPipe(schedule="zb-h1", mpmd=True)`.

A stage's transposed call (`jaxlight_stage_<s>` under `transpose(`) computes the cotangents of
the forward call's differentiated inputs in order: the stage's parameters, then its input x
(`jaxlight.nn._mpmd.stage_call` calls `fn(params, x)`), when x depends on parameters. The
previous stage waits only for x's cotangent. `split_backward` cuts the call's jaxpr in two:

- B: the equations the x cotangent needs (a backward slice of the jaxpr), returning that
  cotangent and every value of its own that W reads (the cotangents at each layer's output);
- W: the remaining equations the parameter gradients need, reading the call's inputs and B's
  values. No equation runs twice: B + W is the transposed call's work.

The x cotangent is recognized as the call's last output when it has the forward call's last
input's shape and dtype (x is one array for `Stages`); a call without one (the first stage
reading the batch: nothing to send back) stays one W pass, and a call with only the x
cotangent (a stage without parameters) one B pass. Whatever is recognized, the two halves
compute exactly the transposed call's outputs; the recognition only decides what the
schedule can run early.
"""

from __future__ import annotations

from typing import Any

from jax.extend import core as jex_core

from jaxlight.strategies._mpmd_trace import Key, Op


def _backward_slice(eqns: list, wanted: list, skip: frozenset = frozenset()) -> list:
    """The equations (in order) that the variables `wanted` need, not counting `skip`."""
    need = {v for v in wanted if isinstance(v, jex_core.Var)}
    picked = []
    for eqn in reversed(eqns):
        if id(eqn) in skip:
            continue
        if any(v in need for v in eqn.outvars):
            picked.append(eqn)
            need.update(v for v in eqn.invars if isinstance(v, jex_core.Var))
    picked.reverse()
    return picked


def _split_jaxpr(closed, n_params: int) -> tuple[Any, Any, list[int], int]:
    """`(B, W, W's inputs taken from the call's inputs (indexes), values B hands to W)`."""
    jaxpr = closed.jaxpr
    grads, dx = jaxpr.outvars[:n_params], jaxpr.outvars[n_params:]
    b_eqns = _backward_slice(list(jaxpr.eqns), dx)
    in_b = frozenset(id(e) for e in b_eqns)
    w_eqns = _backward_slice(list(jaxpr.eqns), grads, in_b)
    b_made = {v for e in b_eqns for v in e.outvars}
    w_made = {v for e in w_eqns for v in e.outvars}
    consts = set(jaxpr.constvars)
    reads = dict.fromkeys(v for e in w_eqns for v in e.invars if isinstance(v, jex_core.Var))
    reads.update(dict.fromkeys(v for v in grads if isinstance(v, jex_core.Var)))
    reads = [v for v in reads if v not in w_made and v not in consts]
    carried = [v for v in reads if v in b_made]
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    from_call = [v for v in reads if v not in b_made]
    b = jex_core.Jaxpr(jaxpr.constvars, jaxpr.invars, [*dx, *carried], b_eqns, jaxpr.effects,
                       jaxpr.debug_info)
    w = jex_core.Jaxpr(jaxpr.constvars, [*from_call, *carried], grads, w_eqns, jaxpr.effects,
                       jaxpr.debug_info)
    return (jex_core.ClosedJaxpr(b, closed.consts), jex_core.ClosedJaxpr(w, closed.consts),
            [position[v] for v in from_call], len(carried))


def _call_eqn(eqn, closed, n_in: int, suffix: str):
    """`eqn` (a jit call) calling `closed` instead, with `n_in` inputs."""
    params = eqn.params
    n_out = len(closed.jaxpr.outvars)
    unspecified = params["out_shardings"][0]
    new = dict(params, jaxpr=closed, in_shardings=(unspecified,) * n_in,
               out_shardings=(unspecified,) * n_out, in_layouts=(None,) * n_in,
               out_layouts=(None,) * n_out, donated_invars=(False,) * n_in,
               name=f"{params['name']}_{suffix}")
    return eqn.replace(params=new)


def _n_params(op: Op, forward: Op | None) -> int | None:
    """How many of the transposed call's outputs are parameter gradients (the rest: x's
    cotangent), or None when it cannot be split (one kind of output only)."""
    outs = op.outs
    if forward is None or len(outs) < 2 or op.eqn.primitive.name not in ("jit", "pjit"):
        return None
    last, x = outs[-1], forward.ins[-1]
    if last is None or not isinstance(x, Key):
        return None
    same = (getattr(last.aval, "shape", None) == getattr(x.aval, "shape", None)
            and getattr(last.aval, "dtype", None) == getattr(x.aval, "dtype", None))
    shardings = op.eqn.params.get("out_shardings", ())
    if not same or len({repr(s) for s in shardings}) != 1:
        return None
    return len(outs) - 1


def split_backward(ops: list[Op]) -> list[Op]:
    """`ops` with every transposed stage call that has both parameter gradients and an input
    cotangent replaced by its B and W halves (see the module docstring)."""
    forward = {(op.stage, op.microbatch): op for op in ops if op.kind == "F"}
    cache: dict = {}
    out: list[Op] = []
    for op in ops:
        if op.kind != "B":
            out.append(op)
            continue
        fwd = forward.get((op.stage, op.microbatch))
        n = _n_params(op, fwd)
        if n is None:
            # Only parameter gradients (no input cotangent to send back): all of it is W.
            if fwd is not None and not _sends_back(op, fwd):
                op.kind = "W"
            out.append(op)
            continue
        closed = op.eqn.params["jaxpr"]
        key = (id(closed), n)
        if key not in cache:
            cache[key] = _split_jaxpr(closed, n)
        b, w, from_call, n_carried = cache[key]
        carried = [Key(v.aval) for v in b.jaxpr.outvars[len(op.outs) - n:]]
        dx = op.outs[n:]
        out.append(Op(_call_eqn(op.eqn, b, len(op.ins), "input_grad"), list(op.ins),
                      [*dx, *carried], op.stage, op.device, "B", op.microbatch))
        out.append(Op(_call_eqn(op.eqn, w, len(from_call) + n_carried, "weight_grad"),
                      [op.ins[i] for i in from_call] + carried, list(op.outs[:n]), op.stage,
                      op.device, "W", op.microbatch))
    return out


def _sends_back(op: Op, forward: Op) -> bool:
    """Whether the transposed call's only output is its input's cotangent (a stage without
    parameters): then it is all B."""
    x = forward.ins[-1]
    return (len(op.outs) == 1 and op.outs[0] is not None and isinstance(x, Key)
            and op.outs[0].aval.shape == x.aval.shape)


__all__ = ["split_backward"]
