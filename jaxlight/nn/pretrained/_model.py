"""`DecoderLM`: the Llama 3 / Qwen 2-3 / Mistral / Gemma 3 decoder as one Flax NNX model.

One set of switches (`DecoderConfig`) covers the families: grouped-query attention with
optional q/k/v biases (Qwen 2), per-head QK-norm (Qwen 3, Gemma 3), Gemma's `1 + w` norms,
four norms per layer, scaled embeddings, `query_pre_attn_scalar`, sliding-window layers
interleaved with global ones and a RoPE table per layer type, tanh-GELU.

Every weight carries logical axes (`embed`, `heads`, `kv`, `mlp`, `vocab`, `norm`, and `layers`
on the stacked layer axis), so every jaxlight strategy shards it; the layers are one `Stacked`
module run as a scan (with `remat` as `TransformerLM` has it). Per-layer differences (window,
RoPE table) are scanned inputs, so one layer body compiles whatever the depth.

The same layers run with a key/value cache (`DecoderLM.step`): caches are `(layers, batch,
cache_length, kv_heads, head_dim)` arrays scanned with the layers; the queries' cache slots
and the keys' validity (left padding) make the mask.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlight._errors import ConfigurationError, DataError, DataTypeError
from jaxlight.nn._layers import Dense, Embed, annotated_param
from jaxlight.nn._moe import MoE
from jaxlight.nn._scan import LAYERS, remat_policy
from jaxlight.nn._stacked import Stacked
from jaxlight.nn.pretrained._config import DecoderConfig
from jaxlight.nn.pretrained._moe_layers import balance_loss, run_mixed
from jaxlight.sharding._layout import constrain

_HEADS = ("batch", "length", "activation_heads", "activation_kv")


class Norm(nnx.Module):
    """RMSNorm computed in float32, scaled by `w` (Llama, Qwen) or `1 + w` (Gemma)."""

    def __init__(self, features: int, *, eps: float, offset: float, param_dtype: Any):
        init = jnp.zeros if offset else jnp.ones
        self.weight = annotated_param(init((features,), param_dtype), ("norm",))
        self.eps, self.offset = eps, offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.weight[...].astype(jnp.float32)
        if self.offset:
            return (y * (self.offset + w)).astype(x.dtype)
        # Llama casts back before scaling; the same in float32, a rounding apart in bf16.
        return w.astype(x.dtype) * y.astype(x.dtype)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """RoPE on `x` `(batch, length, heads, head_dim)` with `cos`/`sin` `(batch, length, half)`
    (the two halves of each head rotate together, as in Hugging Face's `rotate_half`)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Context(NamedTuple):
    """What every layer sees besides the activations (broadcast into the scan)."""

    cos: jax.Array  # (ropes, batch, length, half)
    sin: jax.Array
    query_slots: jax.Array  # (length,) cache slot of each query
    key_slots: jax.Array  # (keys,) cache slot of each key
    key_valid: jax.Array  # (batch, keys) bool: a real token (not padding, not yet written)


class Attention(nnx.Module):
    """Grouped-query attention with optional biases and per-head QK-norm."""

    def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        e, h, k, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = Dense(e, (h, d), axes=("embed", "heads", "kv"), use_bias=c.qkv_bias, **kw)
        # With kv_repeat the k/v projections keep the checkpoint's heads, unsharded, and their
        # outputs are repeated: tensor parallelism splits the repeated heads (and the cache).
        kv_axes = ("embed", None, "kv") if c.kv_repeat > 1 else ("embed", "heads", "kv")
        self.k_proj = Dense(e, (k, d), axes=kv_axes, use_bias=c.qkv_bias, **kw)
        self.v_proj = Dense(e, (k, d), axes=kv_axes, use_bias=c.qkv_bias, **kw)
        self.o_proj = Dense((h, d), e, axes=("heads", "kv", "embed"), use_bias=c.o_bias, **kw)
        norm = dict(eps=c.norm_eps, offset=c.norm_offset, param_dtype=c.param_dtype)
        self.q_norm = Norm(d, **norm) if c.qk_norm else None
        self.k_norm = Norm(d, **norm) if c.qk_norm else None
        self.groups, self.scale, self.repeat = h // (k * c.kv_repeat), c.attn_scale, c.kv_repeat

    def __call__(self, x, ctx: Context, window, rope, cache=None):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.cos[rope], ctx.sin[rope]
        k = rotate(k, cos, sin)
        if self.repeat > 1:  # one gradient per checkpoint head: the copies' gradients add up
            k, v = jnp.repeat(k, self.repeat, axis=2), jnp.repeat(v, self.repeat, axis=2)
        q = constrain(rotate(q, cos, sin), _HEADS)
        k = constrain(k, _HEADS)
        v = constrain(v, _HEADS)
        if cache is not None:
            start = ctx.query_slots[0]
            k_all = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype),
                                                        start, 1)
            v_all = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype),
                                                        start, 1)
            cache = (k_all, v_all)
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
        b, t, h, d = q.shape
        q = q.reshape(b, t, h // self.groups, self.groups, d)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) * self.scale
        qs, ks = ctx.query_slots[:, None], ctx.key_slots[None, :]
        allowed = (ks <= qs) & ((window == 0) | (qs - ks < window))
        allowed = allowed[None] & ctx.key_valid[:, None, :]  # (batch, queries, keys)
        scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)
        y = self.o_proj(constrain(out, _HEADS))
        return constrain(y, ("batch", "length", "activation_embed")), cache


