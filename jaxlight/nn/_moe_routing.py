"""Mixture-of-experts routing: which experts each token goes to, with what weight, and the
router's auxiliary losses.

Routing runs on the global token arrays (outside any `shard_map`), so every quantity below is
the same whatever the layout: a load-balancing loss computed per device and averaged would not
be. `T` tokens, `E` experts, `k` experts per token:

- `"softmax_topk"` (Qwen 3 MoE, DeepSeek-V2): `p = softmax(logits)`, the k largest `p` are
  the weights, divided by their sum when `renormalize` (Qwen's `norm_topk_prob`).
- `"topk_softmax"` (Mixtral): the k largest logits, softmax over those k. Mathematically
  `softmax_topk` with `renormalize=True`; kept as its own name because it is Mixtral's order.
- `"sigmoid"` (DeepSeek-V3): `s = sigmoid(logits)`, the k largest `s`, divided by their sum
  when `renormalize`.

The **auxiliary-loss-free bias** (DeepSeek-V3) is added to the scores only to choose the
experts, never to weigh them; the layer updates it outside the optimizer from the step's load.

The **load-balancing loss** is Switch/Mixtral's as transformers computes it (its
`load_balancing_loss_func` for one layer): `E · Σ_e (c_e / T) · P_e`, where `c_e` counts the
tokens routed to e (over all k choices) and `P_e` is the mean router probability of e; k at a
perfectly even load. The **router z-loss** (ST-MoE) is `mean_t logsumexp(logits_t)²`.

**Capacity** (`capacity_factor`, GShard/Switch dropping): every example may send at most
`C = ceil(capacity_factor · L · k / E)` tokens to each expert (L tokens per example); choices
are served first-choice-first, then by position, and the rest are dropped (weight 0: the token
keeps only its residual for that choice). Per example, so that the same tokens drop on one
device and on any mesh. At `capacity_factor ≥ E / k`, `C ≥ L` and nothing can drop.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxlight._errors import ConfigurationError

#: What `router=` accepts.
ROUTERS = {
    "softmax_topk": "softmax over all experts, then the k largest (Qwen 3 MoE)",
    "topk_softmax": "the k largest logits, then softmax over those (Mixtral)",
    "sigmoid": "sigmoid scores, the k largest (DeepSeek-V3)",
}


class Routing(NamedTuple):
    """A layer's routing decision for `T` tokens, global arrays (`(..., k)` per token).

    Attributes:
        experts: int32 chosen experts `(batch, length, k)`.
        weights: combine weights `(batch, length, k)` (0 for a dropped choice).
        kept: bool `(batch, length, k)`: False where capacity dropped the choice.
        stats: scalars and per-expert counts (see `route`).
    """

    experts: jax.Array
    weights: jax.Array
    kept: jax.Array
    stats: dict[str, jax.Array]


def check_routing(num_experts: int, k: int, router: str, capacity_factor: Any,
                  who: str) -> None:
    """Refuses a router, k or capacity factor that cannot route, naming the fix."""
    if router not in ROUTERS:
        raise ConfigurationError(
            f"{who}: router={router!r} is not a router; use one of "
            f"{', '.join(repr(r) for r in ROUTERS)}.")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ConfigurationError(f"{who}: num_experts must be a positive int, got {num_experts!r}.")
    if not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ConfigurationError(
            f"{who}: experts_per_token={k!r} must be an int from 1 to num_experts="
            f"{num_experts} (each token picks k distinct experts).")
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(
            capacity_factor, int | float) or capacity_factor <= 0):
        raise ConfigurationError(
            f"{who}: capacity_factor={capacity_factor!r} must be a positive number (tokens per "
            f"expert relative to an even load; {num_experts / k:g} = E/k drops nothing) or None "
            "for the dropless path.")


def capacity(length: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Tokens one example may send to one expert: `ceil(capacity_factor · L · k / E)`, ≤ L.

    Example:
        >>> capacity(16, 8, 2, 1.0), capacity(16, 8, 2, 4.0), capacity(16, 8, 2, 100.0)
        (4, 16, 16)
    """
    return max(1, min(length, math.ceil(capacity_factor * length * k / num_experts - 1e-9)))


