"""jaxlight.nn.MoE: routing, the grouped (ragged_dot) experts against a dense reference, the
capacity path, the auxiliary losses and bias, and the expert-parallel dispatch against one
device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

from jaxlight import strategies
from jaxlight._errors import ConfigurationError, ShardingError
from jaxlight.nn import MoE, MoEConfig
from jaxlight.nn._moe_dispatch import moe_experts
from jaxlight.nn._moe_routing import balance_bias_update, capacity, route
from jaxlight.sharding._layout import spmd_context
from jaxlight.strategies._rules import DEFAULT_RULES, parse_mesh_shape

E, D, F, K = 8, 16, 12, 2

#: Compiled once per shape: eager dispatch of the sort/scatter ops is the slow part on CPU
#: (each eager op is an XLA compile of its own; the file made ~360 of them before these).
experts = jax.jit(moe_experts, static_argnames=("capacity_rows",))
#: `route` as a layer calls it, in one compiled program per (shape, option).
route_jit = jax.jit(route, static_argnums=(1,),
                    static_argnames=("router", "renormalize", "capacity_factor"))


@jax.jit
def _dense_reference(x, routing, gate, up, down):
    """Every expert on every token, then the chosen ones weighted: the definition."""
    h = jax.nn.silu(jnp.einsum("bld,edf->blef", x, gate)) * jnp.einsum("bld,edf->blef", x, up)
    every = jnp.einsum("blef,efd->bled", h, down)
    chosen = jnp.take_along_axis(every, routing.experts[..., None], axis=2)
    return jnp.sum(chosen * routing.weights[..., None], axis=2)


def _normal(rng, shape, scale=1.0):
    """Standard normal float32 draws from numpy: jax.random's programs cost a compile each."""
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _arrays(seed=0, b=8, length=6):
    rng = np.random.default_rng(seed)
    x = _normal(rng, (b, length, D))
    gate, up = _normal(rng, (E, D, F), 0.2), _normal(rng, (E, D, F), 0.2)
    down = _normal(rng, (E, F, D), 0.2)
    logits = _normal(rng, (b, length, E))
    return x, gate, up, down, logits


@pytest.mark.parametrize("router", ["softmax_topk", "topk_softmax", "sigmoid"])
def test_grouped_experts_equal_dense_reference(router):
    x, gate, up, down, logits = _arrays()
    r = route_jit(logits, K, router=router)
    out = experts(x, r.experts, r.weights, r.kept, gate, up, down)
    np.testing.assert_allclose(out, _dense_reference(x, r, gate, up, down), atol=2e-6)


@jax.jit
def _four_routings(logits, bias):
    """Qwen's, Mixtral's, the raw softmax top-k and the biased sigmoid routing of `logits`, and
    the top k softmax probabilities, in one compiled program."""
    top = jnp.sort(jax.nn.softmax(logits, -1), -1)[..., ::-1][..., :K]
    return (route(logits, K, router="softmax_topk", renormalize=True),
            route(logits, K, router="topk_softmax"),
            route(logits, K, router="softmax_topk", renormalize=False),
            route(logits, K, router="sigmoid", bias=bias), top)


def test_routers():
    logits = _normal(np.random.default_rng(3), (2, 5, E))
    # the bias chooses, never weighs: a large bias on expert 5 makes every token pick it
    bias = np.zeros(E, np.float32)
    bias[5] = 10.0
    qwen, mixtral, raw, biased, top = _four_routings(logits, bias)
    np.testing.assert_array_equal(qwen.experts, mixtral.experts)
    np.testing.assert_allclose(qwen.weights, mixtral.weights, rtol=1e-6)
    np.testing.assert_allclose(raw.weights, top, rtol=1e-6)
    assert float(raw.weights.sum(-1).max()) < 1.0
    assert np.all(np.any(np.asarray(biased.experts) == 5, axis=-1))
    assert float(biased.weights.max()) < 1.0


def test_aux_losses_follow_their_formulas():
    logits = _normal(np.random.default_rng(4), (3, 7, E))
    r = route_jit(logits, K)
    probs = np.asarray(jax.nn.softmax(logits, -1)).reshape(-1, E)
    counts = np.zeros(E)
    for row in np.asarray(r.experts).reshape(-1, K):
        counts[row] += 1
    expected = E * np.sum(counts / probs.shape[0] * probs.mean(0))
    np.testing.assert_allclose(r.stats["aux_loss"], expected, rtol=1e-5)
    np.testing.assert_allclose(r.stats["load"], counts)
    lse = np.log(np.exp(np.asarray(logits)).sum(-1))
    np.testing.assert_allclose(r.stats["z_loss"], np.mean(lse**2), rtol=1e-5)


def test_capacity_drops_and_counts():
    x, gate, up, down, logits = _arrays(b=2, length=16)
    # capacity factor >= E/k: every expert can take a whole example, nothing drops (roomy)
    dropless, roomy, tight = jax.jit(lambda logits: (
        route(logits, K), route(logits, K, capacity_factor=E / K),
        route(logits, K, capacity_factor=0.5)))(logits)
    assert float(roomy.stats["dropped_fraction"]) == 0.0
    np.testing.assert_array_equal(
        experts(x, roomy.experts, roomy.weights, roomy.kept, gate, up, down),
        experts(x, dropless.experts, dropless.weights, dropless.kept, gate, up, down))
    cap = capacity(16, E, K, 0.5)
    kept = np.asarray(tight.kept)
    for b in range(2):
        per_expert = np.bincount(np.asarray(tight.experts)[b][kept[b]], minlength=E)
        assert per_expert.max() <= cap
    assert float(tight.stats["dropped_fraction"]) == pytest.approx(1 - kept.mean())
    assert float(tight.stats["dropped_fraction"]) > 0
    out = experts(x, tight.experts, tight.weights, tight.kept, gate, up, down)
    np.testing.assert_allclose(out, _dense_reference(x, tight, gate, up, down), atol=2e-6)