class GatedMLP(nnx.Module):
    """`down(act(gate(x)) * up(x))`: SwiGLU (Llama, Qwen) or tanh-GeGLU (Gemma)."""

    def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs, use_bias=c.mlp_bias)
        e, f = c.hidden_size, c.intermediate_size
        self.gate_proj = Dense(e, f, axes=("embed", "mlp"), **kw)
        self.up_proj = Dense(e, f, axes=("embed", "mlp"), **kw)
        self.down_proj = Dense(f, e, axes=("mlp", "embed"), **kw)
        self.activation = c.activation

    def __call__(self, x):
        gate = self.gate_proj(x)
        act = jax.nn.silu(gate) if self.activation == "silu" else jax.nn.gelu(gate,
                                                                               approximate=True)
        h = constrain(act * self.up_proj(x), ("batch", "length", "activation_mlp"))
        return constrain(self.down_proj(h), ("batch", "length", "activation_embed"))


class DecoderLayer(nnx.Module):
    """Pre-norm residual layer; with `sandwich_norms` (Gemma 3) the branch outputs are normed
    again before each residual add."""

    def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs, sparse: bool | None = None):
        sparse = bool(c.num_experts) if sparse is None else sparse
        norm = dict(eps=c.norm_eps, offset=c.norm_offset, param_dtype=c.param_dtype)
        self.input_layernorm = Norm(c.hidden_size, **norm)
        self.self_attn = Attention(c, rngs=rngs)
        self.post_attention_layernorm = Norm(c.hidden_size, **norm)
        self.pre_feedforward_layernorm = Norm(c.hidden_size, **norm) if c.sandwich_norms else None
        self.post_feedforward_layernorm = (Norm(c.hidden_size, **norm) if c.sandwich_norms
                                           else None)
        self.mlp = GatedMLP(c, rngs=rngs) if not sparse else MoE(
            c.hidden_size, c.expert_size, num_experts=c.num_experts,
            experts_per_token=c.experts_per_token, router=c.router, renormalize=c.renormalize,
            capacity_factor=c.capacity_factor, dtype=c.dtype, param_dtype=c.param_dtype,
            rngs=rngs)
        self.sparse, self.num_experts = sparse, c.num_experts

    def _mlp(self, x, mask):
        if not self.sparse:
            return self.mlp(x), None
        return self.mlp(x, mask)

    def __call__(self, x, ctx: Context, window, rope, cache=None, stats: bool = False):
        """`(x, cache)`; with `stats`, `(x, cache, (load, importance))`: the MoE router's
        tokens and mean probability per expert over the real tokens (zeros in a dense layer)."""
        h, cache = self.self_attn(self.input_layernorm(x), ctx, window, rope, cache)
        mask = ctx.key_valid if stats else None  # the forward pass: keys are the queries
        if self.pre_feedforward_layernorm is not None:
            x = x + self.post_attention_layernorm(h)
            y, routed = self._mlp(self.pre_feedforward_layernorm(x), mask)
            x = x + self.post_feedforward_layernorm(y)
        else:
            x = x + h
            y, routed = self._mlp(self.post_attention_layernorm(x), mask)
            x = x + y
        x = constrain(x, ("batch", "length", "activation_embed"))
        if not stats:
            return x, cache
        zero = jnp.zeros((self.num_experts,), jnp.float32)
        return x, cache, ((zero, zero) if routed is None
                          else (routed["load"], routed["importance"]))


