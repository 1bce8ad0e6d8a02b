"""Annotated layers: every weight carries logical axis names, so any rules table shards it.

Sharded shapes under tensor parallelism (`_tp` marks the `tp` mesh axis), Megatron style:

- column-parallel `Dense(("embed", "mlp"))`: `In[B, E] · W[E, F_tp] -> Out[B, F_tp]`, no
  collective forward, an all-reduce of `dIn` backward;
- row-parallel `Dense(("mlp", "embed"))`: `In[B, F_tp] · W[F_tp, E] -> Out[B, E]`, an
  all-reduce of `Out` forward;
- vocabulary-parallel `Embed(("vocab", "embed"))`: each device looks up its vocabulary rows and
  an all-reduce combines them.

Parameters are created without eager sharding: jaxlight places them from the strategy's rules
table, and the layers can be built outside any mesh (tests, notebooks, `nnx.eval_shape`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlight._errors import ConfigurationError, DataError, DataTypeError
from jaxlight.nn._collective_matmul import active_collective_matmul
from jaxlight.nn._context_attention import active_context_parallel
from jaxlight.sharding._layout import constrain

Shape = int | Sequence[int]


def _tuple(x: Shape) -> tuple[int, ...]:
    return (int(x),) if isinstance(x, int) else tuple(int(d) for d in x)


def _act(x: jax.Array, last: str) -> tuple[str | None, ...]:
    """Activation names for `(batch, length..., features)`, whatever the rank."""
    if x.ndim == 1:
        return (last,)
    return ("batch",) + ("length",) * (x.ndim - 2) + (last,)


def annotated_param(value: jax.Array, axes: Sequence[str | None]) -> nnx.Param:
    """An `nnx.Param` carrying logical axis names (one per dimension), never eagerly sharded."""
    axes = tuple(axes)
    if len(axes) != value.ndim:
        raise ConfigurationError(f"{len(axes)} logical axes {axes} for a parameter of shape "
                                 f"{value.shape}: give one name (or None) per dimension.")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class Dense(nnx.Module):
    """A linear map over the trailing feature dimensions, with logical axis names.

    `in_features` and `out_features` may be tuples (an attention projection maps `embed` to
    `(heads, kv)`): the kernel has shape `(*in_features, *out_features)` and `axes` names each
    of its dimensions.

    Args:
        in_features: size(s) of the contracted trailing input dimensions.
        out_features: size(s) of the output feature dimensions.
        axes: logical name per kernel dimension, for example `("embed", "mlp")` (column
            parallel under tensor parallelism) or `("mlp", "embed")` (row parallel).
        use_bias: add a bias named after the output axes.
        dtype: compute dtype (None: promote inputs and parameters).
        param_dtype: parameter dtype.
        kernel_init: initializer; the default is LeCun normal over the contracted dimensions.
        rngs: random streams (`rngs.params()` is used).

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> layer = Dense(8, (2, 4), axes=("embed", "heads", "kv"), rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((3, 8))).shape
        (3, 2, 4)
    """

    def __init__(
        self,
        in_features: Shape,
        out_features: Shape,
        *,
        axes: Sequence[str | None],
        use_bias: bool = False,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Any = None,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features = _tuple(in_features), _tuple(out_features)
        n_in, n_out = len(self.in_features), len(self.out_features)
        if len(axes) != n_in + n_out:
            raise ConfigurationError(
                f"Dense{self.in_features}->{self.out_features} needs {n_in + n_out} logical axes, "
                f"got {tuple(axes)}"
            )
        init = kernel_init or nnx.initializers.lecun_normal(
            in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, n_in + n_out))
        )
        shape = self.in_features + self.out_features
        self.kernel = annotated_param(init(rngs.params(), shape, param_dtype), axes)
        self.bias = (annotated_param(jnp.zeros(self.out_features, param_dtype), axes[n_in:])
                     if use_bias else None)
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        n_in = len(self.in_features)
        if x.shape[x.ndim - n_in:] != self.in_features:
            raise DataError(
                f"Dense expects trailing dimensions {self.in_features}, got input {x.shape}"
            )
        if self.dtype is not None:
            x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        overlap = active_collective_matmul()  # TensorParallel(overlap=True) is tracing the step
        axes = self.kernel.get_metadata().get("out_sharding") if overlap is not None else None
        if overlap is not None and overlap.handles(axes, n_in):
            y = overlap.dense(x, kernel, n_in, axes)
        else:
            y = jax.lax.dot_general(x, kernel, (contract, ((), ())))
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)
        return y


class Embed(nnx.Module):
    """A token embedding table `(vocab, embed)`, vocabulary-parallel under tensor parallelism.

    Args:
        num_embeddings: vocabulary size.
        features: embedding width.
        axes: logical names of the table's dimensions.
        param_dtype: parameter dtype.
        embedding_init: initializer (default: normal with standard deviation 1/sqrt(features),
            which keeps tied output logits of order one).
        rngs: random streams.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> emb = Embed(16, 8, rngs=nnx.Rngs(0))
        >>> emb(jnp.array([[1, 2]])).shape, emb.attend(jnp.ones((1, 2, 8))).shape
        ((1, 2, 8), (1, 2, 16))
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        axes: Sequence[str | None] = ("vocab", "embed"),
        param_dtype: Any = jnp.float32,
        embedding_init: Any = None,
        rngs: nnx.Rngs,
    ):
        init = embedding_init or nnx.initializers.normal(stddev=features**-0.5)
        self.embedding = annotated_param(
            init(rngs.params(), (num_embeddings, features), param_dtype), axes
        )
        self.num_embeddings, self.features = num_embeddings, features
        self.axes = tuple(axes)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """Looks up `ids` (integers of any shape); returns `ids.shape + (features,)`."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise DataTypeError(f"Embed takes integer token ids, got dtype {ids.dtype}; cast the "
                                "batch's ids to int32.")
        # Lay the table out by its vocabulary sharding only (FSDP's gather of the width happens
        # here, once): a gather from a table sharded on both axes makes XLA replicate it.
        table = constrain(self.embedding[...], (self.axes[0], None))
        return jnp.take(table, ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """The tied output head: logits `x · tableᵀ` over the vocabulary."""
        table = self.embedding[...].astype(x.dtype)
        return jnp.einsum("...e,ve->...v", x, table)


class RMSNorm(nnx.Module):
    """Root-mean-square normalization with a learned scale (computed in float32).

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> RMSNorm(4, rngs=nnx.Rngs(0))(jnp.ones((2, 4))).shape
        (2, 4)
    """

    def __init__(self, features: int, *, eps: float = 1e-6, axes: Sequence[str | None] = ("norm",),
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        del rngs  # deterministic initialization; kept for a uniform constructor
        self.scale = annotated_param(jnp.ones((features,), param_dtype), axes)
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """Rotary position embedding on `x` of shape `(..., length, heads, head_dim)`.

    The two halves of the head dimension rotate by angle `position / theta^(2i/head_dim)`.

    Args:
        x: queries or keys, `(batch, length, heads, head_dim)` with an even `head_dim`.
        positions: integer positions, `(batch, length)` or `(length,)`.
        theta: the base wavelength.

    Example:
        >>> import jax.numpy as jnp
        >>> apply_rope(jnp.ones((1, 3, 2, 4)), jnp.arange(3)).shape
        (1, 3, 2, 4)
    """
    head_dim = x.shape[-1]
    if head_dim % 2:
        raise ConfigurationError(f"rotary embedding needs an even head dimension, got {head_dim}; "
                                 "choose an even head_dim.")
    half = head_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions.astype(jnp.float32)[..., None] * freq  # (..., length, half)
    sin, cos = jnp.sin(angle)[..., None, :], jnp.cos(angle)[..., None, :]  # add the heads axis
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


#: What `MultiHeadAttention(attention=...)` accepts.
ATTENTION_IMPLEMENTATIONS = {
    "auto": "cuDNN flash attention where it applies (a CUDA GPU, bfloat16/float16 inputs, head "
            "width a multiple of 8 up to 128), else the XLA path",
    "xla": "einsum scores, float32 softmax, einsum values: the (length x length) scores are "
           "materialized; runs everywhere",
    "cudnn": "jax.nn.dot_product_attention(implementation='cudnn'): fused flash attention on "
             "NVIDIA GPUs, no (length x length) scores in memory",
}


def check_attention_name(choice: str) -> None:
    if choice not in ATTENTION_IMPLEMENTATIONS:
        raise ConfigurationError(
            f"attention={choice!r} is not an attention implementation; use one of "
            f"{', '.join(repr(k) for k in ATTENTION_IMPLEMENTATIONS)}.")


def attention_implementation(choice: str, backend: str, dtype: Any, head_dim: int) -> str:
    """The implementation ("xla" or "cudnn") that `choice` resolves to.

    Args:
        choice: "auto", "xla" or "cudnn".
        backend: the platform the step compiles for (`jax.default_backend()`).
        dtype: the dtype of queries, keys and values.
        head_dim: width per head.

    Example:
        >>> import jax.numpy as jnp
        >>> attention_implementation("auto", "gpu", jnp.bfloat16, 128)
        'cudnn'
        >>> attention_implementation("auto", "cpu", jnp.bfloat16, 128)
        'xla'
        >>> attention_implementation("auto", "gpu", jnp.float32, 128)
        'xla'
    """
    check_attention_name(choice)
    fits_width = head_dim % 8 == 0 and head_dim <= 128
    fits_cudnn = (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
                  and fits_width)
    if choice == "cudnn":
        # float32 inputs (evaluation under bf16-mixed computes in float32) are cast to bfloat16
        # for the kernel by `causal_attention`: "cudnn" insists on the kernel, not the dtype.
        problems = []
        if backend not in ("gpu", "cuda"):
            problems.append(f"the step compiles for {backend!r}, not a CUDA GPU")
        if not fits_width:
            problems.append(f"cuDNN flash attention needs a head width that is a multiple of "
                            f"8, at most 128; got {head_dim}")
        if problems:
            raise ConfigurationError(
                f"attention='cudnn' cannot run here: {'; '.join(problems)}. Use "
                "attention='auto' (cuDNN where it applies, XLA elsewhere) or 'xla'"
                " (for float32 on a GPU, train with precision='bf16-mixed').")
        return "cudnn"
    if choice == "auto" and backend in ("gpu", "cuda") and fits_cudnn:
        return "cudnn"
    return "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, implementation: str = "xla",
                     scale: float | None = None) -> jax.Array:
    """Causal softmax attention of `q`, `k`, `v` `(..., length, heads, head_dim)`.

    "xla" computes the scores in the inputs' dtype, the softmax in float32 and the output in
    the inputs' dtype; "cudnn" is `jax.nn.dot_product_attention`'s fused kernel (the same
    function, computed blockwise) in half precision: float32 inputs are cast to bfloat16 for
    it and its output back to float32.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if implementation == "cudnn":
        dtype = q.dtype
        if dtype not in (jnp.bfloat16, jnp.float16):  # the kernel is half precision only
            q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
        return _dot_product_attention(q, k, v, scale, "cudnn").astype(dtype)
    length = q.shape[-3]
    scores = jnp.einsum("...qhd,...khd->...hqk", q, k).astype(jnp.float32) * scale
    causal = jnp.tril(jnp.ones((length, length), bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", probs, v)


def _dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float,
                           implementation: str) -> jax.Array:
    """`jax.nn.dot_product_attention` as the "cudnn" path calls it; tests run it with
    `implementation="xla"` (JAX's portable formulation) against our XLA path."""
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                        implementation=implementation)


