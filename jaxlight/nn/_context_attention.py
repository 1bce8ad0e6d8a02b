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

    ring ("ring", flash-style online softmax):
        carry (K_j, V_j) = (K_d, V_d)
        for hop in 0..n-1:   O, m, l = online_softmax(O, m, l, Q_d K_j^T, V_j)
                             (K_j, V_j) = ppermute((K_j, V_j), d -> d+1)   (n−1 hops)
        backward: the transposed ring (dK, dV travel back) plus the forward ring again
        bytes per device and layer: 2·(n−1)/n · B·L·H·D·β forward; the backward moves K, V
        (recomputed hops) and dK, dV: 2× the forward

Causal masking uses global token indices: query `i` of device d is `d·Lc + i`, key `j` of the
block that arrived after `hop` hops is `((d − hop) mod n)·Lc + j`; the mask is `q ≥ k`, so the
blocks from later shards are entirely masked (the contiguous split leaves device n−1 the most
work, n−1 blocks of n; zig-zag balancing is not done). Every block is computed inside
`jax.checkpoint`: the backward pass stores only queries, keys, values and the softmax
statistics, not the `Lc × L` probabilities, and recomputes each block's scores. The ring's
largest temporary is one `Lc × Lc` block of scores per head, the all-gather's `Lc × L`
(n× larger), at the price of n−1 dependent permutes instead of one all-gather
(`benchmarks/context.py` measures both; docs/strategies.md has the figures).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxlight._errors import ConfigurationError, ShardingError

#: What `Hybrid(context_attention=...)` accepts.
CONTEXT_ALGORITHMS = {
    "ring": "keys and values travel around the context ring (n−1 collective-permutes), one "
            "Lc × Lc block of scores at a time: the least memory",
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


def ring_attention(q, k, v, *, axis_name: str, axis_size: int, scale: float) -> jax.Array:
    """This device's attention output, keys and values passed around the ring (online softmax).

    Hop 0 is the device's own block, which holds the diagonal, so every query row has a finite
    running maximum from the start and fully masked later blocks add exactly zero.
    """
    n, lc = axis_size, q.shape[1]
    me = lax.axis_index(axis_name)
    send = [(i, (i + 1) % n) for i in range(n)]

    @jax.checkpoint
    def update(carry, q, k, v, k_start):
        out, m, denom = carry
        s = _block_scores(q, k, scale, me * lc, k_start)          # (B, H, Lq, Lk)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        denom = denom * correction + p.sum(axis=-1)
        pv = jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v).astype(jnp.float32)
        out = out * jnp.swapaxes(correction, 1, 2)[..., None] + pv
        return out, m_new, denom

    def hop(state, step):
        carry, k, v = state
        k, v = lax.ppermute(k, axis_name, send), lax.ppermute(v, axis_name, send)
        return (update(carry, q, k, v, ((me - step) % n) * lc), k, v), None

    b, _, h, _ = q.shape
    carry = (jnp.zeros((b, lc, h, v.shape[-1]), jnp.float32),
             jnp.full((b, h, lc), _MASKED, jnp.float32), jnp.zeros((b, h, lc), jnp.float32))
    carry = update(carry, q, k, v, me * lc)  # hop 0: the device's own block
    # A scan, not an unrolled loop: one compiled hop whatever n (compile time stays flat).
    (out, _, denom), _, _ = lax.scan(hop, (carry, k, v), jnp.arange(1, n))[0]
    return (out / jnp.swapaxes(denom, 1, 2)[..., None]).astype(q.dtype)


_BODIES = {"ring": ring_attention, "allgather": allgather_attention}


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
        length = q.shape[1]
        if length % self.size:
            raise ShardingError(
                f"context parallelism over context={self.size} devices needs a sequence length "
                f"divisible by {self.size}; got length {length} (queries of shape "
                f"{tuple(q.shape)}). Pad or crop sequences to a multiple of {self.size} (for "
                f"example {length - length % self.size or self.size} or "
                f"{length - length % self.size + self.size}).")
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
