"""Qwen 3 MoE and Mixtral: logits and greedy tokens equal transformers' on the tiny fixtures
(tests/nn/pretrained/make_moe_fixtures.py), under one device and expert-parallel layouts, from
both of transformers' expert layouts; save_pretrained writes what loads back the same."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlight import strategies
from jaxlight._errors import ConfigurationError
from jaxlight.nn.pretrained import from_hf_config, from_pretrained, generate, save_pretrained
from jaxlight.nn.pretrained._moe_layers import segments
from tests.nn.pretrained.test_parity import fixture, logits_of, relative_error

LAYOUTS = {
    "single": lambda: strategies.SingleDevice(),
    "fsdp": lambda: strategies.FSDP(),
    "data2_expert4": lambda: strategies.Hybrid({"data": 2, "expert": 4}),
    "fsdp2_expert2_tp2": lambda: strategies.Hybrid({"fsdp": 2, "expert": 2, "tp": 2}),
}

CASES = [("qwen3_moe", "single"), ("qwen3_moe", "fsdp2_expert2_tp2"), ("mixtral", "single"),
         ("qwen3_moe_fused", "data2_expert4"),
         pytest.param("qwen3_moe", "fsdp", marks=pytest.mark.slow),
         pytest.param("qwen3_moe", "data2_expert4", marks=pytest.mark.slow),
         pytest.param("mixtral", "fsdp2_expert2_tp2", marks=pytest.mark.slow),
         pytest.param("mixtral", "data2_expert4", marks=pytest.mark.slow)]


@pytest.mark.parametrize("family,layout", CASES)
def test_moe_logits_match_transformers(family, layout):
    path, ref = fixture(family)
    strategy = LAYOUTS[layout]()
    strategy.setup()
    model = from_pretrained(path, strategy)
    tokens = np.tile(ref["tokens"], (4, 1))  # every data-parallel degree divides 8 rows
    got = logits_of(model, strategy, tokens)
    assert relative_error(got, np.tile(ref["logits"], (4, 1, 1))) <= 1e-4
    gate = model.layers.layers.mlp.gate[...]
    shards = strategy.mesh.shape.get("expert", 1)
    assert gate.addressable_shards[0].data.shape[1] == gate.shape[1] // shards


@pytest.mark.parametrize("family,layout", [
    pytest.param("qwen3_moe", "single", marks=pytest.mark.slow),
    pytest.param("mixtral", "single", marks=pytest.mark.slow),
    pytest.param("mixtral", "data2_expert4", marks=pytest.mark.slow)])
def test_moe_greedy_generation_matches_transformers(family, layout):
    path, ref = fixture(family)
    strategy = LAYOUTS[layout]()
    strategy.setup()
    model = from_pretrained(path, strategy)
    prompts = [[int(t) for t in row[:6]] for row in ref["tokens"]]
    out = generate(model, prompts, 8, strategy=strategy, stop_tokens=[])
    np.testing.assert_array_equal(np.asarray(out), ref["generated"])


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=pytest.mark.slow),
                                    "qwen3_moe_fused"])
def test_moe_save_pretrained_round_trip(family, tmp_path):
    path, ref = fixture(family)
    model = from_pretrained(path, "single")
    save_pretrained(model, str(tmp_path))
    with open(tmp_path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    prefix = "block_sparse_moe" if family == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for i in range(2):  # transformers' per-expert layout, whatever the source's was
        for j in range(8):
            for n in names:
                assert f"model.layers.{i}.{prefix}.experts.{j}.{n}.weight" in header
    assert not any("gate_up_proj" in k for k in header)
    again = from_pretrained(str(tmp_path), "single")
    tokens = ref["tokens"]
    np.testing.assert_array_equal(logits_of(again, strategies.SingleDevice(), tokens),
                                  logits_of(model, strategies.SingleDevice(), tokens))


def test_dense_layers_among_experts_follow_transformers_rule():
    with open(os.path.join(fixture("qwen3_moe")[0], "config.json")) as f:
        hf = json.load(f)
    hf["num_hidden_layers"], hf["mlp_only_layers"] = 6, [1]
    assert from_hf_config(hf).dense_layers == (1,)
    hf["mlp_only_layers"], hf["decoder_sparse_step"] = [4], 2  # (i + 1) % 2 == 0 is sparse
    cfg = from_hf_config(hf)
    assert cfg.dense_layers == (0, 2, 4) and cfg.sparse_layers == (1, 3, 5)
    hf["decoder_sparse_step"] = 7  # no layer left sparse: a dense model in qwen3_moe's names
    assert from_hf_config(hf).num_experts == 0
    hf["decoder_sparse_step"], hf["mlp_only_layers"] = 1, [6]
    with pytest.raises(ConfigurationError, match=r"mlp_only_layers=\[6\] do not name layers "
                                                 r"of a 6-layer model"):
        from_hf_config(hf)


def test_segments_scan_repeated_units():
    assert segments([True] * 5) == [(0, (True,), 5)]
    assert segments([False, True] * 24) == [(0, (False, True), 24)]
    assert segments([False] + [True] * 47) == [(0, (False,), 1), (1, (True,), 47)]
    assert segments([False, True, False, True, False, False]) == [
        (0, (False, True), 2), (4, (False,), 2)]


@pytest.mark.parametrize("layout", [pytest.param(x, marks=pytest.mark.slow)
                                    for x in ("single", "fsdp2_expert2_tp2")])
def test_dense_and_moe_layers_match_transformers(layout):
    path, ref = fixture("qwen3_moe_mixed")  # layers 0, 2, 4, 5 dense; 1, 3 MoE
    strategy = LAYOUTS[layout]()
    strategy.setup()
    model = from_pretrained(path, strategy)
    assert model.layers.num_layers == 2 and model.dense_layers.num_layers == 4
    tokens = np.tile(ref["tokens"], (4, 1))
    got = logits_of(model, strategy, tokens)
    assert relative_error(got, np.tile(ref["logits"], (4, 1, 1))) <= 1e-4
    prompts = [[int(t) for t in row[:6]] for row in ref["tokens"]]
    out = generate(model, prompts, 8, strategy=strategy, stop_tokens=[])
    np.testing.assert_array_equal(np.asarray(out), ref["generated"])


@pytest.mark.slow  # the fast tier saves and reloads an MoE fixture above
def test_dense_and_moe_layers_save_back(tmp_path):
    path, ref = fixture("qwen3_moe_mixed")
    model = from_pretrained(path, "single")
    save_pretrained(model, str(tmp_path))
    with open(tmp_path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        source = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert sorted(k for k in header if k != "__metadata__") == sorted(
        k for k in source if k != "__metadata__")
    again = from_pretrained(str(tmp_path), "single")
    np.testing.assert_array_equal(logits_of(again, strategies.SingleDevice(), ref["tokens"]),
                                  logits_of(model, strategies.SingleDevice(), ref["tokens"]))


def test_experts_not_divisible_by_the_expert_axis():
    path, ref = fixture("mixtral")  # 8 experts
    strategy = strategies.Hybrid({"expert": 3}, devices=jax.devices()[:3])
    strategy.setup()
    with pytest.raises(Exception, match=r"not divisible by mesh axes \('expert',\)"):
        from_pretrained(path, strategy, param_dtype=jnp.float32)


@pytest.mark.parametrize("family,layout", [
    ("qwen3_moe", "single"), pytest.param("mixtral", "single", marks=pytest.mark.slow),
    pytest.param("qwen3_moe_mixed", "single", marks=pytest.mark.slow),
    ("qwen3_moe_mixed", "data2_expert4")])
def test_load_balancing_loss_matches_transformers(family, layout):
    """transformers' `aux_loss` (output_router_logits=True), with and without an attention
    mask, from `model(tokens, return_aux=True)`; weighted by router_aux_loss_coef only where
    the config's output_router_logits asks for it."""
    path, ref = fixture(family)
    strategy = LAYOUTS[layout]()
    strategy.setup()
    model = from_pretrained(path, strategy)
    graphdef, state = nnx.split(model)
    rows = 8 if layout != "single" else 2  # every data-parallel degree divides 8 rows
    tokens = np.tile(ref["tokens"], (rows // 2, 1))
    mask = np.tile(ref["aux_mask"], (rows // 2, 1))

    @jax.jit
    def aux_of(state, tokens, mask):
        return nnx.merge(graphdef, state)(tokens, attention_mask=mask, return_aux=True)[1]

    with strategy.trace_context():
        plain = aux_of(state, tokens, np.ones_like(mask))
        masked = aux_of(state, tokens, mask)
    for got, want in ((plain, ref["aux_loss"]), (masked, ref["aux_loss_masked"])):
        assert abs(float(got["aux_loss"]) - float(want)) <= 1e-5 * abs(float(want))
    weight = 0.01 if family == "qwen3_moe_mixed" else 0.0  # output_router_logits: mixed only
    assert model.config.aux_loss_weight == weight
    assert float(plain["loss"]) == pytest.approx(weight * float(plain["aux_loss"]), rel=1e-6)
    k, layers = 2, len(model.config.sparse_layers)
    assert float(plain["load"].sum()) == k * layers * tokens.size


def test_a_dense_model_has_no_router_loss():
    path, ref = fixture("qwen3")
    model = from_pretrained(path, "single", param_dtype=jnp.float32)
    with pytest.raises(ConfigurationError, match="has no mixture-of-experts layers"):
        model(ref["tokens"][:, :4], return_aux=True)
