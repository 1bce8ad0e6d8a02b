"""The interleaved (circular) pipeline schedule: v chunks of layers per stage, a smaller bubble.

`GPipe(stages=p, microbatches=m, repeats=v)` (or `Hybrid(..., repeats=v)`) runs a `Stacked`
block of L layers as p·v chunks of L/(p·v) layers; chunk c = r·p + s sits on stage s, so each
stage holds v non-adjacent chunks and every microbatch travels the ring of stages v times
(MaxText's circular pipeline; Megatron's interleaved schedule):

    stage s at iteration t works on k = t − s (idle unless 0 ≤ k < v·m):
        repeat r = k // m, microbatch i = k % m, with its chunk r of layers
        input: stage 0 reads microbatch i (r = 0) or what the last stage sent back for it
               (r > 0, kept in a ring buffer of m − p slots); the others what they just
               received
        buffer = ppermute(y, s -> s + 1 mod p)

The last stage's output for (r, i) leaves at iteration r·m + i + p − 1; stage 0 needs it at
(r + 1)·m + i, so the schedule needs m ≥ p (it waits in the ring buffer for m − p
iterations; fewer microbatches run as p, the extra slots wasted). v·m + p − 1 iterations of
1/v of a GPipe stage's work each: the bubble is (p − 1)/(v·m + p − 1) instead of
(p − 1)/(m + p − 1), for v times as many collective permutes (each the same b·s·h
activation): 2(v·m + p − 1)·b·s·h·β bytes per step and device.

Buffers. Each iteration reads one slot of the ring and then overwrites it (the write waits for
the read's consumer by a data dependency; `_ring_input`, whose backward pass likewise updates
one slot of the ring's gradient), and the microbatches come in and the outputs go out as the
loop's per-iteration inputs and results, not as m-slot buffers indexed inside the loop. Indexed
m-slot buffers cost four whole copies of m·b·h per backward iteration on XLA:CPU, a per-
iteration cost growing with m that bent the step time away from α + γ·(v·m + p − 1) (at p = 4,
v = 4 the measured bubble strayed 0.10 from theory); JAX's own transposes of the ring's read
and write still cost two whole copies of the ring's gradient per backward iteration. Neither
loop copies a buffer now. Each iteration slices its chunk of parameters out of the stage's v
chunks; the backward pass slices it again (`run_chunk`'s remat policy) instead of storing the
slice per iteration, which JAX does on its own: v·m + p − 1 copies of a chunk, (v·m + p − 1)/v
of the stage's parameters (half the temporaries at p = 4, v = 4, m = 8 on the benchmark's stack).

The stored stack keeps its canonical layout (layer axis split over `pipe` in contiguous blocks,
so checkpoints move between layouts unchanged): stage d stores chunks d·v, ..., d·v + v − 1 and
runs chunks s + r·p. Inside the schedule's shard_map each stage sends the chunks it stores but
does not run (`relayout_plan`): chunk c goes from stage c // v to stage c mod p, a bipartite
multigraph whose non-local edges are coloured with as many colours as its largest degree Δ
(König's theorem), one `ppermute` of one chunk per colour. So each stage sends Δ chunks
forward and their gradients back, the most any stage must send: at p = 4, Δ = 2 for v = 2 and
3 for v = 4 (of v chunks stored). Left to XLA's SPMD partitioner, a reshape of the global
stack, the same relayout took collective-permutes plus all-to-alls of twice that at v = 2, and
with an `fsdp` axis beside `pipe` it replicated the stack ("involuntary full
rematerialization"). `schedule_stats` separates these one-off permutes from the schedule's
loop permutes. Interleaving trades this parameter traffic for bubble: worth it where
activations per microbatch outweigh a stage's parameters, or links are fast.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from jaxlight._errors import ConfigurationError
from jaxlight.nn._context_attention import _after
from jaxlight.nn._pipeline import (
    PipelineConfig,
    _check_state,
    _vary,
    psum_wide,
    schedule_specs,
    split_batch,
)
from jaxlight.nn._scan import scan_layers
from jaxlight.sharding._layout import activation_sharding


@jax.custom_vjp
def _ring_input(ring, received, fed, slot, r, stage):
    """One iteration's stage input and the ring after it (one leaf of each).

    Stage 0 takes the fed microbatch (repeat r = 0) or the ring's slot `slot` (the last stage's
    result stored `delay` iterations ago); the other stages take what they received. The slot
    is then overwritten with what was received, only once the input exists (read before write,
    so XLA updates the ring in place). The backward pass is written out for the same reason:
    JAX's own transposes add a zero-padded ring-sized gradient per iteration, and XLA copies
    the ring's gradient twice per iteration to do it; here it updates one slot."""
    return _ring_input_fwd(ring, received, fed, slot, r, stage)[0]


