"""Two models in one fit: the trained policy beside a frozen reference.

A post-training module builds `PolicyAndReference(policy, reference)` in `configure_model` and
sets `trainable = POLICY`. Everything else follows from how jaxlight treats parameters a module
does not train (`jaxlight/state/_frozen.py`): the reference's weights ride in `TrainState.rest`,
sharded by the same rules as the policy's (same logical axes or paths, so the same layout), get
no gradient and no optimizer slot, and checkpoints record only their shape, dtype and
fingerprint; on resume `configure_model` rebuilds them from their source (a pretrained
directory, a seed) and a restore refuses other bits. The reference's forward pass runs in the
same compiled step as the policy's.

With LoRA (`trainable = nnx.LoRAParam`) no second copy is needed: the reference is the policy
with its adapters switched off, `without_adapters(model)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class PolicyAndReference(nnx.Module):
    """The trained `policy` and the frozen `reference` (usually two builds of one checkpoint).

    Example:
        >>> from flax import nnx
        >>> pair = PolicyAndReference(nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
        ...                           nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        >>> sorted(nnx.to_pure_dict(nnx.state(pair, POLICY)))
        ['policy']
    """

    def __init__(self, policy: nnx.Module, reference: nnx.Module):
        self.policy = policy
        self.reference = reference


class _PolicyParams:
    """The `nnx.Param`s under `PolicyAndReference.policy` (a Flax filter)."""

    def __call__(self, path, value) -> bool:
        return bool(path) and path[0] == "policy" and isinstance(value, nnx.Param)

    def __repr__(self) -> str:
        return "jaxlight.posttrain.POLICY"

    def __eq__(self, other) -> bool:
        return isinstance(other, _PolicyParams)

    def __hash__(self) -> int:
        return hash(_PolicyParams)


#: `TrainModule.trainable` for a `PolicyAndReference` model: only the policy's parameters train.
POLICY = _PolicyParams()


def without_adapters(model: nnx.Module) -> nnx.Module:
    """The same model with every `nnx.LoRAParam` set to zero: a LoRA policy's base model, the
    reference of LoRA post-training without a second copy of the weights. Pure: `model` is
    unchanged, the result shares its other arrays (call it inside the step)."""
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    zeros = jax.tree.map(jnp.zeros_like, adapters)
    return nnx.merge(graphdef, jax.lax.stop_gradient(zeros), rest)
