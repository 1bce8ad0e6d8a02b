"""Context parallelism: causal attention over a sequence split across the `context` mesh axis.

With a `context` axis of n devices (`Hybrid({"context": n, ...})`) the rule `length -> context`
shards every activation's sequence dimension: device d holds tokens `[d·Lc, (d+1)·Lc)`,
`Lc = L / n`, of every example. Everything but attention is per token, so it runs on the local
shard without communication; rotary positions are applied to the globally shaped queries and
keys before attention, so each shard rotates by its own global positions (offset `d·Lc`). Only
the attention core needs the other shards' keys and values. Two algorithms, each a
`jax.shard_map` manual over `context` only (`data`, `fsdp` and `tp` stay automatic):

    all-gather ("allgather"):  Q[B, L_ctx, H, D] · K[B, L, H, D] -> O[B, L_ctx, H, D]
        K, V = all_gather(K_d), all_gather(V_d)        2 all-gathers forward
        O_d = softmax(mask(Q_d K^T)) V                 scores Lc × L per head
        backward: 2 reduce-scatters of dK, dV (f32)
        bytes per device and layer: 2·(n−1)/n · B·L·H·D·β forward, the same backward

    ring ("ring", flash-style online softmax and backward):
        carry (K_j, V_j) = (K_d, V_d)
        for hop in 0..n-1:   O, m, l = online_softmax(O, m, l, Q_d K_j^T, V_j)
                             (K_j, V_j) = ppermute((K_j, V_j), d -> d+1)   (n−1 hops)
        backward: the transposed ring: for hop in n−1..0 the block's probabilities are
                  recomputed from the saved log-sum-exp, dQ accumulates locally and the dK, dV
                  accumulators travel back, d -> d−1 (n−1 hops)
        bytes per device and layer: 2·(n−1)/n · B·L·H·D·β forward, the same backward (dK, dV
        travel in float32: for bfloat16 activations twice the forward's)

Causal masking uses global token indices: query `i` of device d is `d·Lc + i`, key `j` of the
block that arrived after `hop` hops is `((d − hop) mod n)·Lc + j`; the mask is `q ≥ k`, so the
blocks from later shards are entirely masked (the contiguous split leaves device n−1 the most
work, n−1 blocks of n; zig-zag balancing is not done).

Memory. The ring is a `jax.custom_vjp` (`_ring`): the backward pass keeps per layer only the
queries, keys and values, the float32 output, one log-sum-exp per query row and the key/value
blocks that arrived at hops 1..n−1 (that is every shard's K and V: O(B·L·H·D), linear in the
sequence), never a block of scores. Its largest temporaries are two `Lc × Lc` float32 blocks
per head, live one hop at a time (XLA's compiled `memory_analysis()`: the single-device path
keeps four `L × L` ones), so the longest sequence within a fixed memory grows faster than n
(`benchmarks/context.py`'s reach section). Getting there needs care with XLA's CPU compiler,
which removes optimization barriers before it schedules: a hop's scores are made to depend on
the previous hop's result (`_after`), or XLA computes several hops' blocks at once (with n = 2
it inlines the one-hop loop), or the backward pass's first block during the forward pass; the
backward works on the transposed block (keys × queries), which XLA cannot merge with the
forward's scores; masks are scalars or iota comparisons, never block-sized arrays that XLA
would hoist out of the loop. The all-gather's temporaries are `Lc × L` (n× the ring's block),
each block recomputed in the backward (`jax.checkpoint`). `benchmarks/context.py` measures
both; docs/strategies.md has the figures.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxlight._errors import ConfigurationError, ShardingError

#: What `Hybrid(context_attention=...)` accepts.
CONTEXT_ALGORITHMS = {
    "ring": "keys and values travel around the context ring (n−1 collective-permutes), "
            "Lc × Lc blocks of scores one hop at a time, flash-style backward: the least memory",
    "allgather": "keys and values are all-gathered once per layer; scores Lc × L: fewer, "
                 "larger collectives, n× the score memory",
}

#: The default algorithm (see docs/strategies.md for the measurements behind it).
DEFAULT_CONTEXT_ALGORITHM = "ring"

_MASKED = float(jnp.finfo(jnp.float32).min)


def check_context_algorithm(name: Any, who: str) -> str:
    if name not in CONTEXT_ALGORITHMS:
        raise ConfigurationError(
            f"{who}: context_attention={name!r} is not a context-parallel attention algorithm; "
            f"use one of {', '.join(repr(k) for k in CONTEXT_ALGORITHMS)}.")
    return name


# -- per-device code (inside shard_map, manual over the context axis) -------------------------


def _block_scores(q: jax.Array, k: jax.Array, scale: float, q_start, k_start) -> jax.Array:
    """Masked float32 scores `(B, H, Lq, Lk)` of one query block against one key block."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    q_idx = q_start + jnp.arange(q.shape[1])
    k_idx = k_start + jnp.arange(k.shape[1])
    return jnp.where(q_idx[:, None] >= k_idx[None, :], scores, _MASKED)


