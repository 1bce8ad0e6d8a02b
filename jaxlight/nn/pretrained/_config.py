"""The shape of a pretrained decoder (Llama 3, Qwen 2/3, Mistral, Gemma 3), read from config.json.

Hugging Face configs come in two shapes: checkpoints on the Hub carry `rope_theta` +
`rope_scaling` (Gemma 3 also `rope_local_base_freq`), transformers 5 writes `rope_parameters`
(for Gemma 3 one entry per layer type). Both read into one `DecoderConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxlight._errors import CheckpointError, ConfigurationError, suggest
from jaxlight.nn._scan import remat_policy

#: model_type -> family. Each family is one set of switches of `DecoderConfig`.
FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "qwen3_moe": "qwen3",
    "mixtral": "llama",
}

#: The mixture-of-experts families: model_type -> (router, renormalize by default).
MOE_FAMILIES = {"qwen3_moe": ("softmax_topk", False), "mixtral": ("topk_softmax", True)}

#: What is refused, with why (multimodal checkpoints carry a vision tower).
UNSUPPORTED = {
    "gemma3": "Gemma 3 with its SigLIP vision tower (Gemma3ForConditionalGeneration); jaxlight "
              "loads the text-only Gemma3ForCausalLM (model_type 'gemma3_text', the 1B model, or "
              "a text model exported from a multimodal one)",
    "llama4": "Llama 4 (mixture of experts, vision)",
    "qwen2_vl": "Qwen 2 VL's vision tower",
    "qwen2_5_vl": "Qwen 2.5 VL's vision tower",
    "mllama": "Llama 3.2 Vision's cross-attention layers",
    "gemma2": "Gemma 2 (attention logit soft-capping with its own norms)",
    "gemma": "Gemma 1",
}

#: RoPE types computed here (others, such as yarn or dynamic NTK, are refused).
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class Rope:
    """One rotary table: base wavelength and scaling (`rope_type` and its parameters)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """The inverse frequencies, `(head_dim // 2,)` float32, as transformers computes them."""
        exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
            head_dim)
        inv = (1.0 / (np.float32(self.theta) ** exponent)).astype(np.float32)
        if self.rope_type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "llama3":
            old = self.original_max_position_embeddings
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """One decoder family's switches and shape (see `from_hf_config`).

    Attributes:
        model_type: Hugging Face's `model_type` (`llama`, `mistral`, `qwen2`, `qwen3`,
            `gemma3_text`).
        vocab_size, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
            head_dim: the shape (grouped-query attention when `num_kv_heads < num_heads`).
        norm_eps: RMSNorm epsilon.
        norm_offset: 1.0 where the norm scales by `1 + w` (Gemma), else 0.0.
        qkv_bias, o_bias, mlp_bias: biases of the q/k/v, output and MLP projections.
        qk_norm: RMSNorm over each head of q and k before RoPE (Qwen 3, Gemma 3).
        sandwich_norms: Gemma 3's four norms per layer (post-attention and post-MLP norms on
            the branch outputs, before the residual adds).
        embed_scale: multiply embeddings by this (Gemma: sqrt(hidden_size)), or None.
        attn_scale: the softmax scale of q·k (head_dim**-0.5, Gemma: query_pre_attn_scalar**-0.5).
        activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
        ropes: the rotary tables; `layer_rope[i]` picks layer i's.
        layer_rope: per layer, an index into `ropes`.
        layer_window: per layer, the sliding window (a query sees keys less than this many
            positions back), 0 for global attention.
        tie_embeddings: the output head is the embedding table.
        final_logit_softcap: `tanh(logits / c) * c`, or None.
        token_ids: bos/eos/pad token ids from the config (eos may be a list).
        hf_config: the config.json as read (written back by `save_pretrained`).
        num_experts: experts per MoE layer (0: a dense model; otherwise the layers not in
            `dense_layers` are MoE layers, `jaxlight.nn.MoE`).
        experts_per_token: k.
        expert_size: each expert's hidden width (`moe_intermediate_size`, Mixtral's
            `intermediate_size`).
        router: "softmax_topk" (Qwen 3 MoE) or "topk_softmax" (Mixtral).
        renormalize: divide the k routing weights by their sum (`norm_topk_prob`).
        capacity_factor: None (dropless) or capacity dropping (see `jaxlight.nn.MoE`).
        dense_layers: in an MoE model, the layers whose MLP is dense (`intermediate_size`),
            as Qwen 3 MoE's `mlp_only_layers` and `decoder_sparse_step` make them.
        aux_loss_weight: the weight of the load-balancing loss added to the LM loss
            (`router_aux_loss_coef` where `output_router_logits` is set, as transformers adds
            it; else 0).
        remat: what each layer recomputes in the backward pass (`jaxlight.nn.Stacked`).
        kv_repeat: each key/value head's output is repeated this many times for the query
            heads (its weights stay one unsharded copy): set by `from_pretrained` when the
            tensor-parallel degree does not divide `num_kv_heads` (Gemma 3 1B's one).
        dtype: compute dtype (None: the parameters' dtype).
        param_dtype: parameter dtype.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float = 1e-6
    norm_offset: float = 0.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float = 1.0
    activation: str = "silu"
    ropes: tuple[Rope, ...] = (Rope(10_000.0),)
    layer_rope: tuple[int, ...] = ()
    layer_window: tuple[int, ...] = ()
    tie_embeddings: bool = False
    final_logit_softcap: float | None = None
    token_ids: dict = dataclasses.field(default_factory=dict, compare=False)
    hf_config: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    router: str = "softmax_topk"
    renormalize: bool = True
    capacity_factor: float | None = None
    dense_layers: tuple[int, ...] = ()
    aux_loss_weight: float = 0.0
    remat: Any = False
    kv_repeat: int = 1
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def __post_init__(self):
        remat_policy(self.remat)
        if self.num_heads % self.num_kv_heads:
            raise ConfigurationError(
                f"{self.model_type}: num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}; grouped-query attention needs one.")
        for name in ("layer_rope", "layer_window"):
            if len(getattr(self, name)) != self.num_layers:
                raise ConfigurationError(f"DecoderConfig.{name} needs one entry per layer "
                                         f"({self.num_layers}), got {getattr(self, name)}.")

    @property
    def layer_kinds(self) -> tuple[bool, ...]:
        """Per layer: True where its MLP is an MoE layer."""
        dense = set(self.dense_layers)
        return tuple(bool(self.num_experts) and i not in dense for i in range(self.num_layers))

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The MoE layers' indices."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k)

    @property
    def family(self) -> str:
        return FAMILIES[self.model_type]

    def replace(self, **changes) -> DecoderConfig:
        return dataclasses.replace(self, **changes)


def read_config(path: str) -> dict:
    """config.json of a model directory (or the file itself) as a dict."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        where = path if os.path.isdir(path) else os.path.dirname(path) or "."
        present = sorted(os.listdir(where))[:12] if os.path.isdir(where) else "nothing"
        raise CheckpointError(
            f"{file} does not exist: a Hugging Face model directory holds config.json and "
            f"*.safetensors; {where!r} has {present}.")
    with open(file) as f:
        return json.load(f)


