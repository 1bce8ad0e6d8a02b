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
from jaxlight.nn._layers import (
    MLP,
    Dense,
    Embed,
    MultiHeadAttention,
    RMSNorm,
    check_attention_name,
)
from jaxlight.nn._stacked import Stacked, remat_policy
from jaxlight.nn._stages import Stages
from jaxlight.sharding._layout import constrain


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


def pre_norm_attention(block: nnx.Module, c: TransformerConfig, rngs: nnx.Rngs) -> dict:
    """Gives `block` a block's attention half and MLP norm (`attn_norm`, `attn`, `mlp_norm`);
    returns the dtype keywords for its MLP (shared by `TransformerBlock` and `MoEBlock`)."""
    kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
    block.attn_norm = RMSNorm(c.embed_dim, eps=c.norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    block.attn = MultiHeadAttention(c.embed_dim, c.num_heads, head_dim=c.resolved_head_dim,
                                    rope_theta=c.rope_theta, attention=c.attention, **kw)
    block.mlp_norm = RMSNorm(c.embed_dim, eps=c.norm_eps, param_dtype=c.param_dtype, rngs=rngs)
    return kw


class TransformerBlock(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.

    Under tensor parallelism it costs four all-reduces of `batch × length × embed` activations
    per step: after the attention and MLP output projections (forward) and at the attention and
    MLP inputs (backward).
    """

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        kw = pre_norm_attention(self, config, rngs)
        self.mlp = MLP(config.embed_dim, config.resolved_mlp_dim, **kw)

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

    #: The repeated block (`MoETransformerLM` swaps in `MoEBlock`).
    block_type: type = TransformerBlock

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        block_type = type(self).block_type
        self.embed = Embed(c.vocab_size, c.embed_dim, param_dtype=c.param_dtype, rngs=rngs)
        self.blocks = Stacked(lambda r: block_type(c, rngs=r), c.num_layers, rngs=rngs,
                              remat=c.remat)
        self.final_norm = RMSNorm(c.embed_dim, eps=c.norm_eps, param_dtype=c.param_dtype,
                                  rngs=rngs)
        self.head = None if c.tie_embeddings else Dense(
            c.embed_dim, c.vocab_size, axes=("embed", "vocab"), dtype=c.dtype,
            param_dtype=c.param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Logits for `tokens` `(batch, length)`; positions default to `0..length-1`."""
        x, positions = self._inputs(tokens, positions)
        return self._logits(self.blocks(x, positions))

    def _inputs(self, tokens, positions) -> tuple[jax.Array, jax.Array]:
        """The embedded tokens and their positions (default `0..length-1`)."""
        if tokens.ndim != 2:
            raise DataError(f"{type(self).__name__} takes tokens of shape (batch, length), got "
                            f"{tokens.shape}.")
        if positions is None:
            positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        x = self.embed(tokens)
        if self.config.dtype is not None:
            x = x.astype(self.config.dtype)
        return constrain(x, ("batch", "length", "activation_embed")), positions

    def _logits(self, x: jax.Array) -> jax.Array:
        x = self.final_norm(x)
        logits = self.embed.attend(x) if self.head is None else self.head(x)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "activation_vocab"))


class _EmbedStage(nnx.Module):
    """Stage 0 of a `StagedTransformerLM`: the token embedding."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.dtype = config.dtype
        self.embed = Embed(config.vocab_size, config.embed_dim, param_dtype=config.param_dtype,
                           rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        return x if self.dtype is None else x.astype(self.dtype)


class _BlocksStage(nnx.Module):
    """A few transformer blocks, positions 0..length−1 (a middle stage)."""

    def __init__(self, config: TransformerConfig, num_blocks: int, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([TransformerBlock(config, rngs=rngs) for _ in range(num_blocks)])

    def __call__(self, x: jax.Array) -> jax.Array:
        positions = jnp.arange(x.shape[1], dtype=jnp.int32)
        for block in self.blocks:
            x = block(x, positions)
        return x


class _HeadStage(nnx.Module):
    """The last stage: final norm and the (untied) output head; float32 logits."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        c = config
        self.final_norm = RMSNorm(c.embed_dim, eps=c.norm_eps, param_dtype=c.param_dtype,
                                  rngs=rngs)
        self.head = Dense(c.embed_dim, c.vocab_size, axes=("embed", "vocab"), dtype=c.dtype,
                          param_dtype=c.param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.final_norm(x)).astype(jnp.float32)


class StagedTransformerLM(Stages):
    """`TransformerLM` as pipeline stages: an embedding stage, block stages, a head stage.

    The same decoder (RMSNorm, rotary positions, SwiGLU, causal attention) as `TransformerLM`,
    laid out as a `jaxlight.nn.Stages`: stage 0 is the token embedding, then
    `num_layers / layers_per_stage` stages of `layers_per_stage` blocks each, then the final
    norm and the output head. Under `GPipe` / `Hybrid` with a `pipe` axis of size p the
    embedding and the head run inside the pipeline on the first and last devices (with a
    `Stacked` `TransformerLM` they run outside it, replicated over `pipe`); p must divide the
    stage count `num_layers / layers_per_stage + 2`. Under every other strategy the stages
    run in order. The head is untied (`tie_embeddings=False`: the embedding and the head sit
    on different devices). Positions are 0..length−1.

    Its activations pass between devices as one buffer as wide as the widest boundary: the
    head's logits, length × vocab per example (see `Stages`), so a vocabulary much larger than
    the width makes every permute carry vocab/width times a block's activation.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> cfg = TransformerConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2,
        ...                         tie_embeddings=False)
        >>> model = StagedTransformerLM(cfg, rngs=nnx.Rngs(0))
        >>> model.num_stages, model(jnp.zeros((2, 8), jnp.int32)).shape
        (4, (2, 8, 32))
    """

    def __init__(self, config: TransformerConfig, *, layers_per_stage: int = 1,
                 rngs: nnx.Rngs):
        c = config
        if c.tie_embeddings:
            raise ConfigurationError(
                "StagedTransformerLM puts the embedding (first stage) and the output head (last "
                "stage) on different pipeline devices, so they cannot share one table: use "
                "TransformerConfig(tie_embeddings=False).")
        if (not isinstance(layers_per_stage, int) or layers_per_stage < 1
                or c.num_layers % layers_per_stage):
            divisors = [d for d in range(1, c.num_layers + 1) if c.num_layers % d == 0]
            raise ConfigurationError(
                f"StagedTransformerLM: layers_per_stage={layers_per_stage!r} does not split "
                f"num_layers={c.num_layers} into equal stages; use one of {divisors}.")
        self.config = c
        self.layers_per_stage = layers_per_stage
        stages = [_EmbedStage(c, rngs=rngs)]
        stages += [_BlocksStage(c, layers_per_stage, rngs=rngs)
                   for _ in range(c.num_layers // layers_per_stage)]
        stages.append(_HeadStage(c, rngs=rngs))
        super().__init__(stages, remat=c.remat)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits `(batch, length, vocab)` for `tokens` `(batch, length)`."""
        if tokens.ndim != 2:
            raise DataError(f"StagedTransformerLM takes tokens of shape (batch, length), got "
                            f"{tokens.shape}.")
        return super().__call__(tokens)


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