def allgather_attention(q, k, v, *, axis_name: str, axis_size: int, scale: float) -> jax.Array:
    """This device's attention output with every shard's keys and values all-gathered."""
    lc = q.shape[1]
    start = lax.axis_index(axis_name) * lc
    k_all = lax.all_gather(k, axis_name, axis=1, tiled=True)
    v_all = lax.all_gather(v, axis_name, axis=1, tiled=True)

    @jax.checkpoint
    def block(q, k_all, v_all, start):
        probs = jax.nn.softmax(_block_scores(q, k_all, scale, start, 0), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v_all.dtype), v_all)

    return block(q, k_all, v_all, start)


def _ring_scores(a, b, scale: float, visible) -> jax.Array:
    """Masked float32 scores `(B·H, La, Lb)` of `a` against `b` (both `(B·H, L, D)`).

    `visible` is None for the diagonal block (the device's own keys: position `i` of `a`
    sees position `j` of `b` iff `i ≥ j`, or `i ≤ j` where `a` holds the keys and the result
    is transposed) or a scalar: a block from an earlier shard is entirely visible, one from a
    later shard entirely masked, so no block-sized mask is ever built.
    """
    s = jnp.einsum("zid,zjd->zij", a, b).astype(jnp.float32) * scale
    if isinstance(visible, str):
        i, j = jnp.arange(a.shape[1])[:, None], jnp.arange(b.shape[1])[None, :]
        return jnp.where(i >= j if visible == "queries" else i <= j, s, _MASKED)
    # A scalar bias, not `where(visible, s, MASKED)`: that broadcasts the constant to a
    # block, which XLA hoists out of the ring's loop and keeps. MASKED + s rounds to MASKED.
    return s + jnp.where(visible, 0.0, _MASKED)


def _ring_block(q, k, v, scale: float, visible, carry):
    """Online-softmax update of (output, running max, denominator) by one key block."""
    out, m, denom = carry
    s = _ring_scores(q, k, scale, visible)                        # (B·H, Lq, Lk)
    m_new = jnp.maximum(m, s.max(axis=-1))
    p = jnp.exp(s - m_new[..., None])
    correction = jnp.exp(m - m_new)
    denom = denom * correction + p.sum(axis=-1)
    pv = jnp.einsum("zqk,zkd->zqd", p.astype(v.dtype), v).astype(jnp.float32)
    return out * correction[..., None] + pv, m_new, denom


def _ring_block_grads(q, k, v, do, lse, delta, scale: float, visible):
    """dq, dk, dv (float32) of one key block, its probabilities recomputed from `lse`.

    Computed transposed (keys × queries): every product but dq's is then a plain matrix
    product of the block, and the recomputed scores differ from the forward pass's, so XLA
    cannot merge the two and keep the forward's block alive until the backward.
    """
    st = _ring_scores(k, q, scale, "keys" if visible == "queries" else visible)
    pt = jnp.exp(st - lse[:, None, :])                            # (B·H, Lk, Lq)
    dv = jnp.einsum("zkq,zqd->zkd", pt, do)
    # dP only once P exists (and the scores it came from are freed): two blocks live, not 3.
    dpt = jnp.einsum("zkd,zqd->zkq", v.astype(jnp.float32), _after(do, pt))
    dst = pt * (dpt - delta[:, None, :]) * scale
    dk = jnp.einsum("zkq,zqd->zkd", dst, q.astype(jnp.float32))
    dq = jnp.einsum("zkq,zkd->zqd", dst, k.astype(jnp.float32))
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q, k, v, axis_name: str, n: int, scale: float) -> jax.Array:
    return _ring_fwd(q, k, v, axis_name, n, scale)[0]


