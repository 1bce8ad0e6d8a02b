"""Dense MLP layers among mixture-of-experts layers (Qwen 3 MoE's `mlp_only_layers` and
`decoder_sparse_step`): two stacks, run in the checkpoint's order by a few scans.

A `DecoderLM` whose config names `dense_layers` keeps two `Stacked` modules: `layers` (the MoE
layers, in order) and `dense_layers` (the dense ones). The order of the kinds is cut into
segments, each one unit of layers repeated (`segments`): `decoder_sparse_step=2` over 48 layers
is one segment, the unit (dense, MoE) scanned 24 times; `mlp_only_layers=[0]` is a dense layer
then the 47 MoE layers scanned. Each unit position runs the slice of its stack that it needs
(a strided slice, so the scan's inputs are views of the stacked weights), so the traced program
holds one layer body per unit position, never one per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlight.nn._moe_routing import manual_token_axes
from jaxlight.nn._scan import LAYERS


def segments(kinds: Sequence[bool]) -> list[tuple[int, tuple[bool, ...], int]]:
    """`(start, unit, repeats)` covering `kinds` (True: an MoE layer) in order, the units as
    short as can be: the fewest layer bodies to trace (each segment costs one more).

    Example:
        >>> segments([False, True, False, True, False, False])
        [(0, (False, True), 2), (4, (False,), 2)]
    """
    kinds = tuple(bool(k) for k in kinds)
    n = len(kinds)
    best: list[float] = [0.0] + [float("inf")] * n
    choice: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    for end in range(1, n + 1):
        for start in range(end):
            span = kinds[start:end]
            for unit in range(1, len(span) + 1):
                if len(span) % unit == 0 and span == span[:unit] * (len(span) // unit):
                    cost = best[start] + unit + 1
                    if cost < best[end]:
                        best[end], choice[end] = cost, (start, unit)
                    break  # the span's shortest period
    out, end = [], n
    while end:
        start, unit = choice[end]
        out.append((start, kinds[start:start + unit], (end - start) // unit))
        end = start
    return out[::-1]


def _slice(stack: nnx.Module, part: slice) -> nnx.Module:
    graphdef, state = nnx.split(stack)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[part], state))


def run_mixed(stacks: dict[bool, nnx.Module], kinds: Sequence[bool], x: jax.Array,
              inputs: tuple[jax.Array, ...], outputs: tuple[jax.Array, ...],
              layer_fn: Callable) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Runs the layers in order: `layer_fn(layer, x, *inputs[l]) -> (x, outs)`.

    Args:
        stacks: the stacked layers of each kind (`{True: moe_layers, False: dense_layers}`).
        kinds: per layer of the model, its kind.
        x: the carry (activations).
        inputs: per-layer inputs with a leading layer axis in the model's order.
        outputs: arrays with a leading layer axis that `layer_fn`'s `outs` are written into
            (the key/value caches), returned updated.
    """
    index = {True: 0, False: 0}
    position = []  # each layer's index in its own stack
    for kind in kinds:
        position.append(index[kind])
        index[kind] += 1
    outputs = list(outputs)
    for start, unit, repeats in segments(kinds):
        layers, xs, where = [], [], []
        for p, kind in enumerate(unit):
            per_unit = sum(1 for k in unit if k == kind)
            first = position[start + p]
            layers.append(_slice(stacks[kind], slice(first, first + repeats * per_unit,
                                                     per_unit)))
            rows = slice(start + p, start + p + repeats * len(unit), len(unit))
            xs.append(tuple(a[rows] for a in inputs))
            where.append(rows)

        @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                  transform_metadata={nnx.PARTITION_NAME: LAYERS})
        def run(layers, x, xs):
            outs = []
            for layer, args in zip(layers, xs, strict=True):
                x, out = layer_fn(layer, x, *args)
                outs.append(out)
            return x, tuple(outs)

        x, outs = run(tuple(layers), x, tuple(xs))
        for rows, out in zip(where, outs, strict=True):
            for j, value in enumerate(out):
                outputs[j] = outputs[j].at[rows].set(value.astype(outputs[j].dtype))
    return x, tuple(outputs)


def balance_loss(c, load: jax.Array, importance: jax.Array, valid: jax.Array
                 ) -> dict[str, jax.Array]:
    """transformers' `load_balancing_loss_func` from each layer's router statistics.

    Args:
        c: the `DecoderConfig`.
        load: `(layers, E)` tokens routed to each expert (all k choices), zeros for a dense
            layer.
        importance: `(layers, E)` the mean router probability of each expert.
        valid: `(batch, length)` the real tokens.

    Returns:
        `aux_loss = E · Σ_e f_e · P_e` with `f_e` the fraction of (layer, token) rows routed to
        e and `P_e` its mean probability, both over the MoE layers together (not a mean of
        per-layer losses: transformers sums the counts and probabilities over layers first),
        `loss = c.aux_loss_weight · aux_loss`, and `load` summed over layers.
    """
    layers = len(c.sparse_layers)
    tokens = jnp.sum(valid.astype(jnp.float32))
    axes = manual_token_axes()
    if axes:  # the load is already summed over the token shards (`route`)
        tokens = jax.lax.psum(tokens, axes)
    total = jnp.sum(load, axis=0)
    fraction = total / (layers * jnp.maximum(tokens, 1.0))
    aux = c.num_experts * jnp.sum(fraction * jnp.sum(importance, axis=0) / layers)
    return {"aux_loss": aux, "loss": c.aux_loss_weight * aux, "load": total}


__all__ = ["balance_loss", "run_mixed", "segments"]