def _moe(**kw) -> MoE:
    """A MoE layer initialized in one compiled program (eagerly, each initializer's shape was a
    compile of its own); the values are the eager initialization's."""
    return nnx.jit(lambda: MoE(D, F, num_experts=E, experts_per_token=K, rngs=nnx.Rngs(0),
                               **kw))()


def test_bias_update_moves_toward_even_load():
    assert balance_bias_update(jnp.zeros(3), jnp.array([1.0, 2.0, 3.0]), 0.5).tolist() == [
        0.5, 0.0, -0.5]
    moe = _moe(bias_update_rate=0.1)
    x = _normal(np.random.default_rng(1), (2, 6, D))
    call = nnx.jit(lambda moe, x: moe(x))
    _, stats = call(moe, x)
    load = np.asarray(stats["load"])
    np.testing.assert_allclose(moe.router_bias[...], 0.1 * np.sign(load.mean() - load))
    moe.eval()  # no update while deterministic
    before = np.asarray(moe.router_bias[...])
    call(moe, x)
    np.testing.assert_array_equal(moe.router_bias[...], before)


def _mesh(shape):
    names = [a for a in ("data", "fsdp", "expert", "tp") if a in shape]
    n = int(np.prod([shape[a] for a in names]))
    grid = np.array(jax.devices()[:n]).reshape([shape[a] for a in names])
    return Mesh(grid, tuple(names), axis_types=(AxisType.Auto,) * len(names))


@pytest.mark.parametrize("shape, capacity_factor", [
    # The fast tier keeps one layout (three axes, capacity); tests/nn/pretrained/
    # test_moe_parity.py's fast cases run the dropless dispatch under data2_expert4 and
    # fsdp2_expert2_tp2 against transformers.
    ({"fsdp": 2, "expert": 2, "tp": 2}, 1.0),
    pytest.param({"expert": 4}, None, marks=pytest.mark.slow),
    pytest.param({"expert": 4}, 1.0, marks=pytest.mark.slow),
    pytest.param({"fsdp": 2, "expert": 2, "tp": 2}, None, marks=pytest.mark.slow),
])
def test_expert_parallel_dispatch_equals_one_device(shape, capacity_factor):
    x, gate, up, down, logits = _arrays()
    cap = None if capacity_factor is None else capacity(6, E, K, capacity_factor)

    def loss(x, gate, up, down):
        r = route(logits, K, capacity_factor=capacity_factor)
        y = moe_experts(x, r.experts, r.weights, r.kept, gate, up, down, capacity_rows=cap)
        return jnp.sum(y**2), y

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, ref), ref_grads = jax.jit(grad)(x, gate, up, down)  # no mesh: one device
    with spmd_context(_mesh(shape), DEFAULT_RULES):
        lowered = jax.jit(grad).lower(x, gate, up, down)
        text = lowered.as_text()
        (_, out), grads = lowered.compile()(x, gate, up, down)
    assert "all_to_all" in text
    np.testing.assert_allclose(out, ref, atol=1e-6)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_experts_not_divisible_by_expert_axis():
    x, gate, up, down, logits = _arrays()
    r = route_jit(logits, K)
    gate6, up6 = gate[:6], up[:6]
    with spmd_context(_mesh({"expert": 4}), DEFAULT_RULES), pytest.raises(
            ShardingError, match=r"6 experts .* total size 4 .*divides 6 \(\[1, 2, 3, 6\]\)"):
        moe_experts(x, r.experts % 6, r.weights, r.kept, gate6, up6, down[:6])


def test_config_errors_name_the_fix():
    with pytest.raises(ConfigurationError, match="experts_per_token=9 must be an int from 1 to"):
        MoEConfig(num_experts=8, experts_per_token=9)
    with pytest.raises(ConfigurationError, match="router='top2'.*'softmax_topk'"):
        MoEConfig(router="top2")
    with pytest.raises(ConfigurationError, match="capacity_factor=0 .*4 = E/k drops nothing"):
        MoEConfig(num_experts=8, experts_per_token=2, capacity_factor=0)


def test_mesh_shape_grammar_takes_expert():
    assert parse_mesh_shape("data=2,expert=4") == {"data": 2, "expert": 4}
    assert parse_mesh_shape([[2, 2, 2], ["fsdp", "expert", "tp"]]) == {
        "fsdp": 2, "expert": 2, "tp": 2}
    strategy = strategies.Hybrid({"data": 2, "expert": 4})
    strategy.setup()
    assert dict(strategy.mesh.shape) == {"data": 2, "expert": 4}
    assert strategy.data_parallel_size == 8  # tokens split over data and expert


def test_shared_expert_adds_a_dense_swiglu():
    moe = _moe(shared_expert_dim=8)
    x = _normal(np.random.default_rng(2), (2, 6, D))
    # the layer, its router's logits and its shared expert alone, in one compiled program
    (y, _), logits, shared = nnx.jit(lambda moe, x: (moe(x), moe.router(x), moe.shared(x)))(
        moe, x)
    r = route_jit(logits, K)
    routed = _dense_reference(x, r, moe.gate[...], moe.up[...], moe.down[...])
    np.testing.assert_allclose(y, routed + shared, atol=2e-5)
    assert moe.shared.gate_up.kernel.shape == (D, 2, 8)