def _ring_fwd(q, k, v, axis_name: str, n: int, scale: float):
    """Forward ring over `(B·H, Lc, D)` blocks: the output, and as residuals q, k, v, the
    float32 output, the log-sum-exp of every query row and the key/value blocks that arrived
    at hops 1..n−1 (so the backward pass moves only dK, dV and keeps no block of scores)."""
    me = lax.axis_index(axis_name)
    send = [(i, (i + 1) % n) for i in range(n)]
    z, lc, _ = q.shape
    carry = (jnp.zeros((z, lc, v.shape[-1]), jnp.float32),
             jnp.full((z, lc), _MASKED, jnp.float32), jnp.zeros((z, lc), jnp.float32))
    carry = _ring_block(q, k, v, scale, "queries", carry)  # hop 0: the own, diagonal block

    def hop(state, step):
        carry, k, v = state
        k, v = lax.ppermute(k, axis_name, send), lax.ppermute(v, axis_name, send)
        # After `step` hops the block comes from shard me − step: earlier (visible) iff
        # step ≤ me. Its scores only after the previous block's update (n = 2 inlines the
        # loop, and XLA would compute both blocks' scores first).
        carry = _ring_block(_after(q, carry[1]), k, v, scale, step <= me, carry)
        return (carry, k, v), (k, v)

    # A scan, not an unrolled loop: one compiled hop whatever n (compile time stays flat).
    ((out, m, denom), _, _), blocks = lax.scan(hop, (carry, k, v), jnp.arange(1, n))
    out = out / denom[..., None]
    return out.astype(q.dtype), (q, k, v, out, m + jnp.log(denom), blocks)


def _ring_bwd(axis_name: str, n: int, scale: float, residuals, g):
    """The transposed ring: hops n−1..1 in reverse, each adding this device's dK, dV of the
    block it held to the accumulator that then travels back one device (n−1 permutes of dK
    and of dV), so that after hop 1 every device holds its own block's gradient."""
    q, k, v, out, lse, (ks, vs) = residuals
    me = lax.axis_index(axis_name)
    back = [(i, (i - 1) % n) for i in range(n)]
    do = g.astype(jnp.float32)
    delta = jnp.sum(do * out, axis=-1)                            # (B·H, Lq)
    # No block of the backward pass before the output's gradient exists (with n = 2 XLA
    # inlines the one-hop loop and would recompute its scores during the forward pass).
    q = _after(q, do)

    def hop(state, xs):
        dq, dk_acc, dv_acc = state
        k_j, v_j, step = xs
        dq_j, dk_j, dv_j = _ring_block_grads(q, k_j, v_j, do, lse, delta, scale, step <= me)
        dk_acc = lax.ppermute(dk_acc + dk_j, axis_name, back)
        dv_acc = lax.ppermute(dv_acc + dv_j, axis_name, back)
        return (dq + dq_j, dk_acc, dv_acc), None

    # Varying over every manual axis the inputs vary over: the context axis, and the pipeline
    # stage's axes where the attention runs inside a pipeline schedule.
    zeros = tuple(lax.pcast(jnp.zeros(x.shape, jnp.float32),
                            tuple(jax.typeof(x).manual_axis_type.varying), to="varying")
                  for x in (q, k, v))
    (dq, dk, dv), _ = lax.scan(hop, zeros, (ks, vs, jnp.arange(1, n)), reverse=True)
    # The own block after the ring, not beside it (two blocks' temporaries live at once):
    # both its products, scores and dP, take an input that depends on the ring's result (and
    # so does its delta, which XLA would otherwise share with the loop's as one broadcast,
    # block-sized buffer).
    dq_own, dk_own, dv_own = _ring_block_grads(_after(q, dq), k, v, _after(do, dq), lse,
                                               _after(delta, dq), scale, "queries")
    return ((dq + dq_own).astype(q.dtype), (dk + dk_own).astype(k.dtype),
            (dv + dv_own).astype(v.dtype))


def _after(x: jax.Array, dep: jax.Array) -> jax.Array:
    """`x`, computed only once `dep` is. XLA's CPU scheduler starts an operation as soon as
    its inputs exist and ignores optimization barriers (they are removed before scheduling);
    adding 0·dep[0] makes the order a data dependency (0·y is not simplified for floats)."""
    return x + (0.0 * dep[(0,) * dep.ndim]).astype(x.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q, k, v, *, axis_name: str, axis_size: int, scale: float) -> jax.Array:
    """This device's attention output, keys and values passed around the ring (online softmax).

    Hop 0 is the device's own block, which holds the diagonal, so every query row has a finite
    running maximum from the start and fully masked later blocks add exactly zero. The
    backward pass is flash-style (`_ring_bwd`): each block's probabilities are recomputed from
    the saved log-sum-exp, one block at a time.
    """
    b, lc, h, d = q.shape
    # (B·H, Lc, D): one batch dimension, so that XLA reshapes nothing block-sized (a block
    # reshaped inside a fusion cannot take its operand's buffer).
    heads_first = [jnp.swapaxes(x, 1, 2).reshape(b * h, lc, x.shape[-1]) for x in (q, k, v)]
    out = _ring(*heads_first, axis_name, axis_size, scale).reshape(b, h, lc, d)
    return jnp.swapaxes(out, 1, 2)