class MultiHeadAttention(nnx.Module):
    """Causal multi-head self-attention with rotary positions.

    Under a `context` mesh axis (`Hybrid({"context": n})`) the sequence is split over devices
    and the attention core runs as ring or all-gather attention
    (`jaxlight.nn._context_attention`); rotary positions are applied before it, on the global
    positions of each shard.

    Query, key and value come from one fused column-parallel projection
    (`("embed", None, "heads", "kv")`, the `None` axis picks q, k or v) and the output
    projection is row-parallel (`("heads", "kv", "embed")`): under tensor parallelism each device
    owns whole heads, one all-reduce follows the output projection, and one (of the summed q, k
    and v input gradients) precedes the projection in the backward pass.

    Args:
        features: model width.
        num_heads: attention heads.
        head_dim: width per head (default `features // num_heads`).
        rope_theta: rotary base wavelength.
        dtype: compute dtype (None: promote).
        param_dtype: parameter dtype.
        attention: "auto" (cuDNN flash attention on a CUDA GPU in bfloat16, else XLA), "xla"
            or "cudnn"; see `ATTENTION_IMPLEMENTATIONS`.
        rngs: random streams.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> attn = MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
        >>> attn(jnp.ones((1, 5, 8)), jnp.arange(5)).shape
        (1, 5, 8)
    """

    def __init__(self, features: int, num_heads: int, *, head_dim: int | None = None,
                 rope_theta: float = 10_000.0, dtype: Any = None,
                 param_dtype: Any = jnp.float32, attention: str = "auto", rngs: nnx.Rngs):
        head_dim = head_dim or features // num_heads
        check_attention_name(attention)
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv = Dense(features, (3, num_heads, head_dim), axes=("embed", None, "heads", "kv"),
                         kernel_init=nnx.initializers.lecun_normal(in_axis=0, out_axis=(2, 3)),
                         **kw)
        self.out = Dense((num_heads, head_dim), features, axes=("heads", "kv", "embed"), **kw)
        self.num_heads, self.head_dim, self.rope_theta = num_heads, head_dim, rope_theta
        self.attention = attention

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        heads = ("batch", "length", "activation_heads", "activation_kv")[-(x.ndim + 1):]
        qkv = self.qkv(x)
        q = constrain(apply_rope(qkv[..., 0, :, :], positions, self.rope_theta), heads)
        k = constrain(apply_rope(qkv[..., 1, :, :], positions, self.rope_theta), heads)
        v = constrain(qkv[..., 2, :, :], heads)
        context = active_context_parallel()
        if context is not None and q.ndim == 4:  # the sequence is split over `context`
            out = constrain(context.attention(q, k, v, self.head_dim**-0.5), heads)
        else:
            impl = attention_implementation(self.attention, jax.default_backend(), q.dtype,
                                            self.head_dim)
            out = constrain(causal_attention(q, k, v, impl, self.head_dim**-0.5), heads)
        y = self.out(out)
        return constrain(y, _act(y, "activation_embed"))


class MLP(nnx.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`.

    `gate` and `up` are one fused column-parallel kernel (`("embed", None, "mlp")`), `down` is
    row-parallel (`("mlp", "embed")`): under tensor parallelism one all-reduce forward (after
    `down`) and one backward (of the input gradient).

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> MLP(8, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 3, 8))).shape
        (1, 3, 8)
    """

    def __init__(self, features: int, hidden: int, *, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_up = Dense(features, (2, hidden), axes=("embed", None, "mlp"),
                             kernel_init=nnx.initializers.lecun_normal(in_axis=0, out_axis=2),
                             **kw)
        self.down = Dense(hidden, features, axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up = self.gate_up(x)
        gate, up = gate_up[..., 0, :], gate_up[..., 1, :]
        h = constrain(nnx.silu(gate), _act(gate, "activation_mlp")) * constrain(
            up, _act(up, "activation_mlp"))
        y = self.down(h)
        return constrain(y, _act(y, "activation_embed"))
