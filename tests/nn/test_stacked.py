"""Stacked: one parameter array per weight with a leading "layers" axis, run as a scan."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlight import nn
from jaxlight.state._state import model_spec


class Block(nnx.Module):
    def __init__(self, rngs):
        self.dense = nn.Dense(4, 4, axes=("embed", "mlp"), use_bias=True, rngs=rngs)

    def __call__(self, x, scale):
        return x + scale * jnp.tanh(self.dense(x))


def loop_reference(stack, x, scale):
    kernel, bias = stack.layers.dense.kernel[...], stack.layers.dense.bias[...]
    for i in range(stack.num_layers):
        x = x + scale * jnp.tanh(x @ kernel[i] + bias[i])
    return x


@pytest.mark.parametrize(
    "remat", [False, True, "none", "full", "dots", jax.checkpoint_policies.nothing_saveable])
def test_scan_equals_python_loop_and_grads(remat):
    stack = nn.Stacked(Block, 3, rngs=nnx.Rngs(0), remat=remat)
    assert stack.layers.dense.kernel.shape == (3, 4, 4)
    kernel = np.asarray(stack.layers.dense.kernel[...])
    assert not np.allclose(kernel[0], kernel[1]), "each layer gets its own initialization"
    x = jax.random.normal(jax.random.key(1), (2, 4))
    np.testing.assert_allclose(stack(x, 0.5), loop_reference(stack, x, 0.5), rtol=1e-6)

    graphdef, params = nnx.split(stack, nnx.Param)

    def loss(p):
        return nnx.merge(graphdef, p)(x, 0.5).sum()

    def loss_ref(p):
        return loop_reference(nnx.merge(graphdef, p), x, 0.5).sum()

    got, want = jax.grad(loss)(params), jax.grad(loss_ref)(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_layers_logical_axis_reaches_the_model_spec():
    class Module:
        trainable = nnx.Param

        def configure_model(self, rngs):
            return nn.Stacked(Block, 2, rngs=rngs)

    spec = model_spec(Module(), optax.adam(1e-3), seed=0)
    axes = spec.logical_axes.params["layers"]["dense"]
    assert axes["kernel"] == ("layers", "embed", "mlp")
    assert axes["bias"] == ("layers", "mlp")
    assert spec.abstract_state.params["layers"]["dense"]["kernel"].shape == (2, 4, 4)


def test_num_layers_must_be_positive():
    with pytest.raises(ValueError, match="num_layers >= 1"):
        nn.Stacked(Block, 0, rngs=nnx.Rngs(0))


@pytest.mark.slow
def test_remat_policy_sets_what_the_backward_pass_recomputes():
    """Compiled FLOPs of a gradient: "none" < "dots" < "full" (full recomputes the matmuls)."""
    from jaxlight.analysis._flops import compiled_flops

    class MatBlock(nnx.Module):
        def __init__(self, rngs):
            self.a = nn.Dense(32, 64, axes=("embed", "mlp"), rngs=rngs)
            self.b = nn.Dense(64, 32, axes=("mlp", "embed"), rngs=rngs)

        def __call__(self, x):
            return x + self.b(jnp.tanh(self.a(x)))

    x = jnp.ones((16, 32))
    flops = {}
    for remat in ("none", "dots", "full"):
        stack = nn.Stacked(MatBlock, 4, rngs=nnx.Rngs(0), remat=remat)
        graphdef, params = nnx.split(stack, nnx.Param)
        grad = jax.jit(jax.grad(lambda p, g=graphdef: nnx.merge(g, p)(x).sum()))
        flops[remat] = compiled_flops(grad.lower(params).compile()).flops
    unit = 2 * 16 * 32 * 64  # one layer's matmul of a (16, 32) x (32, 64) product
    # Without remat: per layer 2 forward matmuls and 4 backward ones (dW and dx of each).
    assert abs(flops["none"] - 24 * unit) < 0.05 * 24 * unit, flops
    # "dots" keeps the matmul outputs: only the tanh is recomputed (elementwise, < 1 unit).
    assert 0 < flops["dots"] - flops["none"] < unit, flops
    # "full" recomputes each layer's forward; the backward pass needs `a`'s output (for
    # tanh') but not `b`'s, so one matmul per layer runs again, within an elementwise op.
    assert abs(flops["full"] - flops["none"] - 4 * unit) < 0.01 * 4 * unit, flops


def test_bad_remat_setting_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"remat='some'.*'none', 'full', 'dots'"):
        nn.Stacked(Block, 2, rngs=nnx.Rngs(0), remat="some")
    with pytest.raises(ValueError, match="remat='partial'"):
        nn.TransformerConfig(remat="partial")