_BODIES = {"ring": ring_attention, "allgather": allgather_attention}


def check_context_length(length: int, n: int, what: str) -> None:
    """Refuses a sequence of `length` tokens that does not split over `n` context devices;
    `what` says where it was found."""
    if length % n:
        raise ShardingError(
            f"context parallelism over context={n} devices needs a sequence length divisible "
            f"by {n}; got length {length} ({what}). Pad or crop sequences to a multiple of {n} "
            f"(for example {length - length % n or n} or {length - length % n + n}).")


def _manual_axes() -> frozenset:
    context = jax.sharding.get_abstract_mesh()
    return frozenset() if context.empty else frozenset(context.manual_axes)


# -- the trace-time switch MultiHeadAttention consults ----------------------------------------


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Routes `MultiHeadAttention` through context-parallel attention while a step is traced.

    Attributes:
        mesh: the strategy's mesh (it has `axis`).
        algorithm: "ring" or "allgather" (`CONTEXT_ALGORITHMS`).
        axis: the sequence mesh axis.
    """

    mesh: Mesh
    algorithm: str = DEFAULT_CONTEXT_ALGORITHM
    axis: str = "context"

    @property
    def size(self) -> int:
        return int(self.mesh.shape.get(self.axis, 1))

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
        """Causal attention of global `(batch, length, heads, head_dim)` arrays whose length
        is sharded over `axis`; returns the output in the same layout."""
        if self.axis in _manual_axes():
            # Inside a pipeline stage: the schedule is manual over the context axis too, and
            # q, k, v are this device's shard of the sequence.
            return _BODIES[self.algorithm](q, k, v, axis_name=self.axis, axis_size=self.size,
                                           scale=scale)
        check_context_length(q.shape[1], self.size, f"queries of shape {tuple(q.shape)}")
        spec = PartitionSpec(None, self.axis)
        body = _BODIES[self.algorithm]
        return jax.shard_map(
            lambda q, k, v: body(q, k, v, axis_name=self.axis, axis_size=self.size,
                                 scale=scale),
            mesh=self._mesh(), in_specs=(spec, spec, spec), out_specs=spec,
            axis_names={self.axis},
        )(q, k, v)

    def _mesh(self) -> Any:
        """Inside another shard_map (gradient accumulation is manual over the batch axes) the
        abstract context mesh, with those axes already manual."""
        context = jax.sharding.get_abstract_mesh()
        return self.mesh if context.empty else context


_ACTIVE: contextvars.ContextVar[ContextParallel | None] = contextvars.ContextVar(
    "jaxlight_context_parallel", default=None
)


@contextlib.contextmanager
def context_parallel(mesh: Mesh | None, algorithm: str = DEFAULT_CONTEXT_ALGORITHM,
                     axis: str = "context") -> Iterator[ContextParallel | None]:
    """Makes `MultiHeadAttention` layers traced inside attend across the `axis` shards.

    A mesh without `axis` (or of size 1 on it) leaves attention unchanged. Strategies enter it
    through `Hybrid(...).trace_context()`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxlight.nn import causal_attention
        >>> mesh = jax.make_mesh((2,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> q = k = v = jnp.ones((1, 8, 2, 4))
        >>> with jax.set_mesh(mesh), context_parallel(mesh, "ring") as cp:
        ...     out = jax.jit(lambda q, k, v: cp.attention(q, k, v, 0.5))(q, k, v)
        >>> bool(jnp.allclose(out, causal_attention(q, k, v, scale=0.5), atol=1e-6))
        True
    """
    check_context_algorithm(algorithm, "context_parallel")
    config = (ContextParallel(mesh, algorithm, axis)
              if mesh is not None and mesh.shape.get(axis, 1) > 1 else None)
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)


def active_context_parallel() -> ContextParallel | None:
    """The context-parallel routing of the step being traced, or None (local attention)."""
    return _ACTIVE.get()


__all__ = [
    "CONTEXT_ALGORITHMS",
    "DEFAULT_CONTEXT_ALGORITHM",
    "ContextParallel",
    "active_context_parallel",
    "allgather_attention",
    "context_parallel",
    "ring_attention",
]
