"""LoRA on a mixture-of-experts layer's experts (`jaxlight.nn.add_expert_lora`): zero B is the
base model, a random B is the merged per-expert weights `W + A·B · alpha/r` on both compute
paths and under expert parallelism, adapters-only training equals one device, checkpoints hold
only the adapters, and `save_pretrained` writes the merged experts."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from jaxlight._errors import ConfigurationError
from jaxlight.nn import EXPERT_TARGETS, MoE, add_expert_lora
from jaxlight.nn._moe_dispatch import moe_experts
from jaxlight.nn._moe_routing import capacity, route
from jaxlight.nn.pretrained import _safetensors as st
from jaxlight.nn.pretrained import from_pretrained, save_pretrained
from jaxlight.recipes._chat_sft import ChatFineTuner, parse_targets
from jaxlight.sharding._layout import spmd_context
from jaxlight.strategies._rules import DEFAULT_RULES
from tests.nn.pretrained.test_parity import fixture, logits_of
from tests.nn.test_moe import _dense_reference, _mesh, _normal, route_jit
from tests.strategies.lm import token_batches
from tests.strategies.moe_lm import TinyMoELM
from tests.strategies.test_equivalence import LossRecorder, assert_params_close, train

E, D, F, K, R = 8, 16, 12, 2, 4
WEIGHTS = ("gate", "up", "down")


def _random_b(lora, rng: np.random.Generator, scale=0.3) -> None:
    """B drawn at random (it starts at zero): the adapters then change the layer."""
    for name in lora.weights:
        b = getattr(lora, f"{name}_b")
        b[...] = jnp.asarray(rng.standard_normal(b.shape) * scale, b.dtype)


def _merged(moe) -> tuple[np.ndarray, ...]:
    """gate, up, down with the adapters merged, per expert, eagerly in float64 numpy."""
    out = []
    for name in WEIGHTS:
        w = np.asarray(getattr(moe, name)[...], np.float64)
        if name in moe.lora.weights:
            a = np.asarray(getattr(moe.lora, f"{name}_a")[...], np.float64)
            b = np.asarray(getattr(moe.lora, f"{name}_b")[...], np.float64)
            w = w + np.einsum("...ir,...ro->...io", a, b) * moe.lora.scale
        out.append(w)
    return tuple(out)


def _relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("capacity_factor", [  # dropless; capacity (drops: the whole suite)
    None, pytest.param(1.0, marks=pytest.mark.slow)])
def test_random_b_equals_the_merged_dense_reference(capacity_factor):
    moe = nnx.jit(lambda: MoE(D, F, num_experts=E, experts_per_token=K,
                              capacity_factor=capacity_factor, rngs=nnx.Rngs(0)))()
    assert add_expert_lora(moe, R, 8.0, rngs=nnx.Rngs(1), targets=tuple(EXPERT_TARGETS))
    assert moe.lora.down_a.shape == (E, F, R) and moe.lora.down_b.shape == (E, R, D)
    _random_b(moe.lora, np.random.default_rng(0))
    x = _normal(np.random.default_rng(1), (4, 8, D))
    (y, stats), logits = nnx.jit(lambda moe, x: (moe(x), moe.router(x)))(moe, x)
    r = route_jit(logits, K, capacity_factor=capacity_factor)
    if capacity_factor is not None:
        assert float(stats["dropped_fraction"]) > 0  # the capacity path really drops
    merged = [jnp.asarray(w, jnp.float32) for w in _merged(moe)]
    want = _dense_reference(x, r, *merged)
    assert _relative(y, want) <= 1e-5
    base = _dense_reference(x, r, moe.gate[...], moe.up[...], moe.down[...])
    assert _relative(y, base) > 1e-2  # the adapters matter at this B


def test_one_weight_only_and_errors():
    moe = MoE(D, F, num_experts=E, experts_per_token=K, rngs=nnx.Rngs(0))
    assert not add_expert_lora(moe, R, 8.0, rngs=nnx.Rngs(1), targets=("q_proj",))
    assert moe.lora is None  # no expert name: nothing added
    assert add_expert_lora(moe, R, 8.0, rngs=nnx.Rngs(1), targets=("experts.up_proj",))
    assert moe.lora.weights == ("up",)
    assert set(nnx.to_pure_dict(nnx.state(moe, nnx.LoRAParam))["lora"]) == {"up_a", "up_b"}
    with pytest.raises(ConfigurationError, match=r"already has adapters on \['up'\]"):
        add_expert_lora(moe, R, 8.0, rngs=nnx.Rngs(1))
    other = MoE(D, F, num_experts=E, experts_per_token=K, rngs=nnx.Rngs(0))
    with pytest.raises(ConfigurationError, match="rank must be an int >= 1, got 0"):
        add_expert_lora(other, 0, 8.0, rngs=nnx.Rngs(1))


@pytest.mark.parametrize("shape, capacity_factor", [
    pytest.param({"fsdp": 2, "expert": 2, "tp": 2}, None, marks=pytest.mark.slow),
    pytest.param({"expert": 4}, 1.0, marks=pytest.mark.slow),
])
def test_expert_parallel_lora_equals_one_device(shape, capacity_factor):
    """The factors enter the dispatch's shard_map split as their weights (E over `expert`, F
    over `tp`): outputs and the gradients of x, W, A and B equal one device's."""
    rng = np.random.default_rng(2)
    x = _normal(rng, (8, 6, D))
    weights = (_normal(rng, (E, D, F), 0.2), _normal(rng, (E, D, F), 0.2),
               _normal(rng, (E, F, D), 0.2))
    factors = {"gate": (_normal(rng, (E, D, R), 0.3), _normal(rng, (E, R, F), 0.3)),
               "up": (_normal(rng, (E, D, R), 0.3), _normal(rng, (E, R, F), 0.3)),
               "down": (_normal(rng, (E, F, R), 0.3), _normal(rng, (E, R, D), 0.3))}
    logits = _normal(rng, (8, 6, E))
    cap = None if capacity_factor is None else capacity(6, E, K, capacity_factor)

    def loss(x, weights, factors):
        r = route(logits, K, capacity_factor=capacity_factor)
        y = moe_experts(x, r.experts, r.weights, r.kept, *weights, capacity_rows=cap,
                        lora=(0.5, factors))
        return jnp.sum(y**2), y

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, ref), ref_grads = jax.jit(grad)(x, weights, factors)
    with spmd_context(_mesh(shape), DEFAULT_RULES):
        (_, out), grads = jax.jit(grad)(x, weights, factors)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        assert _relative(g, r) <= 1e-5


