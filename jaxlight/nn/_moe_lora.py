"""LoRA on a mixture-of-experts layer's experts: per-expert low-rank updates of `gate`, `up`
and `down`, applied inside the grouped matmuls (`jaxlight.nn._moe_dispatch`).

An `MoE` weight `W` `(E, D_in, D_out)` gains `A` `(E, D_in, r)` and `B` `(E, r, D_out)`
(`nnx.LoRAParam`; B zero, so the layer starts as the base): expert e computes
`x · W_e + (x · A_e) · B_e · alpha / r`, with the same group sizes as the base matmul, so the
dropless and capacity paths, and the expert-parallel dispatch, carry the update unchanged.
A and B take the weight's logical axes (`expert` on E; `A: (..., in, None)`,
`B: (..., None, out)`), so they shard as the weight they adapt: `expert` on E, `tp` where the
base splits F (B of `gate`/`up`, A of `down`).

| target name | weight | A | B |
|---|---|---|---|
| `experts.gate_proj` | `gate` `(E, D, F)` | `(E, D, r)` | `(E, r, F)` |
| `experts.up_proj` | `up` `(E, D, F)` | `(E, D, r)` | `(E, r, F)` |
| `experts.down_proj` | `down` `(E, F, D)` | `(E, F, r)` | `(E, r, D)` |

The names are transformers' per-expert module names (`mlp.experts.{j}.gate_proj`; Mixtral's
`w1`, `w3`, `w2` are the same three) behind `experts.`, beside the dense projections' names.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlight._errors import ConfigurationError

#: LoRA target name -> the `MoE` weight it adapts.
EXPERT_TARGETS = {"experts.gate_proj": "gate", "experts.up_proj": "up",
                  "experts.down_proj": "down"}


class ExpertLoRA(nnx.Module):
    """The adapters of one `MoE` layer (or a stack of them): `{name}_a`, `{name}_b` for each
    adapted weight `name` in `weights` (`gate`, `up`, `down`).

    Args:
        moe: the `MoE` layer whose weights it adapts (stacked: the leading axes carry over).
        weights: which of `gate`, `up`, `down`.
        rank: r.
        alpha: scale numerator (the update is `(x·A)·B · alpha/r`).
        rngs: random streams (`rngs.params()` draws A).
    """

    def __init__(self, moe, weights: Iterable[str], rank: int, alpha: float, *,
                 rngs: nnx.Rngs):
        if not isinstance(rank, int) or rank < 1:
            raise ConfigurationError(f"expert LoRA: rank must be an int >= 1, got {rank!r}.")
        self.weights = tuple(w for w in ("gate", "up", "down") if w in set(weights))
        self.scale = alpha / rank
        for name in self.weights:
            base = getattr(moe, name)
            axes = tuple(base.get_metadata().get("out_sharding") or (None,) * base.ndim)
            *lead, d_in, d_out = base.shape
            a = jax.random.normal(rngs.params(), (*lead, d_in, rank), base.dtype) * d_in ** -0.5
            b = jnp.zeros((*lead, rank, d_out), base.dtype)
            setattr(self, f"{name}_a", nnx.LoRAParam(a, out_sharding=(*axes[:-1], None),
                                                      eager_sharding=False))
            setattr(self, f"{name}_b", nnx.LoRAParam(
                b, out_sharding=(*axes[:-2], None, axes[-1]), eager_sharding=False))

    def factors(self) -> dict[str, tuple[jax.Array, jax.Array]]:
        """`{weight: (A, B)}` of the adapted weights."""
        return {n: (getattr(self, f"{n}_a")[...], getattr(self, f"{n}_b")[...])
                for n in self.weights}

    def merged(self, name: str, w: jax.Array, index=()) -> jax.Array:
        """`w + A·B · scale` for the weight `name` (`w` is `getattr(moe, name)[...][index]`),
        computed in float32 and returned in `w`'s dtype; `w` itself if `name` is not adapted."""
        if name not in self.weights:
            return w
        a = getattr(self, f"{name}_a")[...][index].astype(jnp.float32)
        b = getattr(self, f"{name}_b")[...][index].astype(jnp.float32)
        update = jnp.einsum("...ir,...ro->...io", a, b)
        return (w.astype(jnp.float32) + update * self.scale).astype(w.dtype)


def expert_lora_weights(targets: Iterable[str]) -> tuple[str, ...]:
    """The `MoE` weights the LoRA target names select (`experts.gate_proj` -> `gate`, ...)."""
    return tuple(EXPERT_TARGETS[t] for t in targets if t in EXPERT_TARGETS)


def add_expert_lora(moe, rank: int, alpha: float, *, rngs: nnx.Rngs,
                    targets: Iterable[str] = tuple(EXPERT_TARGETS)) -> bool:
    """Gives the `MoE` layer `moe` adapters on the expert weights `targets` names (see
    `EXPERT_TARGETS`); returns whether any were added (False when no name is an expert one).

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from jaxlight.nn import MoE
        >>> moe = MoE(8, 16, num_experts=4, experts_per_token=2, rngs=nnx.Rngs(0))
        >>> add_expert_lora(moe, 2, 4.0, rngs=nnx.Rngs(1), targets=["experts.down_proj"])
        True
        >>> moe.lora.down_a.shape, moe.lora.down_b.shape
        ((4, 16, 2), (4, 2, 8))
    """
    if moe.lora is not None:
        raise ConfigurationError(
            f"expert LoRA: this MoE layer already has adapters on {list(moe.lora.weights)}; "
            "add them once, naming every expert target in one call.")
    weights = expert_lora_weights(targets)
    if not weights:
        return False
    moe.lora = nnx.data(ExpertLoRA(moe, weights, rank, alpha, rngs=rngs))
    return True


__all__ = ["EXPERT_TARGETS", "ExpertLoRA", "add_expert_lora", "expert_lora_weights"]
