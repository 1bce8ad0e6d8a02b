"""The experts' computation: tokens grouped by expert (`jax.lax.ragged_dot`), on one device or
with the experts split over an `expert` mesh axis (tokens exchanged by all-to-all).

Per device, inside one `jax.shard_map` manual over the token axes (`batch` rule: `fsdp`,
`data`, `expert`), the expert axes and `tp`; `A = T_d · k` choices for the device's `T_d`
tokens, `n` expert shards of `E_n = E / n` experts each, `F_tp` the expert width's share:

    sort choices by expert (dropped choices last)          argsort of A int32
    n = 1:  H = ragged_dot(X[A, D], W[E, D, F_tp])          grouped matmul, E groups
    n > 1:  send[n, R, D] <- choices of peer p's experts    one buffer of R rows per peer
            recv = all_to_all(send)                        R·(n−1)·D·β bytes out, as many in
            regroup rows by local expert, ragged_dot over E_n groups
            back = all_to_all(out)                         the same bytes again
    combine: Y[T_d, D] = Σ_k w · y, psum over tp           (tp: one all-reduce of T_d·D)

`R` is the worst case a peer can receive from one device, so no choice is ever dropped in
transit: `min(A, E_n · T_d)` dropless; with a capacity factor every example sends each expert
at most C tokens, so `R = E_n · b_d · C` (`b_d` examples per device), `≈ capacity_factor ·
A / n`: the capacity path moves `capacity_factor` times the ideal bytes, the dropless path `n`
times (the ideal, `A · (n−1)/n · D · β` per direction at an even load, needs
`jax.lax.ragged_all_to_all`, which XLA:CPU does not implement).

Expert weights enter the `shard_map` gathered over every axis but the expert and `tp` axes
(FSDP's gather at the boundary; their gradients leave reduce-scattered).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxlight._errors import ShardingError
from jaxlight.sharding._layout import active_layout, rule_axes


def _grouped(x, w, sizes, name, lora):
    """`x · w` per group, plus the group's LoRA update `(x · A) · B · scale` when `lora`
    (`(scale, {name: (A, B)})`) adapts `name`: the same group sizes, so a row past their sum
    stays 0."""
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), sizes)
    if lora is not None and name in lora[1]:
        a, b = lora[1][name]
        h = jax.lax.ragged_dot(x, a.astype(x.dtype), sizes) * jnp.asarray(lora[0], x.dtype)
        y = y + jax.lax.ragged_dot(h, b.astype(x.dtype), sizes)
    return y


def expert_ffn(x: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array,
               down: jax.Array, lora: tuple | None = None) -> jax.Array:
    """SwiGLU of rows `x` `(A, D)` grouped by expert (`sizes` `(G,)`, rows past their sum
    give 0) with weights `(G, D, F)`, `(G, D, F)`, `(G, F, D)`, and the experts' LoRA
    adapters `lora` (`(scale, {"gate": (A, B), ...})`, `jaxlight.nn._moe_lora`) if any."""
    h = jax.nn.silu(_grouped(x, gate, sizes, "gate", lora)) * _grouped(x, up, sizes, "up", lora)
    return _grouped(h, down, sizes, "down", lora)


def _grouped_local(x, experts, kept, gate, up, down, lora):
    """Every expert on this device: `(A, D)` rows sorted by expert, one grouped matmul."""
    num_experts = gate.shape[0]
    k = experts.shape[-1]
    key = jnp.where(kept, experts, num_experts).reshape(-1)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    ys = expert_ffn(x[order // k], sizes, gate, up, down, lora)
    return jnp.zeros_like(ys).at[order].set(ys)


def _grouped_expert_parallel(x, experts, kept, gate, up, down, lora, *, axis, shards: int,
                             rows: int):
    """Experts split over `axis` (`shards` devices): two all-to-alls of `(shards, rows, D)`."""
    local = gate.shape[0]
    num_experts = local * shards
    k = experts.shape[-1]
    a, d = x.shape[0] * k, x.shape[-1]
    key = jnp.where(kept, experts, num_experts).reshape(-1)
    order = jnp.argsort(key, stable=True)
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    per_peer = counts.reshape(shards, local).sum(axis=1)
    peer_start = jnp.cumsum(per_peer) - per_peer
    sorted_key = key[order]
    peer = sorted_key // local  # `shards` for dropped choices
    slot = jnp.arange(a, dtype=jnp.int32) - peer_start[jnp.minimum(peer, shards - 1)]
    dest = jnp.where(peer < shards, peer * rows + slot, shards * rows)
    send = jnp.zeros((shards * rows, d), x.dtype).at[dest].set(x[order // k], mode="drop")
    recv = jax.lax.all_to_all(send.reshape(shards, rows, d), axis, 0, 0)
    recv_counts = jax.lax.all_to_all(counts.reshape(shards, local), axis, 0, 0)  # (src, E_n)
    # Each source's rows come grouped by local expert; padding rows get group `local` (last).
    ends = jnp.cumsum(recv_counts, axis=1)  # (src, E_n)
    row = jnp.arange(rows, dtype=jnp.int32)
    group = jnp.sum(row[None, :, None] >= ends[:, None, :], axis=-1).reshape(-1)
    regroup = jnp.argsort(group, stable=True)
    sizes = jnp.sum(recv_counts, axis=0).astype(jnp.int32)
    ys = expert_ffn(recv.reshape(shards * rows, d)[regroup], sizes, gate, up, down, lora)
    out = jnp.zeros_like(ys).at[regroup].set(ys).reshape(shards, rows, d)
    back = jax.lax.all_to_all(out, axis, 0, 0).reshape(shards * rows, d)
    ys_sorted = back.at[dest].get(mode="fill", fill_value=0)
    return jnp.zeros_like(ys_sorted).at[order].set(ys_sorted)


def _combine(y_choices, weights, tokens: int, k: int):
    y = y_choices.reshape(tokens, k, -1) * weights.reshape(tokens, k, 1).astype(y_choices.dtype)
    return jnp.sum(y, axis=1)


def _filtered(axes: Sequence[str], mesh_shape, manual: frozenset) -> tuple[str, ...]:
    return tuple(a for a in axes if mesh_shape.get(a, 1) > 1 and a not in manual)


def _spec_entry(axes: tuple[str, ...]) -> Any:
    return axes[0] if len(axes) == 1 else (axes or None)


def moe_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, kept: jax.Array,
                gate: jax.Array, up: jax.Array, down: jax.Array,
                capacity_rows: int | None = None, lora: tuple | None = None) -> jax.Array:
    """The experts' output `(batch, length, D)` for tokens `x` routed by `experts`, `weights`,
    `kept` `(batch, length, k)`.

    With no SPMD step being traced (or a one-device mesh) it runs here; otherwise inside a
    `shard_map` over the active mesh, with the experts split over the mesh axes the `expert`
    logical rule names (see the module docstring). `capacity_rows` is the per-example,
    per-expert capacity C when capacity dropping is on (it bounds the all-to-all buffers).
    `lora` is `(scale, {weight: (A, B)})`, the experts' LoRA factors (`ExpertLoRA`): A and B
    enter the `shard_map` split as the weight they adapt (E over the expert axes, the width F
    over `tp`); the update of `down`, like `down` itself, is summed over `tp` with the output.
    """
    b, length, d = x.shape
    k = experts.shape[-1]
    num_experts = gate.shape[0]
    layout = active_layout()
    context = jax.sharding.get_abstract_mesh()
    manual = frozenset() if context.empty else frozenset(context.manual_axes)
    if layout is None:
        return _per_device(x, experts, weights, kept, gate, up, down, lora, (), (), 1, None)
    mesh, rules = layout
    shape = dict(mesh.shape)
    expert_axes = _filtered(rule_axes(rules, "expert"), shape, manual)
    token_axes = _filtered(rule_axes(rules, "batch"), shape, manual)
    length_axes = _filtered(rule_axes(rules, "length"), shape, manual)
    tp_axes = tuple(a for a in _filtered(rule_axes(rules, "mlp"), shape, manual)
                    if a not in expert_axes)
    shards = math.prod(shape[a] for a in expert_axes)
    if num_experts % shards:
        sizes = ", ".join(f"{a}={shape[a]}" for a in expert_axes)
        fits = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
        raise ShardingError(
            f"mixture of experts: {num_experts} experts cannot be split over the expert mesh "
            f"axes {expert_axes} of total size {shards} ({sizes}): {num_experts} is not a "
            f"multiple of {shards}. Use an expert axis size that divides {num_experts} "
            f"({fits}), or a number of experts that is a multiple of {shards}.")
    f_tp = math.prod(shape[a] for a in tp_axes)
    if gate.shape[-1] % f_tp:
        raise ShardingError(
            f"mixture of experts: expert width {gate.shape[-1]} is not divisible by the tensor-"
            f"parallel axes {tp_axes} of size {f_tp}; use an expert width that is a multiple "
            f"of {f_tp}.")
    token_count = math.prod(shape[a] for a in token_axes)
    if b % token_count and b != 1:
        raise ShardingError(
            f"mixture of experts: batch {b} is not divisible by the token axes {token_axes} "
            f"of total size {token_count}; use a batch that is a multiple of {token_count}.")
    if b == 1:
        token_axes = ()
    local_tokens = (b // max(1, math.prod(shape[a] for a in token_axes))) * (
        length // max(1, math.prod(shape[a] for a in length_axes)))
    rows = None
    if shards > 1:
        rows = min(local_tokens * k, local_tokens * (num_experts // shards))
        if capacity_rows is not None:
            local_b = b // max(1, math.prod(shape[a] for a in token_axes))
            rows = min(rows, (num_experts // shards) * local_b * capacity_rows)
    manual_axes = set(expert_axes) | set(token_axes) | set(length_axes) | set(tp_axes)
    if not manual_axes:
        return _per_device(x, experts, weights, kept, gate, up, down, lora, (), (), 1, None)
    tok = PartitionSpec(_spec_entry(token_axes), _spec_entry(length_axes), None)
    col = PartitionSpec(_spec_entry(expert_axes), None, _spec_entry(tp_axes))
    row = PartitionSpec(_spec_entry(expert_axes), _spec_entry(tp_axes), None)
    whole = PartitionSpec(_spec_entry(expert_axes), None, None)
    # A and B split as their weight: gate/up (A whole, B's F over tp), down (A's F over tp).
    factor_specs = {"gate": (whole, col), "up": (whole, col), "down": (row, whole)}
    scale, factors = (None, {}) if lora is None else lora

    def body(x, experts, weights, kept, gate, up, down, factors):
        return _per_device(x, experts, weights, kept, gate, up, down,
                           None if lora is None else (scale, factors), expert_axes, tp_axes,
                           shards, rows)

    specs = {name: factor_specs[name] for name in factors}
    return jax.shard_map(body, mesh=mesh if context.empty else context,
                         in_specs=(tok, tok, tok, tok, col, col, row, specs), out_specs=tok,
                         axis_names=frozenset(manual_axes))(
        x, experts, weights, kept, gate, up, down, factors)


def _per_device(x, experts, weights, kept, gate, up, down, lora, expert_axes, tp_axes, shards,
                rows):
    b, length, d = x.shape
    k = experts.shape[-1]
    flat = x.reshape(b * length, d)
    experts = experts.reshape(b * length, k)
    kept = kept.reshape(b * length, k)
    if shards > 1:
        axis = expert_axes[0] if len(expert_axes) == 1 else expert_axes
        ys = _grouped_expert_parallel(flat, experts, kept, gate, up, down, lora, axis=axis,
                                      shards=shards, rows=rows)
    else:
        ys = _grouped_local(flat, experts, kept, gate, up, down, lora)
    y = _combine(ys, weights, b * length, k)
    if tp_axes:
        y = jax.lax.psum(y, tp_axes)
    return y.reshape(b, length, d)


__all__ = ["expert_ffn", "moe_experts"]
