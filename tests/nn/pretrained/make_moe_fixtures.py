"""Builds the tiny mixture-of-experts fixtures (Qwen 3 MoE, Mixtral) and transformers' reference
logits (`make fixtures` runs it after make_fixtures.py).

Run with a Python that has torch and transformers (test-only, offline):

    HF_HUB_OFFLINE=1 python tests/nn/pretrained/make_moe_fixtures.py

Each family gets a random tiny model (2 layers, 8 experts, top-2; routers widened so that no
token's k-th and (k+1)-th expert are near a tie), saved by transformers in float32 (its
per-expert layout: `mlp.experts.{j}.gate_proj` for Qwen 3 MoE, `block_sparse_moe.experts.{j}.w1`
for Mixtral), plus `qwen3_moe_fused`: the same Qwen 3 MoE weights written in transformers'
fused 3-D layout (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), and
`qwen3_moe_mixed`: six layers of which only 1 and 3 are MoE layers (`decoder_sparse_step=2`
makes 0, 2, 4 dense, `mlp_only_layers=[5]` makes 5 dense too), 512 tokens, the dense fixtures'
tokenizer (copied from fixtures/qwen3, so the sft recipe runs on it) and
`output_router_logits=True`. `reference.npz` holds a fixed batch of tokens, transformers'
float32 logits, an 8-token greedy generation and the load-balancing loss (`aux_loss`, and
`aux_loss_masked` with `aux_mask`: the second row's first four tokens are padding).
"""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures")
VOCAB = 128

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
              num_experts_per_tok=2, max_position_embeddings=64)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                       norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=16, num_local_experts=8,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
MIXED = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
         dict(FAMILIES["qwen3_moe"][2], vocab_size=512, num_hidden_layers=6,
              decoder_sparse_step=2, mlp_only_layers=[5], output_router_logits=True,
              router_aux_loss_coef=0.01))


def widen(model: torch.nn.Module, seed: int) -> None:
    """Random weights at a scale where logits and routing have no near-ties."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight"):  # the routers
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def reference(model, path: str) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(2, 12)).astype(np.int64)
    mask = np.ones_like(tokens)
    mask[1, :4] = 0
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).logits.numpy()
        aux = model(torch.from_numpy(tokens), output_router_logits=True).aux_loss
        aux_masked = model(torch.from_numpy(tokens), attention_mask=torch.from_numpy(mask),
                           output_router_logits=True).aux_loss
        generated = model.generate(torch.from_numpy(tokens[:, :6]), max_new_tokens=8,
                                   min_new_tokens=8, do_sample=False, pad_token_id=0)
    np.savez_compressed(os.path.join(path, "reference.npz"), tokens=tokens.astype(np.int32),
                        logits=logits.astype(np.float32),
                        generated=generated[:, 6:].numpy().astype(np.int32),
                        aux_loss=np.float32(aux), aux_loss_masked=np.float32(aux_masked),
                        aux_mask=mask.astype(np.int32))


def build(name: str, cls: str, model_cls: str, extra: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    config = getattr(transformers, cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    widen(model, seed=sum(map(ord, name)))
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path)
    reference(model, path)
    print(name, sorted(os.listdir(path)))
    return model


def fused_copy(model: torch.nn.Module, source: str, name: str) -> None:
    """The same weights in transformers' fused 3-D expert layout (its modules' own state)."""
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state), sorted(state)[:8]
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(OUT, source, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    shutil.copyfile(os.path.join(OUT, source, "reference.npz"),
                    os.path.join(path, "reference.npz"))
    print(name, sorted(state)[:3], "...")


def main() -> None:
    print("transformers", transformers.__version__, "torch", torch.__version__)
    models = {name: build(name, *spec) for name, spec in FAMILIES.items()}
    fused_copy(models["qwen3_moe"], "qwen3_moe", "qwen3_moe_fused")
    build("qwen3_moe_mixed", *MIXED)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # make_fixtures.py's tokenizer
        shutil.copyfile(os.path.join(OUT, "qwen3", name),
                        os.path.join(OUT, "qwen3_moe_mixed", name))


if __name__ == "__main__":
    main()
