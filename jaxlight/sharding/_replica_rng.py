"""Random draws in per-replica code: each data-parallel replica draws its own rows of the draw
that one device would make for the whole batch.

Some gradient layouts run the user's step once per data-parallel replica on that replica's rows:
DDP (`pmap`), FSDP's gather-once layout and gradient accumulation under SPMD (`shard_map`, see
`jaxlight.step._microbatch`). The model's RNG keys (an `nnx.Rngs` stream in `rest`) are the same on
every replica, so without help every replica would draw the same dropout mask for its rows.

JAX's threefry (partitionable, the default) gives element `i` of a draw of shape `(n, ...)` the
bits `threefry(key, i)` for its flat index `i`. One device drawing a mask for the whole batch
`(B, F)` gives global row `r` the counters `[r·F, (r+1)·F)`. Replica `j` of `N` holds global
rows `[j·B/N, (j+1)·B/N)` (per microbatch, see `split_microbatches`: the same holds for each
microbatch's rows), so while the per-replica step is traced its keys are given a PRNG
implementation that offsets the counters of every draw whose leading dimension is the replica's
rows by `j × (size of the draw)`. The replica then draws exactly its block of the single-device
draw: no bits are drawn twice or wasted, and no collective is added.

What is guaranteed, with `jax_threefry_partitionable` on (JAX's default) and typed threefry
keys (`nnx.Rngs`, `jax.random.key`):

- A draw whose leading dimension is the examples (dropout on `(batch, ...)` activations) equals,
  row for row, the draw of the single-device run with the same global batch and the same
  `accumulate_grad_batches`; so masks differ across replicas and microbatches.
- Any other draw (a mask broadcast over the batch, `Dropout(broadcast_dims=(0,))`; noise shaped
  like a parameter) is the same on every replica, as on one device.
- `split` and `fold_in` are threefry's, so keys derived inside the step are the single-device
  keys too, and the keys leave the step as they entered it.

A draw is taken to be per example when its leading dimension equals the replica's rows; with
one example per replica and microbatch a leading 1 is ambiguous and treated as per example. Keys
of another implementation (`rbg`), or with `jax_threefry_partitionable` off, get the replica
index folded in instead: masks differ across replicas, but do not equal the single-device ones.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import random as jex_random

from jaxlight._errors import ConfigurationError

_THREEFRY = jex_random.threefry_prng_impl
_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _iota_2x32(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The 64-bit flat index of every element of `shape` as (high, low) uint32 arrays."""
    n = math.prod(shape)
    if n >= 2**32:
        raise ConfigurationError(
            f"a random draw of shape {shape} has {n} elements per data-parallel replica; "
            "jaxlight's per-replica draws support fewer than 2**32. Draw in smaller pieces.")
    return jnp.zeros(shape, jnp.uint32), jax.lax.iota(jnp.uint32, n).reshape(shape)


def _mul_wide(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """a × b for a uint32 scalar `a` and a Python int 0 <= b < 2**64, as (high, low) uint32."""
    b_lo, b_hi = b & 0xFFFFFFFF, b >> 32
    a0, a1 = a & 0xFFFF, a >> 16
    c0, c1 = jnp.uint32(b_lo & 0xFFFF), jnp.uint32(b_lo >> 16)
    ll, lh, hl, hh = a0 * c0, a0 * c1, a1 * c0, a1 * c1  # each < 2**32
    mid = (ll >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)
    low = (ll & 0xFFFF) | (mid << 16)
    high = hh + (lh >> 16) + (hl >> 16) + (mid >> 16) + a * jnp.uint32(b_hi)
    return high, low


@functools.cache
def _replica_impl(rows: int):
    """Threefry whose key data is (k1, k2, replica index) and whose draws of leading dimension
    `rows` are that replica's block of the draw over all replicas (see the module docstring)."""

    def seed(s):
        return jnp.concatenate([_THREEFRY.seed(s), jnp.zeros((1,), jnp.uint32)])

    def split(key, shape):
        keys = _THREEFRY.split(key[:2], shape)
        replica = jnp.broadcast_to(key[2], (*shape, 1))
        return jnp.concatenate([keys, replica], axis=-1)

    def fold_in(key, data):
        return jnp.concatenate([_THREEFRY.fold_in(key[:2], data), key[2:]])

    def random_bits(key, bit_width, shape):
        shape = tuple(shape)
        if not shape or shape[0] != rows:
            return _THREEFRY.random_bits(key[:2], bit_width, shape)
        high, low = _iota_2x32(shape)
        off_high, off_low = _mul_wide(key[2], math.prod(shape))
        counter_low = low + off_low
        counter_high = high + off_high + (counter_low < low).astype(jnp.uint32)
        bits1, bits2 = jex_random.threefry2x32_p.bind(key[0], key[1], counter_high, counter_low)
        dtype = _UINT[bit_width]
        if bit_width == 64:  # as JAX's partitionable threefry does
            return (bits1.astype(dtype) << jnp.asarray(32, dtype)) | bits2.astype(dtype)
        out = bits1 ^ bits2
        return out if bit_width == 32 else out.astype(dtype)

    return jex_random.define_prng_impl(
        key_shape=(3,), seed=seed, split=split, random_bits=random_bits, fold_in=fold_in,
        name=f"jaxlight_replica_threefry_{rows}", tag="jlr")


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_threefry(key: jax.Array) -> bool:
    return jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0))


def _to_replica(key: jax.Array, replica: jax.Array, rows: int) -> jax.Array:
    if not (_is_threefry(key) and jax.config.jax_threefry_partitionable):
        return jax.random.fold_in(key, replica)
    data = jax.random.key_data(key)
    index = jnp.broadcast_to(replica.astype(jnp.uint32), (*data.shape[:-1], 1))
    return jax.random.wrap_key_data(jnp.concatenate([data, index], axis=-1),
                                    impl=_replica_impl(rows))


def _from_replica(key: jax.Array, original: jax.Array) -> jax.Array:
    if jax.random.key_impl(key) == jax.random.key_impl(original):
        return original  # folded: the stream's own key never changes within a step
    return jax.random.wrap_key_data(jax.random.key_data(key)[..., :2],
                                    impl=jax.random.key_impl(original))


def replica_draws(grad_fn: Callable, axes: str | Sequence[str]) -> Callable:
    """`grad_fn(params, rest, batch)` run per replica, drawing its rows of the global draw.

    Call the result only where `axes` are bound (inside `shard_map` manual over them, or the
    `pmap` over that axis), on this replica's rows of the batch.

    Args:
        grad_fn: `(params, rest, batch) -> ((loss, (metrics, rest)), grads)`.
        axes: the mesh axes (or pmap axis) the batch rows are split over, major first: replica
            `j` (`lax.axis_index(axes)`) holds the j-th block of rows.
    """
    axes = axes if isinstance(axes, str) else tuple(axes)

    def drawn(params, rest, batch):
        leaves = jax.tree.leaves(rest)
        if not any(_is_key(x) for x in leaves):
            return grad_fn(params, rest, batch)
        rows = int(np.shape(jax.tree.leaves(batch)[0])[0])
        replica = jax.lax.axis_index(axes)
        inner = jax.tree.map(lambda x: _to_replica(x, replica, rows) if _is_key(x) else x, rest)
        (loss, (metrics, new_rest)), grads = grad_fn(params, inner, batch)
        new_rest = jax.tree.map(
            lambda new, old: _from_replica(new, old) if _is_key(old) else new, new_rest, rest)
        return (loss, (metrics, new_rest)), grads

    return drawn