def _ring_input_fwd(ring, received, fed, slot, r, stage):
    old = lax.dynamic_index_in_dim(ring, slot, 0, False)
    inp = jnp.where(stage == 0, jnp.where(r == 0, fed, old), received)
    ring = lax.dynamic_update_index_in_dim(ring, _after(received, inp), slot, 0)
    return (inp, ring), (slot, r, stage)


def _ring_input_bwd(res, cts):
    slot, r, stage = res
    ct_inp, ct_ring = cts
    zero = jnp.zeros_like(ct_inp)
    # The slot now holds `received`: its gradient is that slot's; the ring before the write
    # held `old` there, whose gradient is the input's where stage 0 read it.
    ct_written = lax.dynamic_index_in_dim(ct_ring, slot, 0, False)
    ct_received = jnp.where(stage == 0, zero, ct_inp) + ct_written
    ct_old = jnp.where((stage == 0) & (r != 0), ct_inp, zero)
    # After the read's consumer, which XLA may fuse the read into (as in the forward).
    ct_ring = lax.dynamic_update_index_in_dim(ct_ring, _after(ct_old, ct_received), slot, 0)
    ct_fed = jnp.where((stage == 0) & (r == 0), ct_inp, zero)
    return ct_ring, ct_received, ct_fed, None, None, None


_ring_input.defvjp(_ring_input_fwd, _ring_input_bwd)