class DecoderLM(nnx.Module):
    """A pretrained-family decoder returning float32 logits `(batch, length, vocab)`.

    Build it from a config (random weights) or load it with `jaxlight.nn.from_pretrained`.

    Args:
        config: the family and shape (`from_hf_config` reads one from config.json).
        rngs: random streams.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from jaxlight.nn.pretrained import from_hf_config
        >>> cfg = from_hf_config({"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16,
        ...     "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...     "num_key_value_heads": 2, "head_dim": 8})
        >>> DecoderLM(cfg, rngs=nnx.Rngs(0))(jnp.zeros((2, 5), jnp.int32)).shape
        (2, 5, 32)
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, param_dtype=c.param_dtype,
                                  rngs=rngs)
        kinds = c.layer_kinds
        # An MoE model with dense MLP layers keeps one stack per kind (`_moe_layers`).
        mixed = any(kinds) and not all(kinds)
        self.layers = Stacked(lambda r: DecoderLayer(c, rngs=r),
                              sum(kinds) if mixed else c.num_layers, rngs=rngs, remat=c.remat)
        self.dense_layers = Stacked(
            lambda r: DecoderLayer(c, rngs=r, sparse=False), len(kinds) - sum(kinds),
            rngs=rngs, remat=c.remat) if mixed else None
        self.norm = Norm(c.hidden_size, eps=c.norm_eps, offset=c.norm_offset,
                         param_dtype=c.param_dtype)
        self.lm_head = None if c.tie_embeddings else Dense(
            c.hidden_size, c.vocab_size, axes=("embed", "vocab"), dtype=c.dtype,
            param_dtype=c.param_dtype, rngs=rngs)

    # -- pieces shared by the training forward and the cached step --------------------------

    def _embed(self, tokens: jax.Array) -> jax.Array:
        if tokens.ndim != 2:
            raise DataError(f"DecoderLM takes tokens of shape (batch, length), got {tokens.shape}.")
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise DataTypeError(f"DecoderLM takes integer token ids, got {tokens.dtype}.")
        x = self.embed_tokens(tokens)
        dtype = self.config.dtype or x.dtype
        if self.config.embed_scale is not None:
            # Gemma scales by sqrt(hidden) rounded to the weights' dtype, as transformers does.
            x = x * jnp.asarray(self.config.embed_scale, self.embed_tokens.embedding.dtype)
        return constrain(x.astype(dtype), ("batch", "length", "activation_embed"))

    def _tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        inv = jnp.asarray(np.stack([r.inv_freq(c.head_dim) for r in c.ropes]))  # (ropes, half)
        angle = positions.astype(jnp.float32)[None, ..., None] * inv[:, None, None, :]
        return jnp.cos(angle), jnp.sin(angle)

    def _head(self, x: jax.Array) -> jax.Array:
        x = self.norm(x)
        logits = self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)
        logits = logits.astype(jnp.float32)
        cap = self.config.final_logit_softcap
        if cap:
            logits = jnp.tanh(logits / cap) * cap
        return constrain(logits, ("batch", "length", "activation_vocab"))

    def _layer_inputs(self) -> tuple[jax.Array, jax.Array]:
        c = self.config
        return (jnp.asarray(c.layer_window, jnp.int32), jnp.asarray(c.layer_rope, jnp.int32))

    # -- the forward pass ----------------------------------------------------------------------

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, *, return_aux: bool = False) -> Any:
        """Logits for `tokens` `(batch, length)`; with `return_aux` (an MoE model),
        `(logits, aux)`: `aux["aux_loss"]` is transformers' load-balancing loss over the MoE
        layers and the real tokens, `aux["loss"]` that times `config.aux_loss_weight` (config.json's
        `router_aux_loss_coef` where `output_router_logits` asks for it, else 0), to add to the
        LM loss, and `aux["load"]` the tokens each expert got, summed over layers.

        Args:
            tokens: integer token ids.
            positions: RoPE positions `(batch, length)`; default `0..length-1` (with an
                `attention_mask`, the count of real tokens before each one, as transformers'
                `generate` numbers left-padded rows).
            attention_mask: `(batch, length)`, 1 for real tokens, 0 for padding keys.
        """
        b, t = tokens.shape
        check_positions(self.config, t, "DecoderLM's forward pass got",
                        "cut the sequences (or their prompts) to fit")
        valid = (jnp.ones((b, t), bool) if attention_mask is None
                 else attention_mask.astype(bool))
        if positions is None:
            positions = padded_positions(valid)
        cos, sin = self._tables(positions)
        slots = jnp.arange(t, dtype=jnp.int32)
        ctx = Context(cos, sin, slots, slots, valid)
        x = self._embed(tokens)
        windows, ropes = self._layer_inputs()
        rematerialize, policy = remat_policy(self.config.remat)

        c = self.config
        if return_aux and not c.num_experts:
            raise ConfigurationError(
                f"DecoderLM(..., return_aux=True): this {c.model_type} model has no mixture-of-"
                "experts layers, so no router loss; call it without return_aux.")

        def body(layer, x, window, rope):
            if return_aux:
                x, _, routed = layer(x, ctx, window, rope, stats=True)
                return x, routed
            return layer(x, ctx, window, rope)[0]

        if rematerialize:
            body = nnx.remat(body, policy=policy)

        @nnx.scan(in_axes=(0, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0) if return_aux
                  else nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYERS})
        def run(layer, x, window, rope):
            return body(layer, x, window, rope)

        routed = None
        if self.dense_layers is not None:
            zeros = jnp.zeros((c.num_layers, c.num_experts), jnp.float32)
            x, routed = run_mixed(
                self._stacks(), c.layer_kinds, x, (windows, ropes),
                (zeros, zeros) if return_aux else (),
                body if return_aux else lambda *args: (body(*args), ()))
        elif return_aux:
            x, routed = run(self.layers.layers, x, windows, ropes)
        else:
            x = run(self.layers.layers, x, windows, ropes)
        if not return_aux:
            return self._head(x)
        return self._head(x), balance_loss(c, *routed, valid)

    def _stacks(self) -> dict[bool, nnx.Module]:
        return {True: self.layers.layers, False: self.dense_layers.layers}

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> tuple[jax.Array, jax.Array]:
        """Zeroed key and value caches `(layers, batch, length, kv_heads * kv_repeat,
        head_dim)`."""
        c = self.config
        dtype = dtype or c.dtype or c.param_dtype
        shape = (c.num_layers, batch, length, c.num_kv_heads * c.kv_repeat, c.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    def step(self, tokens: jax.Array, positions: jax.Array, start: jax.Array,
             cache: tuple[jax.Array, jax.Array], key_valid: jax.Array
             ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Runs `tokens` `(batch, t)` written at cache slots `start..start+t-1`.

        Args:
            tokens: the new tokens (the prompt at prefill, one token per decode step).
            positions: their RoPE positions `(batch, t)`.
            start: the cache slot of the first new token (an int32 scalar, the same for every
                row: prompts are left-padded).
            cache: key and value caches from `init_cache`.
            key_valid: `(batch, cache_length)`: which slots hold real tokens once these are
                written (padding slots False).

        Returns:
            float32 logits `(batch, t, vocab)` and the updated caches.
        """
        t = tokens.shape[1]
        cos, sin = self._tables(positions)
        ctx = Context(cos, sin, start + jnp.arange(t, dtype=jnp.int32),
                      jnp.arange(cache[0].shape[2], dtype=jnp.int32), key_valid)
        x = self._embed(tokens)
        windows, ropes = self._layer_inputs()

        @nnx.scan(in_axes=(0, nnx.Carry, 0, 0, 0, 0), out_axes=(nnx.Carry, 0, 0),
                  transform_metadata={nnx.PARTITION_NAME: LAYERS})
        def run(layer, x, window, rope, k, v):
            x, (k, v) = layer(x, ctx, window, rope, (k, v))
            return x, k, v

        if self.dense_layers is not None:
            x, (k, v) = run_mixed(self._stacks(), self.config.layer_kinds, x,
                                  (windows, ropes, *cache), cache,
                                  lambda layer, x, window, rope, k, v: layer(
                                      x, ctx, window, rope, (k, v)))
        else:
            x, k, v = run(self.layers.layers, x, windows, ropes, cache[0], cache[1])
        return self._head(x), (k, v)


def max_positions(config: DecoderConfig) -> int | None:
    """The positions the model was trained for (config.json's `max_position_embeddings`)."""
    n = (config.hf_config or {}).get("max_position_embeddings")
    return int(n) if n else None


def check_positions(config: DecoderConfig, length: int, what: str, fix: str) -> None:
    """Refuses `length` tokens beyond the model's positions: RoPE has no table past them (the
    model was never trained there) and nothing else would say so."""
    limit = max_positions(config)
    if limit is not None and length > limit:
        raise DataError(
            f"{what} {length} tokens but the model has {limit} positions "
            f"(max_position_embeddings in config.json): {fix}.")


def padded_positions(valid: jax.Array) -> jax.Array:
    """RoPE positions of left-padded rows: real tokens count from 0 (padding gets 1, unused)."""
    positions = jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1
    return jnp.where(valid, positions, 1)
