"""Hugging Face layout: round trips, sharded files, and the refusals a user can hit."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxlight import strategies
from jaxlight._errors import CheckpointError, ConfigurationError
from jaxlight.nn.pretrained import _safetensors as st
from jaxlight.nn.pretrained import (
    from_hf_config,
    from_pretrained,
    read_config,
    save_pretrained,
)

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def params(model) -> dict:
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def assert_bitwise(a: dict, b: dict) -> None:
    flat_a, flat_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
    for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
        assert x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_load_save_load_is_bitwise_from_a_sharded_layout(tmp_path, family):
    src = os.path.join(FIXTURES, family)
    strat = strategies.Hybrid({"fsdp": 4, "tp": 2})
    strat.setup()
    first = from_pretrained(src, strat)
    # Small shards force the index file and several safetensors files.
    save_pretrained(first, str(tmp_path / "out"), max_shard_bytes=100_000, tokenizer_from=src)
    files = sorted(os.listdir(tmp_path / "out"))
    assert "model.safetensors.index.json" in files and "tokenizer.json" in files
    assert sum(f.endswith(".safetensors") for f in files) > 1
    again = from_pretrained(str(tmp_path / "out"), "single")
    assert_bitwise(params(first), params(again))
    # Every tensor is byte for byte the one transformers wrote.
    ours = {}
    for f in files:
        if f.endswith(".safetensors"):
            ours.update(st.read_header(str(tmp_path / "out" / f))[0])
    theirs = st.read_header(os.path.join(src, "model.safetensors"))[0]
    assert sorted(ours) == sorted(theirs)
    for name, info in theirs.items():
        full = tuple(slice(None) for _ in info.shape)
        assert st.read_slice(info, full).tobytes() == st.read_slice(ours[name], full).tobytes()
    assert read_config(str(tmp_path / "out"))["model_type"] == read_config(src)["model_type"]


def test_fp32_save_and_slices_of_every_kind(tmp_path):
    path = tmp_path / "t.safetensors"
    a = np.arange(6 * 8 * 2, dtype=np.float32).reshape(6, 8, 2)
    b = (np.arange(10) / 3).astype(ml_dtypes.bfloat16)
    st.write_file(str(path), [("a", a), ("b", b)])
    tensors, _ = st.read_header(str(path))
    np.testing.assert_array_equal(st.read_slice(tensors["a"], (slice(1, 4), slice(2, 5))),
                                  a[1:4, 2:5])
    assert st.read_slice(tensors["b"], (slice(3, 7),)).tobytes() == b[3:7].tobytes()


def test_shape_mismatch_names_file_tensor_and_shapes(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(os.path.join(FIXTURES, "llama"), dst)
    config = json.loads((dst / "config.json").read_text())
    config["intermediate_size"] = 128
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as err:
        from_pretrained(str(dst))
    msg = str(err.value)
    assert "model.safetensors" in msg and "'model.layers.0.mlp.gate_proj.weight'" in msg
    assert "(96, 64)" in msg and "(128, 64)" in msg


def test_missing_and_unknown_tensors_are_refused(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(os.path.join(FIXTURES, "qwen3"), dst)
    tensors, _ = st.read_header(str(dst / "model.safetensors"))
    full = {n: st.read_slice(i, tuple(slice(None) for _ in i.shape)) for n, i in tensors.items()}
    extra = dict(full, **{"vision_tower.patch_embed.weight": np.zeros((4, 4), np.float32)})
    st.write_file(str(dst / "model.safetensors"), extra.items())
    with pytest.raises(CheckpointError, match="vision_tower.patch_embed.weight"):
        from_pretrained(str(dst))
    del full["model.layers.1.self_attn.k_norm.weight"]
    st.write_file(str(dst / "model.safetensors"), full.items())
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.k_norm.weight' is miss"):
        from_pretrained(str(dst))
    os.remove(dst / "model.safetensors")
    (dst / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="convert them once"):
        from_pretrained(str(dst))


def test_unsupported_models_say_what_is_supported():
    with pytest.raises(ConfigurationError, match="vision tower"):
        from_hf_config({"model_type": "gemma3", "text_config": {}, "architectures":
                        ["Gemma3ForConditionalGeneration"]})
    with pytest.raises(ConfigurationError, match="Llama 4"):
        from_hf_config({"model_type": "llama4"})
    base = {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    with pytest.raises(ConfigurationError, match="RoPE type 'yarn'"):
        from_hf_config(dict(base, rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_both_config_shapes_read_alike():
    hub = read_config(os.path.join(FIXTURES, "gemma3"))  # rope_theta + rope_scaling
    assert "rope_parameters" not in hub
    new = {k: v for k, v in hub.items()
           if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq")}
    new["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": hub["rope_local_base_freq"]},
        "full_attention": dict(hub["rope_scaling"], rope_theta=hub["rope_theta"])}
    a, b = from_hf_config(hub), from_hf_config(new)
    assert a.ropes == b.ropes and a.ropes[1].rope_type == "linear"
    assert a.layer_window == b.layer_window == (5, 0, 5, 0)
    llama = read_config(os.path.join(FIXTURES, "llama"))
    cfg = from_hf_config(llama)
    assert cfg.ropes[0].rope_type == "llama3"
    # llama3 scaling divides the low frequencies by `factor` and blends the middle band (the
    # fixture's original context of 16 puts even the highest frequency in that band).
    plain = cfg.ropes[0].__class__(cfg.ropes[0].theta).inv_freq(cfg.head_dim)
    scaled = cfg.ropes[0].inv_freq(cfg.head_dim)
    assert scaled[-1] == pytest.approx(plain[-1] / 8) and plain[0] / 8 < scaled[0] < plain[0]


def test_fp32_checkpoint_loads_as_fp32(tmp_path):
    src = os.path.join(FIXTURES, "qwen3")
    model = from_pretrained(src, param_dtype=jnp.float32)
    save_pretrained(model, str(tmp_path / "f32"))
    info = st.read_header(str(tmp_path / "f32" / "model.safetensors"))[0]
    assert {i.dtype for i in info.values()} == {np.dtype(np.float32)}
    again = from_pretrained(str(tmp_path / "f32"))
    assert again.norm.weight[...].dtype == jnp.float32
    assert_bitwise(params(model), params(again))