def _rope(params: dict | None, theta: float | None, who: str) -> Rope:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", theta)
    if theta is None:
        raise ConfigurationError(f"{who}: the config gives no rope_theta.")
    if rope_type not in ROPE_TYPES:
        raise ConfigurationError(
            f"{who}: RoPE type {rope_type!r} is not supported; jaxlight computes "
            f"{list(ROPE_TYPES)}.")
    kw = {k: params[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                 "original_max_position_embeddings") if k in params}
    return Rope(float(theta), rope_type, **kw)


def from_hf_config(hf: dict, **overrides) -> DecoderConfig:
    """A `DecoderConfig` from a Hugging Face config dict (either RoPE shape).

    Args:
        hf: config.json as a dict.
        **overrides: `remat`, `dtype`, `param_dtype` (or any other field).

    Example:
        >>> cfg = from_hf_config({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
        ...     "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...     "num_key_value_heads": 2, "rope_theta": 500000.0})
        >>> cfg.head_dim, cfg.num_kv_heads, cfg.ropes[0].theta
        (4, 2, 500000.0)
    """
    model_type = hf.get("model_type")
    if model_type == "gemma3" and isinstance(hf.get("text_config"), dict):
        raise ConfigurationError(
            f"model_type 'gemma3' is {UNSUPPORTED['gemma3']}. Architectures: "
            f"{hf.get('architectures')}.")
    if model_type not in FAMILIES:
        why = UNSUPPORTED.get(model_type)
        raise ConfigurationError(
            f"model_type {model_type!r} ({hf.get('architectures')}) is not supported"
            + (f": {why}" if why else "")
            + f". jaxlight loads {sorted(FAMILIES)}.{suggest(str(model_type), FAMILIES)}")
    family = FAMILIES[model_type]
    who = f"config.json (model_type {model_type!r})"
    try:
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        layers = int(hf["num_hidden_layers"])
        kw: dict[str, Any] = dict(
            model_type=model_type, vocab_size=int(hf["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]), num_layers=layers, num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", family == "gemma3")),
        )
    except KeyError as err:
        raise ConfigurationError(f"{who} lacks {err.args[0]!r}.") from None
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    activations = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
    if act not in activations:
        raise ConfigurationError(f"{who}: activation {act!r} is not supported; jaxlight has "
                                 f"{sorted(activations)}.")
    kw["activation"] = activations[act]
    rope_params = hf.get("rope_parameters")
    window = int(hf.get("sliding_window") or 0)
    if family == "gemma3":
        types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % int(hf.get("sliding_window_pattern", 6)) == 0
            else "sliding_attention" for i in range(layers)]
        if rope_params and "full_attention" in rope_params:
            ropes = (_rope(rope_params.get("sliding_attention"), None, who),
                     _rope(rope_params.get("full_attention"), None, who))
        else:
            ropes = (Rope(float(hf.get("rope_local_base_freq", 10_000.0))),
                     _rope(hf.get("rope_scaling") or rope_params,
                           hf.get("rope_theta", 1_000_000.0), who))
        kw.update(
            layer_rope=tuple(int(t == "full_attention") for t in types),
            layer_window=tuple(window if t == "sliding_attention" else 0 for t in types),
            ropes=ropes, norm_offset=1.0, qk_norm=True, sandwich_norms=True,
            embed_scale=hidden**0.5,
            attn_scale=float(hf.get("query_pre_attn_scalar", kw["head_dim"])) ** -0.5,
            qkv_bias=bool(hf.get("attention_bias", False)),
            o_bias=bool(hf.get("attention_bias", False)),
            final_logit_softcap=hf.get("final_logit_softcapping"),
        )
        if hf.get("attn_logit_softcapping"):
            raise ConfigurationError(f"{who}: attn_logit_softcapping is not supported.")
    else:
        rope = _rope(rope_params or hf.get("rope_scaling"), hf.get("rope_theta", 10_000.0), who)
        if hf.get("layer_types"):  # transformers 5 writes which layers slide
            windows = tuple(window if t == "sliding_attention" else 0 for t in hf["layer_types"])
        elif window and (model_type == "mistral" or hf.get("use_sliding_window")):
            # Qwen's sliding window starts at max_window_layers; earlier layers are global.
            first = 0 if model_type == "mistral" else int(hf.get("max_window_layers", layers))
            windows = tuple(window if i >= first else 0 for i in range(layers))
        else:
            windows = (0,) * layers
        attention_bias = bool(hf.get("attention_bias", False))
        kw.update(ropes=(rope,), layer_rope=(0,) * layers, layer_window=windows,
                  attn_scale=kw["head_dim"] ** -0.5,
                  qkv_bias=attention_bias or model_type == "qwen2",
                  o_bias=attention_bias, mlp_bias=bool(hf.get("mlp_bias", False)),
                  qk_norm=family == "qwen3")
    if model_type in MOE_FAMILIES:
        kw.update(_moe_fields(hf, model_type, layers, who))
    eos = hf.get("eos_token_id")
    kw["token_ids"] = {"bos": hf.get("bos_token_id"), "pad": hf.get("pad_token_id"),
                       "eos": [eos] if isinstance(eos, int) else list(eos or [])}
    kw["hf_config"] = dict(hf)
    kw.update(overrides)
    return DecoderConfig(**kw)


