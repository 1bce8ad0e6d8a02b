"""The annotated blocks: shapes, logical axes, and the math they promise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlight import nn
from jaxlight.state._state import model_spec


def test_dense_tuple_features_and_axes():
    layer = nn.Dense(8, (2, 4), axes=("embed", "heads", "kv"), use_bias=True, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (3, 8))
    y = layer(x)
    kernel = layer.kernel[...]
    np.testing.assert_allclose(y, jnp.einsum("be,ehd->bhd", x, kernel) + layer.bias[...],
                               rtol=1e-5)
    assert layer.kernel.get_metadata()["out_sharding"] == ("embed", "heads", "kv")
    assert layer.bias.get_metadata()["out_sharding"] == ("heads", "kv")
    with pytest.raises(ValueError, match="trailing dimensions"):
        layer(jnp.ones((3, 7)))
    with pytest.raises(ValueError, match="needs 2 logical axes"):
        nn.Dense(8, 4, axes=("embed",), rngs=nnx.Rngs(0))


def test_embed_lookup_and_tied_head():
    emb = nn.Embed(16, 8, rngs=nnx.Rngs(0))
    ids = jnp.array([[1, 5, 15]])
    np.testing.assert_array_equal(emb(ids)[0, 1], emb.embedding[...][5])
    x = jnp.ones((1, 3, 8))
    np.testing.assert_allclose(emb.attend(x), x @ emb.embedding[...].T, rtol=1e-6)
    with pytest.raises(TypeError, match="integer token ids"):
        emb(jnp.ones((1, 2)))


def test_rms_norm():
    norm = nn.RMSNorm(4, rngs=nnx.Rngs(0))
    x = jnp.array([[3.0, -3.0, 3.0, -3.0]])
    np.testing.assert_allclose(norm(x), x / 3.0, rtol=1e-5)


def test_rope_scores_depend_on_relative_position_only():
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 8))
    k = jax.random.normal(jax.random.key(1), (1, 1, 1, 8))

    def score(pq, pk):
        rq = nn.apply_rope(q, jnp.array([pq]))
        rk = nn.apply_rope(k, jnp.array([pk]))
        return float(jnp.sum(rq * rk))

    assert score(3, 1) == pytest.approx(score(10, 8), rel=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)
    np.testing.assert_allclose(nn.apply_rope(q, jnp.array([0])), q, rtol=1e-6)  # angle 0
    with pytest.raises(ValueError, match="even head dimension"):
        nn.apply_rope(jnp.ones((1, 1, 1, 3)), jnp.array([0]))


def test_attention_is_causal():
    attn = nn.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, 5, 8))
    changed = x.at[:, 3:].set(7.0)
    positions = jnp.arange(5)
    forward = nnx.jit(lambda m, x: m(x, positions))
    a, b = forward(attn, x), forward(attn, changed)
    np.testing.assert_allclose(a[:, :3], b[:, :3], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[:, 3:], b[:, 3:])


def test_swiglu_mlp():
    mlp = nn.MLP(4, 6, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 3, 4))
    w = mlp.gate_up.kernel[...]
    want = (jax.nn.silu(x @ w[:, 0]) * (x @ w[:, 1])) @ mlp.down.kernel[...]
    np.testing.assert_allclose(mlp(x), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_transformer_lm_shapes_axes_and_loss():
    cfg = nn.TransformerConfig(vocab_size=32, embed_dim=16, num_layers=3, num_heads=2,
                               tie_embeddings=False)

    class Module:
        trainable = nnx.Param

        def configure_model(self, rngs):
            return nn.TransformerLM(cfg, rngs=rngs)

    # Abstract only (no arrays): shapes and logical axes come from nnx.eval_shape.
    model = nnx.eval_shape(lambda: nn.TransformerLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    logits = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state,
                            jax.ShapeDtypeStruct((2, 8), jnp.int32))
    assert logits.shape == (2, 8, 32) and logits.dtype == jnp.float32
    axes = model_spec(Module(), optax.adam(1e-3), seed=0).logical_axes.params
    block = axes["blocks"]["layers"]
    assert axes["embed"]["embedding"] == ("vocab", "embed")
    assert axes["head"]["kernel"] == ("embed", "vocab")
    assert block["attn"]["qkv"]["kernel"] == ("layers", "embed", None, "heads", "kv")
    assert block["attn"]["out"]["kernel"] == ("layers", "heads", "kv", "embed")
    assert block["mlp"]["gate_up"]["kernel"] == ("layers", "embed", None, "mlp")
    assert block["mlp"]["down"]["kernel"] == ("layers", "mlp", "embed")
    assert block["attn_norm"]["scale"] == ("layers", "norm")

    assert float(nn.lm_loss(jnp.zeros((1, 2, 4)), jnp.array([[0, 3]]))) == pytest.approx(
        np.log(4))
    masked = nn.lm_loss(jnp.zeros((1, 2, 4)), jnp.array([[0, 3]]), jnp.array([[1, 0]]))
    assert float(masked) == pytest.approx(np.log(4))


@pytest.mark.slow
def test_transformer_lm_is_causal():
    cfg = nn.TransformerConfig(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2)
    model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 32)
    other = tokens.at[:, 5:].set(0)
    forward = nnx.jit(lambda m, t: m(t))
    a, b = forward(model, tokens), forward(model, other)
    np.testing.assert_allclose(a[:, :5], b[:, :5], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 5:], b[:, 5:])


def test_config_validation():
    with pytest.raises(ValueError, match="embed_dim 10 is not divisible by num_heads 4"):
        nn.TransformerConfig(embed_dim=10, num_heads=4)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        nn.TransformerConfig(num_layers=0)


def test_attention_implementation_choice():
    from jaxlight.nn._layers import attention_implementation as pick

    assert pick("auto", "gpu", jnp.bfloat16, 128) == "cudnn"
    assert pick("auto", "cuda", jnp.float16, 64) == "cudnn"
    assert pick("auto", "gpu", jnp.float32, 128) == "xla"  # cuDNN flash: half precision only
    assert pick("auto", "gpu", jnp.bfloat16, 100) == "xla"  # not a multiple of 8
    assert pick("auto", "gpu", jnp.bfloat16, 256) == "xla"
    assert pick("auto", "cpu", jnp.bfloat16, 128) == "xla"
    assert pick("auto", "tpu", jnp.bfloat16, 128) == "xla"
    assert pick("xla", "gpu", jnp.bfloat16, 128) == "xla"
    assert pick("cudnn", "gpu", jnp.bfloat16, 128) == "cudnn"
    with pytest.raises(ValueError, match=r"compiles for 'cpu', not a CUDA GPU.*'auto'"):
        pick("cudnn", "cpu", jnp.bfloat16, 128)
    # float32 (evaluation under bf16-mixed) runs the kernel in bfloat16 (causal_attention).
    assert pick("cudnn", "gpu", jnp.float32, 128) == "cudnn"
    with pytest.raises(ValueError, match="multiple of 8, at most 128; got 256"):
        pick("cudnn", "gpu", jnp.bfloat16, 256)
    with pytest.raises(ValueError, match=r"attention='flash'.*'auto', 'xla', 'cudnn'"):
        nn.MultiHeadAttention(8, 2, attention="flash", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention='flash'"):
        nn.TransformerConfig(attention="flash")


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)])
def test_xla_attention_equals_dot_product_attention(dtype, tol):
    """The cuDNN path calls jax.nn.dot_product_attention (layout, scale, causal flag); its
    portable formulation must compute what the XLA path computes."""
    from jaxlight.nn._layers import _dot_product_attention

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, 16, 4, 8), dtype) for key in keys)
    ours = nn.causal_attention(q, k, v, "xla", scale=0.3)
    reference = _dot_product_attention(q, k, v, 0.3, "xla")
    assert ours.dtype == reference.dtype == dtype
    np.testing.assert_allclose(np.asarray(ours, np.float32), np.asarray(reference, np.float32),
                               rtol=tol, atol=tol)
    # Causal: the first query sees only the first value.
    np.testing.assert_allclose(np.asarray(ours[:, 0], np.float32),
                               np.asarray(v[:, 0], np.float32), rtol=tol, atol=tol)


@pytest.mark.slow
def test_cudnn_attention_runs_float32_inputs_in_bfloat16(monkeypatch):
    """Evaluation under bf16-mixed computes in float32: attention='cudnn' must still run (its
    kernel takes half precision), casting for the kernel and back. On the CPU the kernel is
    replaced by JAX's portable formulation of the same call; the GPU run is in
    benchmarks/gpu_paths.py (cudnn_attention)."""
    from jaxlight.nn import _layers

    seen = []

    def kernel(q, k, v, scale, implementation):
        seen.append((q.dtype, k.dtype, v.dtype, implementation))
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True)

    monkeypatch.setattr(_layers, "_dot_product_attention", kernel)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, 16, 4, 8), jnp.float32) for key in keys)
    out = nn.causal_attention(q, k, v, "cudnn", scale=0.3)
    assert seen == [(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, "cudnn")]
    assert out.dtype == jnp.float32
    reference = nn.causal_attention(q, k, v, "xla", scale=0.3)
    np.testing.assert_allclose(out, reference, atol=3e-2)


@pytest.mark.slow  # compiles attention twice; the fast tier runs attention throughout
def test_auto_attention_is_the_xla_path_on_cpu():
    cfg = dict(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2)
    tokens = jnp.arange(16).reshape(2, 8) % 32
    auto = nn.TransformerLM(nn.TransformerConfig(**cfg), rngs=nnx.Rngs(0))
    xla = nn.TransformerLM(nn.TransformerConfig(**cfg, attention="xla"), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(auto(tokens), xla(tokens))
    cudnn = nn.TransformerLM(nn.TransformerConfig(**cfg, attention="cudnn"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention='cudnn' cannot run here"):
        cudnn(tokens)  # built anywhere (a GPU run may build on the host), refused at the trace
