"""A decoder-only transformer LM: RMSNorm, rotary positions, SwiGLU, causal attention.

Its blocks are one `Stacked` module (a scan over layers), its weights carry logical axes, so the
same model trains under SingleDevice, DDP, DataParallel, FSDP, TensorParallel, GPipe and Hybrid.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlight._errors import ConfigurationError, DataError
from jaxlight._layout import constrain
from jaxlight.nn._layers import (
    MLP,
    Dense,
    Embed,
    MultiHeadAttention,
    RMSNorm,
    check_attention_name,
)
from jaxlight.nn._stacked import Stacked, remat_policy


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The shape of a `TransformerLM`.

    Attributes:
        vocab_size: tokens in the vocabulary.
        embed_dim: model width.
        num_layers: transformer blocks.
        num_heads: attention heads (must divide `embed_dim` unless `head_dim` is given).
        head_dim: width per head (default `embed_dim // num_heads`).
        mlp_dim: SwiGLU hidden width (default `4 * embed_dim`).
        rope_theta: rotary base wavelength.
        norm_eps: RMSNorm epsilon.
        tie_embeddings: reuse the token embedding as the output head.
        remat: what each block recomputes in the backward pass instead of storing:
            False/"none", True/"full", "dots" (keep the weight matmuls' outputs) or a
            `jax.checkpoint_policies` policy (see `jaxlight.nn.Stacked`).
        attention: "auto" (cuDNN flash attention on a CUDA GPU in bfloat16, else XLA), "xla"
            or "cudnn" (see `jaxlight.nn.MultiHeadAttention`).
        dtype: compute dtype (None: float32 parameters compute in float32).
        param_dtype: parameter dtype.
    """

    vocab_size: int = 128
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int | None = None
    mlp_dim: int | None = None
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    remat: Any = False
    attention: str = "auto"
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        remat_policy(self.remat)
        check_attention_name(self.attention)
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"TransformerConfig.{name} must be a positive int, got {value!r}.")
        if self.head_dim is None and self.embed_dim % self.num_heads:
            divisors = [d for d in range(1, self.embed_dim + 1) if self.embed_dim % d == 0]
            near = sorted(divisors, key=lambda d: (abs(d - self.num_heads), d))[:2]
            raise ConfigurationError(
                f"TransformerConfig: embed_dim {self.embed_dim} is not divisible by num_heads "
                f"{self.num_heads}; use a num_heads that divides {self.embed_dim} (nearest: "
                f"{' or '.join(map(str, sorted(near)))}), change embed_dim, or set head_dim."
            )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.embed_dim // self.num_heads

    @property
    def resolved_mlp_dim(self) -> int:
        return self.mlp_dim or 4 * self.embed_dim


class TransformerBlock(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    Under tensor parallelism it costs four all-reduces of `batch × length × embed` activations
    per step: after the attention and MLP output projections (forward) and at the attention and
    MLP inputs (backward).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c = config
        kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        self.attn_norm = RMSNorm(c.embed_dim, eps=c.norm_eps, param_dtype=c.param_dtype,
                                 rngs=rngs)
        self.attn = MultiHeadAttention(c.embed_dim, c.num_heads, head_dim=c.resolved_head_dim,
                                       rope_theta=c.rope_theta, attention=c.attention, **kw)
        self.mlp_norm = RMSNorm(c.embed_dim, eps=c.norm_eps, param_dtype=c.param_dtype,
                                rngs=rngs)
        self.mlp = MLP(c.embed_dim, c.resolved_mlp_dim, **kw)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", "activation_embed"))


class TransformerLM(nnx.Module):
    """A decoder-only language model returning float32 logits `(batch, length, vocab)`.

    Args:
        config: the model's shape.
        rngs: random streams.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> cfg = TransformerConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2)
        >>> model = TransformerLM(cfg, rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 8), jnp.int32)).shape
        (2, 8, 32)
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = Embed(c.vocab_size, c.embed_dim, param_dtype=c.param_dtype, rngs=rngs)
        self.blocks = Stacked(lambda r: TransformerBlock(c, rngs=r), c.num_layers, rngs=rngs,
                              remat=c.remat)
        self.final_norm = RMSNorm(c.embed_dim, eps=c.norm_eps, param_dtype=c.param_dtype,
                                  rngs=rngs)
        self.head = None if c.tie_embeddings else Dense(
            c.embed_dim, c.vocab_size, axes=("embed", "vocab"), dtype=c.dtype,
            param_dtype=c.param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Logits for `tokens` `(batch, length)`; positions default to `0..length-1`."""
        if tokens.ndim != 2:
            raise DataError(f"TransformerLM takes tokens of shape (batch, length), got "
                            f"{tokens.shape}.")
        if positions is None:
            positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = self.embed(tokens)
        if self.config.dtype is not None:
            x = x.astype(self.config.dtype)
        x = constrain(x, ("batch", "length", "activation_embed"))
        x = self.blocks(x, positions)
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "activation_vocab"))


def lm_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean token cross-entropy of `logits` `(..., vocab)` against integer `targets`.

    Example:
        >>> import jax.numpy as jnp
        >>> float(lm_loss(jnp.zeros((1, 2, 4)), jnp.array([[0, 3]])))  # log(4)
        1.3862943649291992
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return losses.mean()
    mask = mask.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