def _choose(logits: jax.Array, k: int, router: str, renormalize: bool,
            bias: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(experts, weights, probabilities over all experts) for float32 `logits` `(..., E)`."""
    if router == "sigmoid":
        probs = jax.nn.sigmoid(logits)
    else:
        probs = jax.nn.softmax(logits, axis=-1)
    select = probs if bias is None else probs + bias
    _, experts = jax.lax.top_k(select, k)
    chosen = jnp.take_along_axis(probs, experts, axis=-1)
    if router == "topk_softmax":
        weights = jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1)
    elif renormalize:
        weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True)
    else:
        weights = chosen
    if router == "sigmoid":  # the balance loss wants a distribution over experts
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
    return experts, weights, probs


def _capacity_mask(experts: jax.Array, num_experts: int, cap: int) -> jax.Array:
    """True for the choices that fit: per example and expert, first choices first, then by
    position, at most `cap`."""
    b, length, k = experts.shape
    order = jnp.swapaxes(experts, 1, 2).reshape(b, k * length)  # choice-major
    onehot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32)
    position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1)
    return jnp.swapaxes((position < cap).reshape(b, k, length), 1, 2)


#: Mesh axes that split tokens: inside a `shard_map` manual over some of them (the per-replica
#: gradient scan of `FSDP`, for example) the routing sees a shard of the batch.
TOKEN_AXES = ("data", "fsdp", "expert", "context")


def manual_token_axes() -> tuple[str, ...]:
    """The token-splitting mesh axes that are manual where this is traced (usually none)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    return tuple(a for a in TOKEN_AXES if a in mesh.manual_axes and mesh.shape.get(a, 1) > 1)


def route(logits: jax.Array, k: int, *, router: str = "softmax_topk", renormalize: bool = True,
          capacity_factor: float | None = None, bias: jax.Array | None = None,
          token_axes: tuple[str, ...] = (), mask: jax.Array | None = None) -> Routing:
    """Routes tokens from router logits `(batch, length, E)` (any float dtype; computed in
    float32).

    `stats` holds `aux_loss` (load balancing), `z_loss`, `dropped_fraction` (of the T·k
    choices), `load` (tokens per expert, `(E,)` float32, dropped choices included: what the
    router asked for) and `importance` (the mean router probability of each expert, `(E,)`).
    With a `mask` `(batch, length)` (0 for padding) the load, importance and so the balance
    loss count only the real tokens, as transformers' `load_balancing_loss_func` does with an
    attention mask; routing itself is unchanged.

    Inside a `shard_map` manual over `token_axes` (a shard of the batch per device), `load` is
    summed over them, so the bias update sees the global load, and `aux_loss` uses the global
    load fractions with this shard's mean probabilities: its mean over the shards is the
    global loss, and so is the mean of its gradients (the load has none).

    Example:
        >>> import jax.numpy as jnp
        >>> r = route(jnp.array([[[2.0, 1.0, 0.0, -1.0]]]), 2)
        >>> r.experts.tolist(), [round(w, 3) for w in r.weights[0, 0].tolist()]
        ([[[0, 1]]], [0.731, 0.269])
    """
    logits = logits.astype(jnp.float32)
    b, length, num_experts = logits.shape
    experts, weights, probs = _choose(logits, k, router, renormalize, bias)
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.float32)  # (b, l, k, E)
    if mask is None:
        load = jnp.sum(onehot, axis=(0, 1, 2))
        tokens = b * length
        importance = jnp.mean(probs, axis=(0, 1))
    else:
        w = mask.astype(jnp.float32)
        load = jnp.einsum("blke,bl->e", onehot, w)
        tokens = jnp.sum(w)
        importance = jnp.einsum("ble,bl->e", probs, w) / jnp.maximum(tokens, 1.0)
    if token_axes:
        load = jax.lax.psum(load, token_axes)
        tokens = jax.lax.psum(tokens, token_axes)
    aux = num_experts * jnp.sum(load / jnp.maximum(tokens, 1) * importance)
    z = jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    if capacity_factor is None:
        kept = jnp.ones(experts.shape, bool)
    else:
        kept = _capacity_mask(experts, num_experts,
                              capacity(length, num_experts, k, capacity_factor))
        weights = jnp.where(kept, weights, 0.0)
    dropped = 1.0 - jnp.mean(kept.astype(jnp.float32))
    stats = {"aux_loss": aux, "z_loss": z, "dropped_fraction": dropped, "load": load,
             "importance": importance}
    return Routing(experts.astype(jnp.int32), weights, kept, stats)


def balance_bias_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free update: each expert's bias moves by `rate` toward an
    even load (up when it got fewer tokens than the mean, down when more).

    Example:
        >>> import jax.numpy as jnp
        >>> balance_bias_update(jnp.zeros(3), jnp.array([1.0, 2.0, 3.0]), 0.1).tolist()
        [0.10000000149011612, 0.0, -0.10000000149011612]
    """
    return bias + rate * jnp.sign(jnp.mean(load) - load)


__all__ = ["ROUTERS", "TOKEN_AXES", "Routing", "balance_bias_update", "capacity", "check_routing",
           "manual_token_axes", "route"]
