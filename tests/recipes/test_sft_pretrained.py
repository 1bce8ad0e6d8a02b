"""The sft recipe on a pretrained Hugging Face model: chat masks, LoRA-only checkpoints that
resume bitwise, and an export transformers reads back with jaxlight's logits."""

from __future__ import annotations

import json
import os
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from jaxlight import callbacks, strategies
from jaxlight.nn.pretrained import Tokenizer, from_pretrained, save_pretrained
from jaxlight.recipes import sft
from jaxlight.recipes._base import apply_overrides
from tests.recipes._small import quiet_fit

QWEN3 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                     "pretrained", "fixtures", "qwen3")
HF_PYTHON = os.environ.get("JAXLIGHT_HF_PYTHON", "/work/venv-hf/bin/python")
STEPS = 4


def config(**overrides):
    base = {"model.pretrained": QWEN3, "task.train_examples": 64, "task.val_examples": 16,
            "data.batch_size": 16, "data.max_length": 40, "optim.lr": 1e-2,
            "optim.warmup_steps": 1}
    return apply_overrides(sft.Config(), {**base, **overrides}, "test")


def mesh():
    return strategies.Hybrid({"fsdp": 4, "tp": 2})


def leaves(tree):
    return {jax.tree_util.keystr(p): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(jax.device_get(tree))}


@pytest.mark.slow
def test_chat_data_masks_the_assistant_and_lora_starts_at_the_base():
    cfg = config()
    module, data = sft.build(cfg)
    batch = next(iter(data.train))
    tok = Tokenizer(QWEN3)
    row, mask = batch["tokens"][0], batch["mask"][0]
    targets = row[1:][mask == 1].tolist()
    assert tok.decode(targets, skip_special_tokens=False).endswith("<|im_end|>\n")
    word = tok.decode(targets[:-2])
    prompt = tok.decode(row[1:][mask == 0].tolist(), skip_special_tokens=False)
    assert f"Reverse {word[::-1]}" in prompt
    model = module.configure_model(nnx.Rngs(0))
    lora = leaves(nnx.state(model, nnx.LoRAParam))
    assert sorted({k.split("['")[4].rstrip("']") for k in lora}) == ["q_proj", "v_proj"]
    base = from_pretrained(QWEN3, param_dtype="float32")
    tokens = batch["tokens"][:2]
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(base(tokens)))


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("chat") / "ckpt")
    module, data = sft.build(config())
    fit = quiet_fit(mesh(), max_steps=STEPS, callbacks=[
        callbacks.ModelCheckpoint(ckpt, every_n_steps=2, save_top_k=-1)])
    fit.fit(module, data.train)
    return module, fit, ckpt, data


@pytest.mark.slow
def test_checkpoints_keep_only_the_adapters_and_resume_bitwise(tuned):
    module, fit, ckpt, data = tuned
    state = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(ckpt, str(STEPS),
                                                                            "state")))
    params = leaves(state["params"])
    assert params and all(k.endswith(("['lora_a']", "['lora_b']")) for k in params)
    assert state["rest"] == {}
    resumed, _ = sft.build(config())
    again = quiet_fit(mesh(), max_steps=STEPS)
    again.fit(resumed, data.train, ckpt_path=os.path.join(ckpt, "2"))
    a, b = leaves(again.state.params), leaves(fit.state.params)
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert any(np.abs(v).max() > 0 for k, v in b.items() if k.endswith("['lora_b']"))


@pytest.mark.slow
def test_export_merges_lora_and_transformers_reads_the_same_logits(tuned, tmp_path):
    module, _, _, data = tuned
    out = str(tmp_path / "export")
    save_pretrained(module.model, out, tokenizer_from=QWEN3)  # what --export.path runs
    assert "tokenizer.json" in os.listdir(out)
    exported = from_pretrained(out, param_dtype="float32")
    tokens = next(iter(data.val))["tokens"][:2]
    ours = np.asarray(module.model(tokens))
    np.testing.assert_allclose(np.asarray(exported(tokens)), ours, atol=1e-5 * np.abs(ours).max())
    if not os.path.exists(HF_PYTHON):
        pytest.skip(f"no transformers environment at {HF_PYTHON} (JAXLIGHT_HF_PYTHON)")
    np.save(tmp_path / "tokens.npy", tokens)
    script = (
        "import sys, numpy as np, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)\n"
        "t = torch.tensor(np.load(sys.argv[2]).astype(np.int64))\n"
        "with torch.no_grad(): np.save(sys.argv[3], m(t).logits.numpy())\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    subprocess.run([HF_PYTHON, "-c", script, out, str(tmp_path / "tokens.npy"),
                    str(tmp_path / "theirs.npy")], check=True, env=env, timeout=300)
    theirs = np.load(tmp_path / "theirs.npy")
    assert float(np.abs(theirs - ours).max() / np.abs(theirs).max()) <= 1e-4
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3"


def fit_mixed_moe_sft(steps: int, *extra: str):
    """`jaxlight fit sft` on the Qwen 3 MoE fixture with dense and MoE layers, under
    data 2 x expert 4, checkpointing at its last step; `extra` options are appended."""
    from jaxlight._cli import run

    mixed = os.path.join(os.path.dirname(QWEN3), "qwen3_moe_mixed")
    return run("fit", "sft", [
        "--model.pretrained", mixed, "--max-steps", str(steps), "--task.train_examples", "64",
        "--task.val_examples", "16", "--data.batch_size", "16", "--data.max_length", "40",
        "--optim.lr", "1e-2", "--optim.warmup_steps", "1", "--strategy", "hybrid",
        "--mesh-shape", '[[2,4],["data","expert"]]', "--checkpoint-every-n-steps", str(steps),
        "--logger", "none", "--enable-progress-bar", "false", "--enable-model-summary",
        "false", *extra])


@pytest.mark.slow
def test_cli_fits_a_mixture_of_experts_model_under_an_expert_layout():
    """`jaxlight fit sft --model.pretrained` on a Qwen 3 MoE directory (dense and MoE layers):
    LoRA on the attention of both stacks, the router's balance loss weighted by
    `router_aux_loss_coef` (the fixture sets `output_router_logits`), the checkpoint written."""
    steps = 4
    out = fit_mixed_moe_sft(steps)
    assert out.metrics["val_loss"] < out.metrics["before_val_loss"]
    aux = float(out.fit.callback_metrics["aux_loss"])
    assert np.isfinite(aux) and aux > 0
    lora = leaves(nnx.to_pure_dict(nnx.state(out.module.model, nnx.LoRAParam)))
    assert {k.split("]")[0] for k in lora} == {"['dense_layers'", "['layers'"}
    assert len(lora) == 8  # A and B of q_proj and v_proj in each stack
    gate = out.module.model.layers.layers.mlp.gate[...]
    assert gate.addressable_shards[0].data.shape[1] == 8 // 4  # experts split 4 ways
    state = ocp.StandardCheckpointer().restore(os.path.abspath(os.path.join(
        "jaxlight_logs", "checkpoints", str(steps), "state")))
    assert leaves(state["params"]).keys() == lora.keys()