def _with_expert_lora(model, rngs, targets=tuple(EXPERT_TARGETS)):
    moe = model.layers.layers.mlp
    assert add_expert_lora(moe, R, 8.0, rngs=rngs, targets=targets)
    return moe


@pytest.mark.parametrize("family", ["qwen3_moe",
                                    pytest.param("mixtral", marks=pytest.mark.slow)])
def test_zero_b_logits_equal_the_base_model(family):
    path, ref = fixture(family)
    model = from_pretrained(path, "single")
    single = strategies.SingleDevice()
    base = logits_of(model, single, ref["tokens"])
    moe = _with_expert_lora(model, nnx.Rngs(3))
    assert moe.lora.gate_a.shape[:2] == moe.gate.shape[:2]  # (layers, E, D, r)
    np.testing.assert_array_equal(logits_of(model, single, ref["tokens"]), base)


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.slow)])
def test_save_pretrained_merges_the_expert_adapters(family, tmp_path):
    """transformers' per-expert tensors hold `W_e + A_e·B_e · alpha/r` (read back with
    jaxlight's own safetensors reader), and the saved model's logits are the adapted one's."""
    path, ref = fixture(family)
    model = from_pretrained(path, "single")
    moe = _with_expert_lora(model, nnx.Rngs(3), targets=("experts.gate_proj",
                                                         "experts.down_proj"))
    _random_b(moe.lora, np.random.default_rng(4), 0.5)
    single = strategies.SingleDevice()
    adapted = logits_of(model, single, ref["tokens"])
    save_pretrained(model, str(tmp_path))
    tensors = st.checkpoint_tensors(str(tmp_path))
    prefix, names = (("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral"
                     else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    merged = _merged(moe)
    for which, name in enumerate(names):
        for layer, expert in ((0, 0), (1, 5)):
            info = tensors[f"model.layers.{layer}.{prefix}.experts.{expert}.{name}.weight"]
            saved = st.read_slice(info, (slice(None), slice(None)))
            np.testing.assert_allclose(saved, merged[which][layer, expert].T, rtol=1e-6,
                                       atol=1e-7)
    assert "lora" not in " ".join(tensors)
    again = from_pretrained(str(tmp_path), "single")
    assert again.layers.layers.mlp.lora is None
    assert _relative(logits_of(again, single, ref["tokens"]), adapted) <= 1e-5
    assert _relative(adapted, logits_of(from_pretrained(path, "single"), single,
                                        ref["tokens"])) > 1e-3


class ExpertLoRALM(TinyMoELM):
    """TinyMoELM training only per-expert adapters (random B, so A gets gradients too), SGD:
    a step's update is its gradient, compared exactly."""

    trainable = nnx.LoRAParam

    def configure_model(self, rngs):
        model = super().configure_model(rngs)
        moe = model.blocks.layers.moe
        add_expert_lora(moe, 4, 8.0, rngs=rngs)
        for name in moe.lora.weights:
            b = getattr(moe.lora, f"{name}_b")
            b[...] = jax.random.normal(rngs.params(), b.shape, b.dtype) * 0.3
        return model

    def configure_optimizers(self):
        return optax.sgd(0.5)


STEPS = 2


@pytest.fixture(scope="module")
def lora_reference():
    return train(strategies.SingleDevice(), ExpertLoRALM(), token_batches(STEPS, batch=16),
                 steps=STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [{"expert": 4}, {"data": 2, "expert": 4}])
def test_adapters_only_training_equals_one_device(shape, lora_reference, tmp_path):
    n = int(np.prod(list(shape.values())))
    module = ExpertLoRALM()
    fit, losses, params = _train_saving(module, strategies.Hybrid(
        shape, devices=jax.devices()[:n]), tmp_path)
    _, ref_losses, ref_params = lora_reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(str(shape), params, ref_params, 1e-5)
    lora = fit.state.params["blocks"]["layers"]["moe"]["lora"]
    assert set(fit.state.params["blocks"]["layers"]["moe"]) == {"lora"}  # only adapters train
    for name, leaf in lora.items():  # split like their weights: E over the expert axis
        assert leaf.addressable_shards[0].data.shape[1] == 8 // shape["expert"], name
    state = ocp.StandardCheckpointer().restore(str(tmp_path / str(STEPS) / "state"))
    saved = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        state["params"])]
    assert saved and all("['lora']" in k for k in saved), saved
    assert state["rest"] == {}


