"""Pretrained decoder families (Llama 3, Qwen 2/3, Qwen 3 MoE, Mistral, Mixtral, Gemma 3) in
Hugging Face's layout.

    >>> from jaxlight.nn import pretrained
    >>> sorted(pretrained.FAMILIES)
    ['gemma3_text', 'llama', 'mistral', 'mixtral', 'qwen2', 'qwen3', 'qwen3_moe']

`from_pretrained(path, strategy)` reads config.json and the safetensors files straight into the
strategy's shards, `save_pretrained(model, path)` writes them back, and `generate` samples with
a key/value cache. See docs/pretrained.md.

May import `strategies`, `state`, `nn`'s building blocks, `sharding`, `distributed` and the root
modules (layer 12 of docs/architecture.md).
"""

from jaxlight.nn.pretrained._config import (
    FAMILIES,
    UNSUPPORTED,
    DecoderConfig,
    Rope,
    from_hf_config,
    read_config,
)
from jaxlight.nn.pretrained._generate import Sampling, bucket, choose, compiled_programs, generate
from jaxlight.nn.pretrained._hf import from_pretrained, model_shardings, save_pretrained
from jaxlight.nn.pretrained._model import DecoderLM, padded_positions
from jaxlight.nn.pretrained._tokenizer import (
    Tokenizer,
    encode_chats,
    read_jsonl_chats,
)

__all__ = [
    "FAMILIES",
    "UNSUPPORTED",
    "DecoderConfig",
    "DecoderLM",
    "Rope",
    "Sampling",
    "Tokenizer",
    "bucket",
    "choose",
    "compiled_programs",
    "encode_chats",
    "generate",
    "from_hf_config",
    "from_pretrained",
    "model_shardings",
    "padded_positions",
    "read_config",
    "read_jsonl_chats",
    "save_pretrained",
]
