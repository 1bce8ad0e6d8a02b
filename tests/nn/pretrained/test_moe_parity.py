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

from jaxlight import strategies
from jaxlight._errors import ConfigurationError
from jaxlight.nn.pretrained import from_hf_config, from_pretrained, generate, save_pretrained
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
    ("qwen3_moe", "single"), ("mixtral", "single"),
    pytest.param("mixtral", "data2_expert4", marks=pytest.mark.slow)])
def test_moe_greedy_generation_matches_transformers(family, layout):
    path, ref = fixture(family)
    strategy = LAYOUTS[layout]()
    strategy.setup()
    model = from_pretrained(path, strategy)
    prompts = [[int(t) for t in row[:6]] for row in ref["tokens"]]
    out = generate(model, prompts, 8, strategy=strategy, stop_tokens=[])
    np.testing.assert_array_equal(np.asarray(out), ref["generated"])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe_fused"])
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


def test_dense_layers_among_experts_are_refused():
    with open(os.path.join(fixture("qwen3_moe")[0], "config.json")) as f:
        hf = json.load(f)
    hf["mlp_only_layers"] = [1]
    with pytest.raises(ConfigurationError, match=r"layers \[1\] are dense MLP layers"):
        from_hf_config(hf)
    hf["mlp_only_layers"], hf["decoder_sparse_step"] = [], 2
    with pytest.raises(ConfigurationError, match=r"layers \[0\] .*decoder_sparse_step=2"):
        from_hf_config(hf)


def test_experts_not_divisible_by_the_expert_axis():
    path, ref = fixture("mixtral")  # 8 experts
    strategy = strategies.Hybrid({"expert": 3}, devices=jax.devices()[:3])
    strategy.setup()
    with pytest.raises(Exception, match=r"not divisible by mesh axes \('expert',\)"):
        from_pretrained(path, strategy, param_dtype=jnp.float32)
