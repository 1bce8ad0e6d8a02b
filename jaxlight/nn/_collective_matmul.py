"""Collective matmul: tensor-parallel dense layers that overlap communication with compute.

`TensorParallel(size, overlap=True)` keeps the residual stream sharded over `tp` on its model
width between layers (the rule `activation_embed -> tp`, as in the scaling book's TP layout) and
routes the column- and row-parallel `jaxlight.nn.Dense` layers through the two rings below,
each a `jax.shard_map` manual over `tp` only (the other mesh axes stay automatic, so `data` and
`fsdp` sharding keep working). With n devices on `tp` and `_tp` marking a sharded dimension:

    column parallel, all-gather fused into the matmul ("AG-matmul"):
        In[B, E_tp] · W[E, F_tp] -> Out[B, F_tp]
        device d: acc = 0; chunk = In_d
        for k in 0..n-1:
            next = ppermute(chunk, d -> d+1)         (in flight while the matmul runs)
            acc += chunk · W_d[rows of chunk (d-k) mod n]
            chunk = next

    row parallel, reduce-scatter fused into the matmul ("matmul-RS"):
        In[B, F_tp] · W[F_tp, E] -> Out[B, E_tp]
        device d: acc = In_d · W_d[:, cols (d-1) mod n]
        for k in 1..n-1:
            acc = ppermute(acc, d -> d+1) + In_d · W_d[:, cols (d-1-k) mod n]
        (after n-1 hops every partial sum of column block d has arrived at device d)

The synchronous path all-reduces `Out[B, E]` after each row-parallel layer (forward) and `dIn`
after each column-parallel layer (backward); the rings move the same bytes, (n−1)/n of the
activation per hop sequence, as n−1 collective-permutes each that an asynchronous scheduler can
hide behind the n partial matmuls. Autodiff transposes each ring into the other: the backward of
AG-matmul is a matmul-RS ring of `dIn`, the backward of matmul-RS an AG-matmul ring of `dOut`
(the transpose of a ppermute is the reverse ppermute), so the backward pass is overlapped too.

Layout notes:
- `activation_embed -> tp` is the only change to the rules: `length` and `batch` also name the
  head- and MLP-sharded activations inside a block, so mapping them to `tp` (Megatron-SP's
  sequence sharding) would take `tp` away from the heads. Sharding the residual on its width
  instead costs one small all-reduce (b·s values, 1/E of the activation) per RMSNorm.
- Partial products accumulate in float32 locally; the travelling accumulator of matmul-RS keeps
  the output dtype, as the synchronous all-reduce does.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxlight._errors import ShardingError
from jaxlight.sharding._layout import rule_axes

#: Rules put in front of the defaults by `TensorParallel(overlap=True)`: the residual stream
#: (and every other activation named `activation_embed`) is sharded over `tp` on its width.
OVERLAP_RULES: tuple[tuple[str, Any], ...] = (("activation_embed", "tp"), ("norm", "tp"))


# -- the rings (per-device code, called inside shard_map) --------------------------------------


def _contract(x: jax.Array, w: jax.Array, n_in: int) -> jax.Array:
    """`x`'s trailing `n_in` dimensions against `w`'s leading ones, accumulated in float32."""
    dims = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    return lax.dot_general(x, w, (dims, ((), ())), preferred_element_type=jnp.float32)


def ring_blocks(x: jax.Array, *, axis_name: str, axis_size: int) -> list[jax.Array]:
    """The ring all-gather's hops: entry k is the block of device `(me - k) mod n`.

    Call inside `shard_map`. Each hop is one `ppermute` to the next device; a matmul on hop k
    only waits for k hops, so it overlaps with the hops still travelling.
    """
    send_up = [(i, (i + 1) % axis_size) for i in range(axis_size)]
    blocks = [x]
    for _ in range(axis_size - 1):
        blocks.append(lax.ppermute(blocks[-1], axis_name, send_up))
    return blocks


def blocks_matmul(blocks: Sequence[jax.Array], w: jax.Array, *, axis_name: str,
                  n_in: int = 1) -> jax.Array:
    """`Σ_k blocks[k] · w[rows of block k]`: the matmul half of AG-matmul (see `ring_blocks`)."""
    n = len(blocks)
    block = blocks[0].shape[blocks[0].ndim - n_in]
    if w.shape[0] != block * n:
        raise ShardingError(f"allgather_matmul: x block {block} × {n} devices != w rows "
                            f"{w.shape[0]}.")
    me = lax.axis_index(axis_name)
    acc = None
    for k, chunk in enumerate(blocks):
        src = (me - k) % n  # the device whose block `chunk` is
        rows = lax.dynamic_slice_in_dim(w, src * block, block, axis=0)
        part = _contract(chunk, rows, n_in)
        acc = part if acc is None else acc + part
    return acc.astype(jnp.result_type(blocks[0].dtype, w.dtype))


def allgather_matmul(x: jax.Array, w: jax.Array, *, axis_name: str, axis_size: int,
                     n_in: int = 1) -> jax.Array:
    """Per-device `all_gather(x, contracting dim) · w` as a ring of ppermutes and partial matmuls.

    Call inside `shard_map` (manual over `axis_name`). `x` holds this device's block of the first
    contracted dimension, `(..., E/n, *in_rest)`; `w` holds all of it, `(E, *in_rest, *out)`.

    Args:
        x: the local activation block.
        w: the local weight block (every contracted row, this device's output columns).
        axis_name: the manual mesh axis of the ring.
        axis_size: its size n.
        n_in: how many trailing dimensions of `x` are contracted.

    Returns:
        `(..., *out)` in the promoted dtype of `x` and `w`: the full contraction on every device.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from functools import partial
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> f = jax.jit(jax.shard_map(partial(allgather_matmul, axis_name="tp", axis_size=2),
        ...                           mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp")),
        ...                           out_specs=P(None, "tp")))
        >>> x, w = jnp.arange(12.0).reshape(3, 4), jnp.arange(24.0).reshape(4, 6)
        >>> bool(jnp.allclose(f(x, w), x @ w))
        True
    """
    blocks = ring_blocks(x, axis_name=axis_name, axis_size=axis_size)
    return blocks_matmul(blocks, w, axis_name=axis_name, n_in=n_in)


def matmul_reducescatter(x: jax.Array, w: jax.Array, *, axis_name: str, axis_size: int,
                         n_in: int = 1) -> jax.Array:
    """Per-device `psum_scatter(x · w, first output dim)` as a ring of partial matmuls.

    Call inside `shard_map` (manual over `axis_name`). `x` holds this device's block of a
    contracted dimension, `w` the matching rows and every output column `(*in, E, *out_rest)`.

    Args:
        x: the local activation block `(..., *in)`.
        w: the local weight block `(*in, E, *out_rest)`.
        axis_name: the manual mesh axis of the ring.
        axis_size: its size n.
        n_in: how many trailing dimensions of `x` are contracted.

    Returns:
        `(..., E/n, *out_rest)`: this device's block of the sum over devices of `x · w`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from functools import partial
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> f = jax.jit(jax.shard_map(partial(matmul_reducescatter, axis_name="tp", axis_size=2),
        ...                           mesh=mesh, in_specs=(P(None, "tp"), P("tp", None)),
        ...                           out_specs=P(None, "tp")))
        >>> x, w = jnp.arange(12.0).reshape(3, 4), jnp.arange(24.0).reshape(4, 6)
        >>> bool(jnp.allclose(f(x, w), x @ w))
        True
    """
    out_dtype = jnp.result_type(x.dtype, w.dtype)
    n = axis_size
    cols = w.shape[n_in]
    if cols % n:
        raise ShardingError(f"matmul_reducescatter: {cols} output columns do not split over {n} "
                            "devices; use a column count that is a multiple of it.")
    block = cols // n
    me = lax.axis_index(axis_name)
    send_up = [(i, (i + 1) % n) for i in range(n)]

    def partial_for(k: int) -> jax.Array:
        # Device d works on column block (d - 1 - k) mod n at step k; block d is done last.
        target = (me - 1 - k) % n
        w_block = lax.dynamic_slice_in_dim(w, target * block, block, axis=n_in)
        return _contract(x, w_block, n_in)

    acc = partial_for(0).astype(out_dtype)
    for k in range(1, n):
        # The matmul does not depend on the arriving accumulator: it runs while it travels.
        part = partial_for(k)
        acc = (lax.ppermute(acc, axis_name, send_up) + part).astype(out_dtype)
    return acc


# -- the trace-time switch the dense layers consult ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class CollectiveMatmul:
    """Routes tensor-parallel `Dense` layers through the rings while a step is traced.

    Attributes:
        mesh: the strategy's mesh (it has `axis`).
        rules: the strategy's rules table (logical name -> mesh axes).
        axis: the tensor-parallel mesh axis.
    """

    mesh: Mesh
    rules: tuple
    axis: str = "tp"
    #: Ring all-gathers of this trace, by input (see `_blocks`).
    _gathered: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def size(self) -> int:
        return int(self.mesh.shape.get(self.axis, 1))

    def tp_dim(self, axes: Sequence[str | None] | None) -> int | None:
        """The kernel dimension the rules shard over `axis` (the first that claims it), or None."""
        if not axes or self.size == 1:
            return None
        for i, name in enumerate(axes):
            if self.axis in rule_axes(self.rules, name):
                return i
        return None

    def handles(self, axes: Sequence[str | None] | None, n_in: int) -> bool:
        """True when a kernel with logical `axes` is column- or row-parallel over `axis`."""
        return self.tp_dim(axes) is not None and 0 < n_in < len(axes)

    def dense(self, x: jax.Array, kernel: jax.Array, n_in: int,
              axes: Sequence[str | None]) -> jax.Array:
        """`x · kernel` over the trailing `n_in` dimensions of `x`, as a collective matmul.

        Column-parallel kernels (`tp` on an output dimension) run AG-matmul with `x` sharded on
        its first contracted dimension; row-parallel kernels (`tp` on an input dimension) run
        matmul-RS, leaving the output sharded on its first output dimension.
        """
        t = self.tp_dim(axes)
        n, lead = self.size, x.ndim - n_in
        column = t >= n_in
        split = kernel.shape[0] if column else kernel.shape[n_in]
        if split % n or kernel.shape[t] % n:
            which = "first input" if column else "first output"
            raise ShardingError(
                f"TensorParallel(overlap=True): a Dense kernel of shape {tuple(kernel.shape)} "
                f"(logical axes {tuple(axes)}) splits its {which} dimension ({split}) and its "
                f"tensor-parallel dimension "
                f"({kernel.shape[t]}) over tp={n} devices, but they are not multiples of {n}. "
                f"Make the model width and hidden sizes multiples of {n}, or use overlap=False."
            )
        k_spec: list[Any] = [None] * kernel.ndim
        k_spec[t] = self.axis
        y_spec: list[Any] = [None] * (lead + kernel.ndim - n_in)
        if column:
            y_spec[lead + t - n_in] = self.axis
            blocks = self._blocks(x, n_in)
            body = partial(blocks_matmul, axis_name=self.axis, n_in=n_in)
            return jax.shard_map(
                lambda b, w: body(list(b), w),
                mesh=self._mesh(),
                in_specs=(PartitionSpec(self.axis), PartitionSpec(*k_spec)),
                out_specs=PartitionSpec(*y_spec),
                axis_names={self.axis},
            )(blocks, kernel)
        x_spec: list[Any] = [None] * x.ndim
        x_spec[lead + t] = self.axis
        y_spec[lead] = self.axis
        return jax.shard_map(
            partial(matmul_reducescatter, axis_name=self.axis, axis_size=n, n_in=n_in),
            mesh=self._mesh(),
            in_specs=(PartitionSpec(*x_spec), PartitionSpec(*k_spec)),
            out_specs=PartitionSpec(*y_spec),
            axis_names={self.axis},
        )(x, kernel)

    def _mesh(self) -> Any:
        """The context mesh when one is set: inside another shard_map (gradient accumulation is
        manual over the batch axes) it is the abstract mesh with those axes already manual."""
        context = jax.sharding.get_abstract_mesh()
        return self.mesh if context.empty else context

    def _blocks(self, x: jax.Array, n_in: int) -> jax.Array:
        """The ring all-gather of `x` (sharded on its first contracted dimension), per device
        stacked as `(n, *block)`; global shape `(n·n, *block)` sharded on the stack axis.

        Column layers that read the same `x` (query, key and value; gate and up) share one
        ring, so the backward pass sums their input gradients before one reduce-scatter ring,
        as the synchronous path sums them before one all-reduce.
        """
        key = (id(x), n_in)
        hit = self._gathered.get(key)
        if hit is not None and hit[0] is x:
            return hit[1]
        spec: list[Any] = [None] * x.ndim
        spec[x.ndim - n_in] = self.axis
        blocks = jax.shard_map(
            lambda b: jnp.stack(ring_blocks(b, axis_name=self.axis, axis_size=self.size)),
            mesh=self._mesh(),
            in_specs=PartitionSpec(*spec),
            out_specs=PartitionSpec(self.axis),
            axis_names={self.axis},
        )(x)
        # Holding `x` keeps its id from being reused by another array while this trace lives.
        self._gathered[key] = (x, blocks)
        return blocks


_ACTIVE: contextvars.ContextVar[CollectiveMatmul | None] = contextvars.ContextVar(
    "jaxlight_collective_matmul", default=None
)


@contextlib.contextmanager
def collective_matmul_context(mesh: Mesh, rules: Sequence = (), axis: str = "tp"
                              ) -> Iterator[CollectiveMatmul | None]:
    """Makes tensor-parallel `Dense` layers traced inside use collective matmuls over `axis`.

    A mesh without `axis` (or of size 1 on it) leaves the layers unchanged. Strategies enter
    it through `TensorParallel(overlap=True).trace_context()`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from jaxlight.nn import Dense
        >>> mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
        >>> layer = Dense(4, 6, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
        >>> x = jnp.ones((3, 4))
        >>> with jax.set_mesh(mesh), collective_matmul_context(mesh, [("mlp", "tp")]):
        ...     y = nnx.jit(lambda m, x: m(x))(layer, x)
        >>> bool(jnp.allclose(y, layer(x), atol=1e-6))
        True
    """
    config = (CollectiveMatmul(mesh, tuple(rules), axis)
              if mesh is not None and mesh.shape.get(axis, 1) > 1 else None)
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def overlapped(context: contextlib.AbstractContextManager, mesh: Mesh, rules: Sequence = (),
               axis: str = "tp") -> Iterator[CollectiveMatmul | None]:
    """`context` (a strategy's trace context) with collective matmuls over `axis` switched on."""
    with context, collective_matmul_context(mesh, rules, axis) as config:
        yield config


def active_collective_matmul() -> CollectiveMatmul | None:
    """The collective-matmul routing of the step being traced, or None (plain matmuls)."""
    return _ACTIVE.get()


__all__ = [
    "OVERLAP_RULES",
    "CollectiveMatmul",
    "active_collective_matmul",
    "allgather_matmul",
    "collective_matmul_context",
    "matmul_reducescatter",
    "overlapped",
]
