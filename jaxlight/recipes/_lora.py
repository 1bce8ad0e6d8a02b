"""LoRA adapters on `jaxlight.nn.Dense` layers (the sft recipe's, for gpt and pretrained models)
and, by name, on mixture-of-experts layers' experts (`jaxlight.nn.add_expert_lora`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlight.nn import Dense, MoE, add_expert_lora


class LoRADense(nnx.Module):
    """A frozen `jaxlight.nn.Dense` plus a trainable low-rank update `(x·A)·B · alpha/rank`.

    Works on a stacked (`nn.Stacked`) layer too: A and B then carry the same leading layer axis
    as the kernel. A and B take the kernel's logical axes (`A: (*in, None)`, `B: (None, *out)`),
    so they shard as the layer they adapt.

    Args:
        base: the `Dense` layer to adapt (its parameters stay `nnx.Param`).
        rank: the rank r of the update.
        alpha: scale numerator.
        rngs: random streams (`rngs.params()` initializes A).
    """

    def __init__(self, base, rank: int, alpha: float, *, rngs: nnx.Rngs):
        self.base = base
        kernel = base.kernel
        axes = tuple(kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim)
        n_in, n_out = len(base.in_features), len(base.out_features)
        n_lead = kernel.ndim - n_in - n_out
        lead, lead_axes = kernel.shape[:n_lead], axes[:n_lead]
        in_axes, out_axes = axes[n_lead:n_lead + n_in], axes[n_lead + n_in:]
        fan_in = math.prod(base.in_features)
        a = jax.random.normal(rngs.params(), (*lead, *base.in_features, rank),
                              kernel.dtype) * fan_in ** -0.5
        b = jnp.zeros((*lead, rank, *base.out_features), kernel.dtype)
        self.lora_a = nnx.LoRAParam(a, out_sharding=(*lead_axes, *in_axes, None),
                                    eager_sharding=False)
        self.lora_b = nnx.LoRAParam(b, out_sharding=(*lead_axes, None, *out_axes),
                                    eager_sharding=False)
        self.scale = alpha / rank

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base(x)
        n_in = len(self.base.in_features)
        a, b = self.lora_a[...], self.lora_b[...]
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        h = jax.lax.dot_general(x.astype(a.dtype), a, (contract, ((), ())))
        update = jnp.tensordot(h, b, axes=1) * self.scale
        return y + update.astype(y.dtype)


def add_lora(module: nnx.Module, rank: int, alpha: float, *, rngs: nnx.Rngs,
             names: tuple[str, ...] | None = None) -> int:
    """Wraps every `jaxlight.nn.Dense` inside `module` (or those whose attribute name is in
    `names`, e.g. `("q_proj", "v_proj")`) in a `LoRADense`; returns how many.

    `names` may also hold the experts' targets (`jaxlight.nn.EXPERT_TARGETS`:
    `experts.gate_proj`, `experts.up_proj`, `experts.down_proj`): every `MoE` layer then gets
    per-expert adapters on those weights (an `MoE` counts once, whatever it adapts)."""
    count = 0

    def visit(parent: nnx.Module) -> None:
        nonlocal count
        for name, child in list(vars(parent).items()):
            if isinstance(child, MoE) and names is not None and add_expert_lora(
                    child, rank, alpha, rngs=rngs, targets=names):
                count += 1
            if isinstance(child, Dense) and (names is None or name in names):
                setattr(parent, name, LoRADense(child, rank, alpha, rngs=rngs))
                count += 1
            elif isinstance(child, nnx.Module) and not isinstance(child, LoRADense):
                visit(child)

    visit(module)
    return count
