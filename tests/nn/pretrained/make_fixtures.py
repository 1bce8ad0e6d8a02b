"""Builds the tiny pretrained-model fixtures and transformers' reference outputs (`make fixtures`).

Run with the test-only reference environment (torch + transformers + tokenizers), offline:

    HF_HUB_OFFLINE=1 /work/venv-hf/bin/python tests/nn/pretrained/make_fixtures.py

For each family (Llama 3 with llama3 RoPE scaling, Qwen 2 with q/k/v biases, Qwen 3 with
QK-norm, Gemma 3 with sliding/global layers) it creates a random model with transformers (no
download), widens its random weights so that greedy decoding has no near-ties, saves it in
Hugging Face's layout (bfloat16 safetensors: small, and exact in float32) with a 512-token
byte-level BPE tokenizer trained here and a chat template, then reloads it in float32 and writes
`reference.npz`: logits of a fixed batch, a 32-token greedy generation of two left-padded
prompts, and a chat template's token ids. The regular suite checks jaxlight against these
without torch. Llama and Gemma keep the Hub's config shape (`rope_theta` + `rope_scaling`),
Qwen the one transformers 5 writes (`rope_parameters`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures")
VOCAB = 512

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A language model predicts the next token from the tokens before it.",
    "Sharding splits each weight over devices; every process reads only its slices.",
    "Rotary position embeddings rotate pairs of query and key features by the position.",
    "Grouped-query attention shares each key and value head among several query heads.",
    "Fine-tuning adapts a pretrained model to a task with a small learning rate.",
    "What is the capital of France? The capital of France is Paris.",
    "Reverse the word: lamp. The reversed word is pmal.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.",
] * 20

FAMILIES = {
    "llama": dict(
        cls="LlamaConfig", model_type="llama", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
        hub_shape=True,
    ),
    "qwen2": dict(
        cls="Qwen2Config", model_type="qwen2", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "qwen3": dict(
        cls="Qwen3Config", model_type="qwen3", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "gemma3": dict(
        cls="Gemma3TextConfig", model_type="gemma3_text", hidden_size=64,
        intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}},
        hub_shape=True,
    ),
}


#: Gemma 3 1B's attention shape, one key/value head for 4 query heads: tensor parallelism over
#: more devices than key/value heads (tests/posttrain/test_gemma_tp.py).
FAMILIES["gemma3_1kv"] = {**FAMILIES["gemma3"], "num_key_value_heads": 1}


def train_tokenizer(path: str) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256, "padding_side": "left",
    }
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def widen(model: torch.nn.Module, seed: int) -> None:
    """Random weights with unit-scale logits: greedy decoding then has clear winners."""
    gen = torch.Generator().manual_seed(seed)
    scale = model.config.hidden_size ** 0.5 if "gemma" in type(model).__name__.lower() else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                base = 0.0 if "gemma" in type(model).__name__.lower() else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                std = p.shape[1] ** -0.5
                if "embed" in name:  # tied heads see the input's own embedding: keep it small
                    std = 1.0 if not model.config.tie_word_embeddings else 0.1 / scale
                p.copy_(std * torch.randn(p.shape, generator=gen))


def hub_shape(config: dict) -> dict:
    """The config as checkpoints on the Hub carry it: rope_theta + rope_scaling."""
    params = config.pop("rope_parameters")
    if "full_attention" in params:  # Gemma 3
        full = dict(params["full_attention"])
        config["rope_theta"] = full.pop("rope_theta")
        config["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        config["rope_scaling"] = full if full.get("rope_type") != "default" else None
    else:
        params = dict(params)
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = params if params.get("rope_type") != "default" else None
    return config


def build(name: str, spec: dict, tokenizer_dir: str) -> None:
    spec = dict(spec)
    cls = getattr(transformers, spec.pop("cls"))
    keep_hub_shape = spec.pop("hub_shape", False)
    spec.pop("model_type")
    ids = dict(bos_token_id=1, eos_token_id=3, pad_token_id=0)
    config = cls(vocab_size=VOCAB, max_position_embeddings=256, **ids, **spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    widen(model, seed=sum(map(ord, name)))
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, file), path)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        saved = json.load(f)
    if keep_hub_shape:
        saved = hub_shape(saved)
        with open(config_file, "w") as f:
            json.dump(saved, f, indent=2, sort_keys=True)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))

    # The reference: transformers reloads the directory (the config shape under test) in fp32.
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    rng = np.random.default_rng(7)
    tokens = rng.integers(4, VOCAB, size=(2, 24)).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.numpy()
    prompts = ["The capital of France", "Rotary position embeddings rotate pairs of"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                             pad_token_id=0, eos_token_id=None)
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."}]
    chat = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if hasattr(chat, "input_ids") or isinstance(chat, dict):
        chat = chat["input_ids"]
    np.savez_compressed(
        os.path.join(path, "reference.npz"), tokens=tokens, logits=logits.astype(np.float32),
        prompt_ids=enc["input_ids"].numpy(), prompt_mask=enc["attention_mask"].numpy(),
        generated=out[:, enc["input_ids"].shape[1]:].numpy(),
        chat_ids=np.asarray(chat, np.int64),
        encoded=np.asarray(tok(prompts[1])["input_ids"], np.int64),
    )
    print(f"{name}: {sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))} "
          f"bytes, generated {out[0, -32:].tolist()[:8]}..., "
          f"{len(set(out[:, -32:].flatten().tolist()))} distinct tokens")


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    tokenizer_dir = os.path.join(OUT, "_tokenizer")
    os.makedirs(tokenizer_dir, exist_ok=True)
    train_tokenizer(tokenizer_dir)
    names = sys.argv[1:] or list(FAMILIES)
    for name in names:
        build(name, FAMILIES[name], tokenizer_dir)
    shutil.rmtree(tokenizer_dir)


if __name__ == "__main__":
    main()
