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
so checkpoints move between layouts unchanged); inside the step the layer axis is viewed as
(v, p, L/(p·v)) and each stage receives its v chunks. For v > 1 that relayout moves at
least (v − 1)/v of each stage's stacked parameters between stages once per step, and the
gradients back: XLA's SPMD partitioner emits it as one-off collective-permutes and all-to-alls
(`schedule_stats` separates them from the schedule's loop permutes; on the 8-layer test stack
they move a few times that minimum). Interleaving trades this parameter traffic for bubble:
worth it where activations per microbatch outweigh a stage's parameters, or links are fast.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from jaxlight._errors import ConfigurationError
from jaxlight._layout import activation_sharding
from jaxlight.nn._context_attention import _after
from jaxlight.nn._pipeline import (
    PipelineConfig,
    _check_state,
    _vary,
    schedule_specs,
    split_batch,
)
from jaxlight.nn._scan import scan_layers


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

    # The canonical (L, ...) stack viewed as (p, v, chunk, ...): stage s gets chunks s + r·p.
    def chunked(u):
        u = u.reshape(v, p, chunk, *u.shape[1:])
        return jnp.swapaxes(u, 0, 1)

    chunks = jax.tree.map(chunked, pure_state)

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
    stacks = {(v * chunk, *u.shape[3:]) for u in jax.tree.leaves(chunks)}

    def keep_all_but_the_slice(prim, *avals, **_):
        return not (prim is lax.dynamic_slice_p and tuple(avals[0].shape) in stacks)

    run_chunk = jax.checkpoint(run_chunk, prevent_cse=False, policy=keep_all_but_the_slice)

    perm = [(i, (i + 1) % p) for i in range(p)]
    steps = v * m + p - 1
    delay = m - p  # iterations between the last stage's result and stage 0's next repeat

    def schedule(chunks, xs, mb_args, whole_args):
        stage = lax.axis_index(axis)
        # This stage's v chunks as one (v·chunk, ...) stack: iteration t slices chunk r.
        chunks = jax.tree.map(lambda u: u[0].reshape(v * chunk, *u.shape[3:]), chunks)
        chunks, xs, mb_args, whole_args = _vary((chunks, xs, mb_args, whole_args), manual)
        # Stage 0's first-repeat inputs as the loop's per-iteration input (microbatch t at
        # iteration t < m) and the outputs as its per-iteration result, not as m-slot buffers
        # read and written by index: the backward loop would otherwise carry their m-slot
        # gradients and copy them whole every iteration (a cost growing with m per
        # iteration, which bends the step time away from α + γ·(v·m + p − 1)).
        feed = jax.tree.map(
            lambda u: jnp.concatenate([u, jnp.zeros((steps - m, *u.shape[1:]), u.dtype)]), xs)

        def iteration(carry, scanned):
            received, ring = carry
            t, fed = scanned
            # What stage 0 just received is the last stage's result for k' = t − p; stage 0
            # needs it back at iteration k' + m, that is d = m − p iterations later. The ring
            # of d slots delays it: slot t mod d is read (the result stored d iterations ago)
            # and then overwritten with what just arrived, so each iteration touches one slot.
            k = jnp.clip(t - stage, 0, v * m - 1)
            r, i = k // m, k % m
            if delay:
                inp_ring = [_ring_input(o, u, f, t % delay, r, stage) for o, u, f in
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
        _, ys = lax.scan(iteration, (received, ring), (jnp.arange(steps), feed))
        # The last stage's outputs of the last repeat: microbatch i at (v − 1)·m + i + p − 1.
        first_out = (v - 1) * m + p - 1
        outs = jax.tree.map(lambda u: u[first_out:first_out + m], ys)
        return jax.tree.map(lambda o: lax.psum(jnp.where(stage == p - 1, o, 0), axis), outs)

    chunk_specs = jax.tree.map(lambda _: PartitionSpec(axis), chunks)
    x_specs, mb_specs, whole_specs = schedule_specs(config, bspec, x, xs, mb_args, whole_args)
    with activation_sharding(None):
        out = jax.shard_map(
            schedule,
            mesh=smap_mesh,
            in_specs=(chunk_specs, x_specs, mb_specs, whole_specs),
            out_specs=x_specs,
            axis_names=set(manual),
        )(chunks, xs, mb_args, whole_args)
    return jax.tree.map(
        lambda o: jnp.swapaxes(o[:real], 0, 1).reshape(batch, *o.shape[2:]), out)


__all__ = ["run_circular"]
