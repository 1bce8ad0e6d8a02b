"""`MoE`: a mixture-of-experts feed-forward layer (router, SwiGLU experts, optional shared
expert), and `MoETransformerLM`, `TransformerLM` with MoE layers in place of its MLPs.

Weights and their logical axes (the `expert` rule maps the experts' axis to the `expert` mesh
axis; `embed` -> `fsdp`, `mlp` -> `tp` as everywhere):

| weight | shape | logical axes |
|---|---|---|
| `router.kernel` | `(D, E)` | `("embed", None)` |
| `gate`, `up` | `(E, D, F)` | `("expert", "embed", "mlp")` |
| `down` | `(E, F, D)` | `("expert", "mlp", "embed")` |
| `shared` (optional) | a SwiGLU `MLP` | as `MLP` |
| `router_bias` (optional) | `(E,)` | an `ExpertBias` variable, outside the optimizer |
| `lora` (optional) | per-expert LoRA factors of `gate`/`up`/`down` | as the weight (`_moe_lora`) |

Sharded shapes under `Hybrid({"data": d, "expert": n, "tp": t})`: tokens
`X[B_(data,expert), L, D]`, experts `W[E_expert, D, F_tp]`. Routing is global
(`jaxlight.nn._moe_routing`), the experts run per device with two all-to-alls over `expert`
and one all-reduce over `tp` (`jaxlight.nn._moe_dispatch`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlight._errors import ConfigurationError, DataError
from jaxlight.nn._layers import MLP, Dense, annotated_param
from jaxlight.nn._moe_dispatch import moe_experts
from jaxlight.nn._moe_routing import (
    balance_bias_update,
    capacity,
    check_routing,
    manual_token_axes,
    route,
)
from jaxlight.nn._transformer import TransformerConfig, TransformerLM, pre_norm_attention
from jaxlight.sharding._layout import constrain

#: The per-layer statistics `MoE` returns (scalars, and `load` per expert).
STAT_NAMES = ("aux_loss", "z_loss", "dropped_fraction", "load", "importance")


class ExpertBias(nnx.Variable):
    """DeepSeek-V3's auxiliary-loss-free routing bias: state the layer updates itself, never
    the optimizer (like batch statistics)."""


class MoE(nnx.Module):
    """A mixture-of-experts SwiGLU layer: each token goes to `k` of `num_experts` experts.

    Args:
        features: model width D.
        expert_dim: each expert's hidden width F.
        num_experts: E.
        experts_per_token: k.
        router: "softmax_topk" (Qwen 3 MoE), "topk_softmax" (Mixtral) or "sigmoid"
            (DeepSeek-V3); see `jaxlight.nn._moe_routing`.
        renormalize: divide the k weights by their sum (Qwen's `norm_topk_prob`).
        capacity_factor: None for the dropless path (default), or tokens per expert relative
            to an even load, per example (choices over capacity are dropped and counted).
        shared_expert_dim: width of an always-on shared SwiGLU expert (0: none).
        bias_update_rate: > 0 turns on the auxiliary-loss-free bias, moved by this much per
            step toward an even load (while not `deterministic`).
        dtype, param_dtype: compute and parameter dtypes.
        rngs: random streams.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> moe = MoE(8, 16, num_experts=4, experts_per_token=2, rngs=nnx.Rngs(0))
        >>> y, stats = moe(jnp.ones((2, 3, 8)))
        >>> y.shape, float(stats["dropped_fraction"])
        ((2, 3, 8), 0.0)
    """

    def __init__(self, features: int, expert_dim: int, *, num_experts: int,
                 experts_per_token: int, router: str = "softmax_topk", renormalize: bool = True,
                 capacity_factor: float | None = None, shared_expert_dim: int = 0,
                 bias_update_rate: float = 0.0, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        check_routing(num_experts, experts_per_token, router, capacity_factor, "MoE")
        self.num_experts, self.k = num_experts, experts_per_token
        self.router_name, self.renormalize = router, renormalize
        self.capacity_factor = capacity_factor
        self.bias_update_rate = float(bias_update_rate)
        self.deterministic = False
        self.dtype = dtype
        self.router = Dense(features, num_experts, axes=("embed", None), dtype=jnp.float32,
                            param_dtype=param_dtype, rngs=rngs)
        init_in = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
        e, d, f = num_experts, features, expert_dim
        self.gate = annotated_param(init_in(rngs.params(), (e, d, f), param_dtype),
                                    ("expert", "embed", "mlp"))
        self.up = annotated_param(init_in(rngs.params(), (e, d, f), param_dtype),
                                  ("expert", "embed", "mlp"))
        self.down = annotated_param(init_in(rngs.params(), (e, f, d), param_dtype),
                                    ("expert", "mlp", "embed"))
        self.shared = (MLP(features, shared_expert_dim, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs) if shared_expert_dim else None)
        self.router_bias = (ExpertBias(jnp.zeros((num_experts,), jnp.float32))
                            if self.bias_update_rate > 0 else None)
        #: The experts' LoRA adapters (`jaxlight.nn.add_expert_lora`), None without.
        self.lora = None

    def __call__(self, x: jax.Array, mask: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`(y, stats)` for `x` `(batch, length, features)`; `stats` per `STAT_NAMES`, over the
        tokens where `mask` `(batch, length)` is nonzero (default: all)."""
        if x.ndim != 3:
            raise DataError(f"MoE takes activations (batch, length, features), got {x.shape}.")
        logits = self.router(x.astype(jnp.float32))
        bias = None if self.router_bias is None else jax.lax.stop_gradient(
            self.router_bias[...])
        routing = route(logits, self.k, router=self.router_name, renormalize=self.renormalize,
                        capacity_factor=self.capacity_factor, bias=bias,
                        token_axes=manual_token_axes(), mask=mask)
        if self.router_bias is not None and not self.deterministic:
            self.router_bias[...] = balance_bias_update(
                self.router_bias[...], jax.lax.stop_gradient(routing.stats["load"]),
                self.bias_update_rate)
        cap = None if self.capacity_factor is None else capacity(
            x.shape[1], self.num_experts, self.k, self.capacity_factor)
        xc = x if self.dtype is None else x.astype(self.dtype)
        y = moe_experts(xc, routing.experts, routing.weights, routing.kept, self.gate[...],
                        self.up[...], self.down[...], capacity_rows=cap,
                        lora=None if self.lora is None else (self.lora.scale,
                                                             self.lora.factors()))
        if self.shared is not None:
            y = y + self.shared(xc)
        return constrain(y.astype(x.dtype), ("batch", "length", "activation_embed")), \
            routing.stats


@dataclasses.dataclass(frozen=True)
class MoEConfig(TransformerConfig):
    """`TransformerConfig` plus the experts (every block's MLP is an `MoE`).

    Attributes:
        num_experts: E.
        experts_per_token: k.
        expert_dim: each expert's hidden width (default `mlp_dim`, i.e. `4 * embed_dim`).
        router: see `MoE`.
        renormalize: see `MoE`.
        capacity_factor: None (dropless) or see `MoE`.
        shared_expert_dim: see `MoE`.
        bias_update_rate: see `MoE`.
        aux_loss_weight: weight of the load-balancing loss in `aux["loss"]`.
        z_loss_weight: weight of the router z-loss in `aux["loss"]`.
    """

    num_experts: int = 8
    experts_per_token: int = 2
    expert_dim: int | None = None
    router: str = "softmax_topk"
    renormalize: bool = True
    capacity_factor: float | None = None
    shared_expert_dim: int = 0
    bias_update_rate: float = 0.0
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        check_routing(self.num_experts, self.experts_per_token, self.router,
                      self.capacity_factor, "MoEConfig")

    @property
    def resolved_expert_dim(self) -> int:
        return self.expert_dim or self.resolved_mlp_dim


class MoEBlock(nnx.Module):
    """Pre-norm block `x + attn(norm(x))`, then `x + moe(norm(x))`; the scan carry is
    `(x, summed stats)`."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        c = config
        kw = pre_norm_attention(self, c, rngs)
        self.moe = MoE(c.embed_dim, c.resolved_expert_dim, num_experts=c.num_experts,
                       experts_per_token=c.experts_per_token, router=c.router,
                       renormalize=c.renormalize, capacity_factor=c.capacity_factor,
                       shared_expert_dim=c.shared_expert_dim,
                       bias_update_rate=c.bias_update_rate, **kw)

    def __call__(self, carry, positions: jax.Array):
        x, totals = carry
        x = x + self.attn(self.attn_norm(x), positions)
        y, stats = self.moe(self.mlp_norm(x))
        x = constrain(x + y, ("batch", "length", "activation_embed"))
        return x, jax.tree.map(jnp.add, totals, stats)


class MoETransformerLM(TransformerLM):
    """`TransformerLM` whose blocks' MLPs are `MoE` layers.

    `model(tokens)` returns float32 logits; `model(tokens, return_aux=True)` returns
    `(logits, aux)` with `aux["loss"]` (the weighted auxiliary losses, to add to the LM loss)
    and, averaged over layers, `aux_loss`, `z_loss`, `dropped_fraction`, plus `load`
    `(E,)` (tokens per expert, summed over layers).

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> cfg = MoEConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2,
        ...                 num_experts=4, experts_per_token=2, expert_dim=8)
        >>> logits, aux = MoETransformerLM(cfg, rngs=nnx.Rngs(0))(
        ...     jnp.zeros((2, 8), jnp.int32), return_aux=True)
        >>> logits.shape, sorted(aux)
        ((2, 8, 32), ['aux_loss', 'dropped_fraction', 'load', 'loss', 'z_loss'])
    """

    block_type = MoEBlock

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, MoEConfig):
            raise ConfigurationError(
                f"MoETransformerLM takes a MoEConfig, got {type(config).__name__}; use "
                "jaxlight.nn.MoEConfig(..., num_experts=8, experts_per_token=2).")
        super().__init__(config, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
                 return_aux: bool = False):
        c = self.config
        x, positions = self._inputs(tokens, positions)
        zero = jnp.zeros((), jnp.float32)
        totals = {"aux_loss": zero, "z_loss": zero, "dropped_fraction": zero,
                  "load": jnp.zeros((c.num_experts,), jnp.float32),
                  "importance": jnp.zeros((c.num_experts,), jnp.float32)}
        x, totals = self.blocks((x, totals), positions)
        logits = self._logits(x)
        if not return_aux:
            return logits
        aux = {name: totals[name] / c.num_layers
               for name in ("aux_loss", "z_loss", "dropped_fraction")}
        aux["load"] = totals["load"]
        aux["loss"] = c.aux_loss_weight * aux["aux_loss"] + c.z_loss_weight * aux["z_loss"]
        return logits, aux


__all__ = ["STAT_NAMES", "ExpertBias", "MoE", "MoEBlock", "MoEConfig", "MoETransformerLM"]