def _train_saving(module, strategy, ckpt):
    """`train` with a checkpoint at the last step."""
    recorder = LossRecorder()
    fit = jl.Fit(strategy=strategy, max_steps=STEPS, log_every_n_steps=1,
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 callbacks=[recorder, callbacks.ModelCheckpoint(str(ckpt),
                                                                every_n_steps=STEPS)])
    fit.fit(module, token_batches(STEPS, batch=16))
    losses = np.array([recorder.losses[s] for s in range(1, STEPS + 1)])
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return fit, losses, params


def test_sft_targets_name_the_experts():
    """`--lora.targets` takes the experts' names; a dense model refuses them."""
    targets = parse_targets("q_proj,experts.gate_proj,experts.down_proj")
    mixed = os.path.join(os.path.dirname(fixture("qwen3_moe")[0]), "qwen3_moe_mixed")
    tuner = ChatFineTuner(mixed, lora_rank=4, lora_targets=targets)
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: tuner.configure_model(nnx.Rngs(0)))
    lora = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
    assert set(lora["layers"]["layers"]["mlp"]["lora"]) == {"gate_a", "gate_b", "down_a",
                                                           "down_b"}
    assert "mlp" not in lora["dense_layers"]["layers"]  # dense MLPs: no gate_proj named
    with pytest.raises(ConfigurationError, match="experts.gate_proj.*no mixture-of-experts"):
        ChatFineTuner(fixture("qwen3")[0], lora_rank=4, lora_targets=targets)


def test_the_grpo_recipe_refuses_expert_targets_on_a_dense_model():
    """The GRPO recipe's policy shares the SFT recipe's LoRA targets: the experts' names on a
    model with no MoE layer are refused when the module is built, not silently adapted to
    nothing."""
    from jaxlight.recipes import grpo

    with pytest.raises(ConfigurationError, match="experts.gate_proj.*no mixture-of-experts"):
        grpo.PolicyOptimizer(fixture("qwen3")[0], lora_rank=4,
                             lora_targets=("q_proj", "experts.gate_proj"))


@pytest.mark.slow
def test_cli_fits_expert_adapters_under_an_expert_layout_and_exports_them_merged():
    """`jaxlight fit sft --model.pretrained` on Qwen 3 MoE (dense and MoE layers) with
    `--lora.targets` naming the experts, under `data 2 x expert 4`: the experts' adapters
    train (B leaves zero), the checkpoint holds only adapters, and `--export.path` writes a
    model whose logits are the fine-tuned one's."""
    from tests.recipes.test_sft_pretrained import fit_mixed_moe_sft

    steps = 4
    out = fit_mixed_moe_sft(
        steps, "--lora.targets", "q_proj,experts.gate_proj,experts.up_proj,experts.down_proj",
        "--export.path", "exported")
    model = out.module.model
    lora = model.layers.layers.mlp.lora
    assert lora.weights == WEIGHTS
    assert lora.gate_a[...].addressable_shards[0].data.shape[1] == 8 // 4  # E split 4 ways
    assert all(float(jnp.abs(b[...]).max()) > 0 for b in (lora.gate_b, lora.up_b, lora.down_b))
    state = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(
        "jaxlight_logs", "checkpoints", str(steps), "state")))
    saved = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        state["params"])}
    assert saved == {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam)))}
    assert {"['layers']['layers']['mlp']['lora']['down_b']"} <= saved
    tokens = np.arange(96, dtype=np.int32).reshape(8, 12) * 5 % 500
    single = strategies.SingleDevice()
    tuned = logits_of(model, out.fit.strategy, tokens)
    exported = logits_of(from_pretrained("exported", "single"), single, tokens)
    assert _relative(exported, tuned) <= 1e-5