def run_circular(stacked, config: PipelineConfig, x: Any, *args: Any) -> Any:
    """Runs `stacked` (a `jaxlight.nn.Stacked`) as the circular schedule of `config`."""
    config.calls += 1
    p, v, axis = config.stages, config.repeats, config.axis
    if stacked.num_layers % (p * v):
        n = stacked.num_layers
        raise ConfigurationError(
            f"{type(stacked).__name__} has {n} layers, which do not split into {p} stages × "
            f"{v} repeats = {p * v} chunks. Use stages × repeats dividing {n} "
            f"({[d for d in range(1, n + 1) if n % d == 0]}) or a multiple of {p * v} layers.")
    graphdef, state = nnx.split(stacked.layers)
    _check_state(stacked, state, p)
    pure_state = nnx.to_pure_dict(state)

    batch, m, b, data, manual, bspec, smap_mesh = split_batch(config, x, "Stacked block")
    real = m
    chunk = stacked.num_layers // (p * v)

    def to_microbatches(u):
        return jnp.swapaxes(u.reshape(b, real, *u.shape[1:]), 0, 1)

    def is_per_example(u) -> bool:
        return jnp.ndim(u) >= 2 and jnp.shape(u)[0] == batch

    arg_leaves, arg_tree = jax.tree.flatten(args)
    per_example = [is_per_example(u) for u in arg_leaves]
    # Fewer microbatches than stages (an evaluation batch of one, say): the ring needs m ≥ p,
    # so the schedule runs p slots, the extra ones copies of microbatch 0 whose outputs are
    # dropped (copies, not zeros: a layer that divides by a norm stays finite).
    m = max(m, p)

    def padded(u):
        u = to_microbatches(u)
        return jnp.concatenate([u, jnp.repeat(u[:1], m - real, axis=0)]) if m > real else u

    xs = jax.tree.map(padded, x)
    mb_args = [padded(u) for u, e in zip(arg_leaves, per_example, strict=True) if e]
    whole_args = [u for u, e in zip(arg_leaves, per_example, strict=True) if not e]

    plan = relayout_plan(p, v)

    def stage_fn(chunk_state, inp, stage_args):
        layers = nnx.merge(graphdef, chunk_state)
        return scan_layers(layers, inp, stage_args, stacked.remat)

    if config.remat:
        stage_fn = jax.checkpoint(stage_fn, prevent_cse=False)

    def run_chunk(chunks, r, inp, stage_args):
        params = jax.tree.map(lambda u: lax.dynamic_slice_in_dim(u, r * chunk, chunk), chunks)
        return stage_fn(params, inp, stage_args)

    # The backward pass needs each iteration's chunk of parameters. Left to itself, JAX stores
    # the slice per iteration, (v·m + p − 1) chunks ((v·m + p − 1)/v of a stage's parameters);
    # this policy stores whatever it stored before except that slice, which the backward pass
    # takes again from the stage's chunks (a loop invariant) instead.
    stacks = {(v * chunk, *u.shape[1:]) for u in jax.tree.leaves(pure_state)}

    def keep_all_but_the_slice(prim, *avals, **_):
        return not (prim is lax.dynamic_slice_p and tuple(avals[0].shape) in stacks)

    run_chunk = jax.checkpoint(run_chunk, prevent_cse=False, policy=keep_all_but_the_slice)

    perm = [(i, (i + 1) % p) for i in range(p)]
    steps = v * m + p - 1
    delay = m - p  # iterations between the last stage's result and stage 0's next repeat
    # Per stage s and iteration t: repeat r and microbatch i of k = t − s (clipped to the
    # schedule), and the ring's slot t mod d. Tables, scanned over, instead of divisions by m
    # in the loop: XLA:CPU turns those into shifts for some m only (a power of two), so the
    # loop body differed with m beyond its trip count.
    t = np.arange(steps)
    k = np.clip(t[None] - np.arange(p)[:, None], 0, v * m - 1)
    indices = (k // m, k % m, np.broadcast_to(t % max(delay, 1), k.shape))

    def schedule(stored, xs, mb_args, whole_args):
        stage = lax.axis_index(axis)
        stored, xs, mb_args, whole_args = _vary((stored, xs, mb_args, whole_args), manual)
        # The chunks this stage runs, chunk r·p + stage at rows [r·chunk, (r + 1)·chunk) of one
        # (v·chunk, ...) stack: iteration t slices chunk r.
        chunks = jax.tree.map(lambda u: relayout(u, stage, plan, chunk, axis), stored)
        # Stage 0's first-repeat inputs as the loop's per-iteration input (microbatch t at
        # iteration t < m) and the outputs as its per-iteration result, not as m-slot buffers
        # read and written by index: the backward loop would otherwise carry their m-slot
        # gradients and copy them whole every iteration (a cost growing with m per
        # iteration, which bends the step time away from α + γ·(v·m + p − 1)).
        feed = jax.tree.map(
            lambda u: jnp.concatenate([u, jnp.zeros((steps - m, *u.shape[1:]), u.dtype)]), xs)

        def iteration(carry, scanned):
            received, ring = carry
            (r, i, slot), fed = scanned
            # What stage 0 just received is the last stage's result for k' = t − p; stage 0
            # needs it back at iteration k' + m, that is d = m − p iterations later. The ring
            # of d slots delays it: slot t mod d is read (the result stored d iterations ago)
            # and then overwritten with what just arrived, so each iteration touches one slot.
            if delay:
                inp_ring = [_ring_input(o, u, f, slot, r, stage) for o, u, f in
                            zip(jax.tree.leaves(ring), jax.tree.leaves(received),
                                jax.tree.leaves(fed), strict=True)]
                inp = jax.tree.unflatten(jax.tree.structure(received), [a for a, _ in inp_ring])
                ring = jax.tree.unflatten(jax.tree.structure(ring), [o for _, o in inp_ring])
            else:
                first = jax.tree.map(lambda u, o: jnp.where(r == 0, u, o), fed, received)
                inp = jax.tree.map(lambda a, c: jnp.where(stage == 0, a, c), first, received)
            it_mb = iter([u[i] for u in mb_args])
            it_whole = iter(whole_args)
            leaves = [next(it_mb) if e else next(it_whole) for e in per_example]
            y = run_chunk(chunks, r, inp, jax.tree.unflatten(arg_tree, leaves))
            return (lax.ppermute(y, axis, perm), ring), y

        received = jax.tree.map(lambda u: jnp.zeros_like(u[0]), xs)
        # m = p: what stage 0 receives is what it needs next, and there is no ring.
        ring = _vary(jax.tree.map(lambda u: jnp.zeros((delay, *u.shape[1:]), u.dtype), xs)
                     if delay else (), manual)
        _, ys = lax.scan(iteration, (received, ring),
                         (tuple(jnp.asarray(a)[stage] for a in indices), feed))
        # The last stage's outputs of the last repeat: microbatch i at (v − 1)·m + i + p − 1.
        first_out = (v - 1) * m + p - 1
        outs = jax.tree.map(lambda u: u[first_out:first_out + m], ys)
        return jax.tree.map(lambda o: psum_wide(jnp.where(stage == p - 1, o, 0), axis), outs)

    stored_specs = jax.tree.map(lambda _: PartitionSpec(axis), pure_state)
    x_specs, mb_specs, whole_specs = schedule_specs(config, bspec, x, xs, mb_args, whole_args)
    with activation_sharding(None):
        out = jax.shard_map(
            schedule,
            mesh=smap_mesh,
            in_specs=(stored_specs, x_specs, mb_specs, whole_specs),
            out_specs=x_specs,
            axis_names=set(manual),
        )(pure_state, xs, mb_args, whole_args)
    return jax.tree.map(
        lambda o: jnp.swapaxes(o[:real], 0, 1).reshape(batch, *o.shape[2:]), out)


class RelayoutPlan(NamedTuple):
    """How the stages exchange chunks (static, per stage index): `rounds[c]` is one ppermute,
    `(pairs, sent, slot)`: its (from, to) stage pairs, the local chunk index j each stage sends
    (chunk d·v + j; 0 for a stage that sends nothing) and the slot r each stage writes what it
    receives to (−1 for none). `own[r][s]`: the local index of the chunk stage s runs as
    repeat r when it stores that chunk itself, else −1."""

    rounds: tuple[tuple[tuple[tuple[int, int], ...], tuple[int, ...], tuple[int, ...]], ...]
    own: tuple[tuple[int, ...], ...]


def relayout_plan(p: int, v: int) -> RelayoutPlan:
    """The chunk exchange from the canonical layout (stage d stores chunks [d·v, d·v + v)) to
    the circular one (stage s runs chunks s + r·p), in as few ppermutes as possible.

    Chunk c travels from stage c // v to stage c mod p. The chunks that change stage form a
    bipartite multigraph (senders, receivers); it is edge-coloured with Δ colours, Δ its
    largest degree (König), by the alternating-path method: each colour is a partial
    permutation, one ppermute.

    Example:
        >>> [len(relayout_plan(4, v).rounds) for v in (1, 2, 4)]
        [0, 2, 3]
    """
    colour: dict[int, int] = {}  # chunk -> colour
    at_src: list[dict[int, int]] = [{} for _ in range(p)]  # colour -> chunk, per sender
    at_dst: list[dict[int, int]] = [{} for _ in range(p)]  # colour -> chunk, per receiver
    moving = [c for c in range(p * v) if c // v != c % p]
    degree = max([sum(c // v == d for c in moving) for d in range(p)]
                 + [sum(c % p == d for c in moving) for d in range(p)], default=0)
    for c in moving:
        src, dst = c // v, c % p
        a = next(k for k in range(degree) if k not in at_src[src])
        b = next(k for k in range(degree) if k not in at_dst[dst])
        if a in at_dst[dst]:
            # Swap colours a and b along the alternating path from dst (it never reaches src:
            # the graph is bipartite), which frees a at dst.
            path, node, side, want = [], dst, at_dst, a
            while want in side[node]:
                e = side[node][want]
                path.append(e)
                node, side = (e // v, at_src) if side is at_dst else (e % p, at_dst)
                want = b if want == a else a
            for e in path:
                del at_src[e // v][colour[e]], at_dst[e % p][colour[e]]
            for e in path:
                colour[e] = b if colour[e] == a else a
                at_src[e // v][colour[e]] = at_dst[e % p][colour[e]] = e
        colour[c] = a
        at_src[src][a] = at_dst[dst][a] = c
    rounds = []
    for k in range(degree):
        edges = sorted(c for c in moving if colour[c] == k)
        sent, slot = [0] * p, [-1] * p
        for c in edges:
            sent[c // v], slot[c % p] = c % v, c // p
        rounds.append((tuple((c // v, c % p) for c in edges), tuple(sent), tuple(slot)))
    own = tuple(tuple((r * p + s) % v if (r * p + s) // v == s else -1 for s in range(p))
                for r in range(v))
    return RelayoutPlan(tuple(rounds), own)


def relayout(local: jax.Array, stage: jax.Array, plan: RelayoutPlan, chunk: int,
             axis: str) -> jax.Array:
    """This stage's stored chunks (canonical, `(v·chunk, ...)`) → the chunks it runs, repeat r
    at rows [r·chunk, (r + 1)·chunk); inside a shard_map manual over `axis`."""
    def take(j):
        return lax.dynamic_slice_in_dim(local, j * chunk, chunk)

    received = [(lax.ppermute(take(jnp.asarray(sent)[stage]), axis, list(pairs)),
                 jnp.asarray(slot)[stage]) for pairs, sent, slot in plan.rounds]
    slots = []
    for r, own in enumerate(plan.own):
        # A slot this stage does not store is received in exactly one round, so what `take`
        # reads for it (chunk 0) is always replaced (and gets no gradient).
        out = take(jnp.maximum(jnp.asarray(own)[stage], 0))
        for got, at in received:
            out = jnp.where(at == r, got, out)
        slots.append(out)
    return jnp.concatenate(slots)


__all__ = ["relayout_plan", "run_circular"]