def _moe_fields(hf: dict, model_type: str, layers: int, who: str) -> dict[str, Any]:
    """The experts' fields of a Qwen 3 MoE or Mixtral config, with the layers that are dense
    MLPs (`mlp_only_layers`, and those `decoder_sparse_step` skips), as transformers builds
    them: layer i is sparse when it is not in `mlp_only_layers` and `(i + 1) % step == 0`."""
    router, renormalize = MOE_FAMILIES[model_type]
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    only = hf.get("mlp_only_layers") or []
    bad = [i for i in only if not isinstance(i, int) or not 0 <= i < layers]
    if step < 1 or bad:
        raise ConfigurationError(
            f"{who}: decoder_sparse_step={step} and mlp_only_layers={only} do not name layers "
            f"of a {layers}-layer model ({bad or 'the step must be >= 1'}); use a step >= 1 "
            f"and layer indices from 0 to {layers - 1}.")
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise ConfigurationError(f"{who} lacks 'num_experts' (or 'num_local_experts').")
    size = hf.get("moe_intermediate_size") if model_type == "qwen3_moe" else None
    if len(dense) == layers:  # no sparse layer at all: a dense model in qwen3_moe's names
        return {}
    return dict(num_experts=int(experts), experts_per_token=int(hf["num_experts_per_tok"]),
                expert_size=int(size or hf["intermediate_size"]), router=router,
                renormalize=bool(hf.get("norm_topk_prob", renormalize)), dense_layers=dense,
                aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.0) or 0.0)
                if hf.get("output_router_logits") else 0.0)
