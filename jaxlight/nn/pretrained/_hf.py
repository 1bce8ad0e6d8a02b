"""Hugging Face layout: `from_pretrained` straight into a strategy's shards, `save_pretrained` back.

Each parameter of `DecoderLM` is one Hugging Face tensor per layer seen through a fixed view:
`ours = hf.reshape(view).transpose(perm)` (a projection's `(out, in)` matrix becomes the
`(in..., out...)` kernel with its heads split out). A device's shard of ours is an index per
dimension; the same index, permuted back, names the rows and columns of the Hugging Face tensor
it comes from, so each process reads only the bytes its devices hold (`_safetensors.read_slice`)
and `jax.make_array_from_callback` puts them straight into the final sharding. No host holds the
whole model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlight import distributed
from jaxlight._errors import CheckpointError, ConfigurationError
from jaxlight.nn.pretrained import _moe_hf as moe
from jaxlight.nn.pretrained import _safetensors as st
from jaxlight.nn.pretrained._config import DecoderConfig, from_hf_config, read_config
from jaxlight.nn.pretrained._model import DecoderLM
from jaxlight.nn.pretrained._placement import (
    kv_repeat,
    model_shardings,
    resolve_strategy,
    traced_model,
)
from jaxlight.nn.pretrained._safetensors import checkpoint_tensors

#: Files of a model directory that are the tokenizer and chat template (copied by
#: `save_pretrained(..., tokenizer_from=...)`).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json")

#: Tensors of a checkpoint that are not weights (recomputed buffers), skipped when loading.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter of `DecoderLM` and the Hugging Face tensor(s) it is made of.

    Attributes:
        path: keys of the parameter in `nnx.to_pure_dict(nnx.state(model, nnx.Param))`.
        hf: the tensor's name; `{i}` is the layer for stacked parameters.
        stacked: the parameter has a leading layer axis (one tensor per layer).
        groups: per Hugging Face dimension, the view dimensions it splits into.
        perm: ours = view.transpose(perm).
        layer_ids: the checkpoint's layer of each stacked index (default: the same index).
    """

    path: tuple[str, ...]
    hf: str
    stacked: bool
    groups: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    layer_ids: tuple[int, ...] = ()

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.groups)

    @property
    def view_shape(self) -> tuple[int, ...]:
        return tuple(d for g in self.groups for d in g)

    def name(self, layer: int | None) -> str:
        return self.hf.format(i=self.layer_ids[layer] if self.layer_ids and layer is not None
                              else layer)

    def stack(self, c: DecoderConfig) -> range | list[None]:
        """The stacked indices (`[None]` for an unstacked parameter)."""
        return range(len(self.layer_ids) or c.num_layers) if self.stacked else [None]


def tensor_table(c: DecoderConfig, layout: moe.ExpertLayout | None = None) -> list[Entry]:
    """Every parameter of a `DecoderLM` of config `c` and where it is in Hugging Face's layout
    (an MoE model's experts are `_moe_hf`'s; `layout` says where its router is; dense layers
    among MoE layers are a second stack, `dense_layers`)."""
    e = c.hidden_size
    out = [Entry(("embed_tokens", "embedding"), "model.embed_tokens.weight", False,
                 ((c.vocab_size,), (e,)), (0, 1))]
    kinds = c.layer_kinds
    if any(kinds) and not all(kinds):
        out += _layer_entries(c, ("layers", "layers"), c.sparse_layers, True, layout)
        out += _layer_entries(c, ("dense_layers", "layers"), c.dense_layers, False, layout)
    else:
        out += _layer_entries(c, ("layers", "layers"), (), bool(c.num_experts), layout)
    out.append(Entry(("norm", "weight"), "model.norm.weight", False, ((e,),), (0,)))
    if not c.tie_embeddings:
        out.append(Entry(("lm_head", "kernel"), "lm_head.weight", False, ((c.vocab_size,), (e,)),
                         (1, 0)))
    return out


def _layer_entries(c: DecoderConfig, layer: tuple[str, ...], ids: tuple[int, ...],
                   sparse: bool, layout: moe.ExpertLayout | None) -> list[Entry]:
    """The entries of one stack of layers (`ids`: the checkpoint's layer of each)."""
    e, h, k, d, f = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    out: list[Entry] = []

    def norm(path, name):
        out.append(Entry(layer + path + ("weight",), f"model.layers.{{i}}.{name}.weight", True,
                         (dims[path[-1]],), (0,), ids))

    dims = {"input_layernorm": (e,), "post_attention_layernorm": (e,),
            "pre_feedforward_layernorm": (e,), "post_feedforward_layernorm": (e,),
            "q_norm": (d,), "k_norm": (d,)}
    norm(("input_layernorm",), "input_layernorm")
    norm(("post_attention_layernorm",), "post_attention_layernorm")
    if c.sandwich_norms:
        norm(("pre_feedforward_layernorm",), "pre_feedforward_layernorm")
        norm(("post_feedforward_layernorm",), "post_feedforward_layernorm")
    if c.qk_norm:
        norm(("self_attn", "q_norm"), "self_attn.q_norm")
        norm(("self_attn", "k_norm"), "self_attn.k_norm")

    def dense(path, name, n_in, n_out, bias):
        # HF weight (prod(out), prod(in)) viewed as (*out, *in); ours is (*in, *out).
        no, ni = len(n_out), len(n_in)
        perm = tuple(range(no, no + ni)) + tuple(range(no))
        out.append(Entry(layer + path + ("kernel",), f"model.layers.{{i}}.{name}.weight", True,
                         (n_out, n_in), perm, ids))
        if bias:
            out.append(Entry(layer + path + ("bias",), f"model.layers.{{i}}.{name}.bias", True,
                             (n_out,), tuple(range(no)), ids))

    dense(("self_attn", "q_proj"), "self_attn.q_proj", (e,), (h, d), c.qkv_bias)
    dense(("self_attn", "k_proj"), "self_attn.k_proj", (e,), (k, d), c.qkv_bias)
    dense(("self_attn", "v_proj"), "self_attn.v_proj", (e,), (k, d), c.qkv_bias)
    dense(("self_attn", "o_proj"), "self_attn.o_proj", (h, d), (e,), c.o_bias)
    if sparse:
        dense(("mlp", "router"), moe.router_name(c.model_type, layout), (e,), (c.num_experts,),
              False)
    else:
        dense(("mlp", "gate_proj"), "mlp.gate_proj", (e,), (f,), c.mlp_bias)
        dense(("mlp", "up_proj"), "mlp.up_proj", (e,), (f,), c.mlp_bias)
        dense(("mlp", "down_proj"), "mlp.down_proj", (f,), (e,), c.mlp_bias)
    return out


# -- the files -----------------------------------------------------------------------------------


def _read(entry: Entry, tensors: dict[str, st.TensorInfo], layers: range | None,
          index: tuple[slice, ...], dtype: np.dtype) -> np.ndarray:
    """ours[index] (index without the layer axis) for each layer of `layers`, stacked."""
    view_index: list[slice] = [slice(None)] * len(entry.view_shape)
    for j, s in enumerate(index):
        view_index[entry.perm[j]] = s
    hf_index, sub, pos = [], [], 0
    for group in entry.groups:
        parts = view_index[pos:pos + len(group)]
        pos += len(group)
        if len(group) == 1:
            hf_index.append(parts[0])
            sub.append(slice(None))
        else:  # (heads, head_dim) flattened: read whole heads, then cut the inner dims
            lo, hi, _ = parts[0].indices(group[0])
            inner = math.prod(group[1:])
            hf_index.append(slice(lo * inner, hi * inner))
            sub.extend([slice(None), *parts[1:]])
    blocks = []
    for layer in (layers if layers is not None else [None]):
        info = tensors[entry.name(layer)]
        raw = st.read_slice(info, tuple(hf_index))
        shape = []
        for group, s in zip(entry.groups, hf_index, strict=True):
            n = len(range(*s.indices(math.prod(group))))
            shape.extend([n // math.prod(group[1:]), *group[1:]] if len(group) > 1 else [n])
        view = raw.reshape(shape)[tuple(sub)]
        blocks.append(np.ascontiguousarray(view.transpose(entry.perm)).astype(dtype, copy=False))
    if layers is None:
        return blocks[0]
    return blocks[0][None] if len(blocks) == 1 else np.stack(blocks)  # one layer: no copy


def _check(entry: Entry, tensors: dict[str, st.TensorInfo], c: DecoderConfig) -> None:
    for layer in entry.stack(c):
        name = entry.name(layer)
        info = tensors.get(name)
        if info is None:
            near = [n for n in tensors if n.split(".")[-2:] == name.split(".")[-2:]][:3]
            raise CheckpointError(
                f"tensor {name!r} is missing from the checkpoint, which a {c.model_type} model "
                f"with this config.json needs (tensors with the same ending: {near}).")
        if tuple(info.shape) != entry.hf_shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has shape {tuple(info.shape)}, but config.json "
                f"({c.model_type}: hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads}"
                f" of {c.head_dim}, mlp {c.intermediate_size}, vocab {c.vocab_size}) expects "
                f"{entry.hf_shape}; the weights and the config do not belong together.")


def _unused(table: list[Entry], tensors: dict[str, st.TensorInfo], c: DecoderConfig,
            experts: set[str] = frozenset()) -> None:
    known = {e.name(i) for e in table for i in e.stack(c)}
    known |= experts
    if c.tie_embeddings:
        known.add("lm_head.weight")  # some checkpoints store the tied head anyway
    extra = sorted(n for n in tensors if n not in known and not _IGNORED.search(n))
    if extra:
        raise CheckpointError(
            f"the checkpoint holds {len(extra)} tensors a {c.model_type} DecoderLM has no place "
            f"for, e.g. {extra[:4]} (in {tensors[extra[0]].file}); jaxlight loads decoder-only "
            "text models: vision towers, projectors and extra heads are not supported.")


# -- loading -------------------------------------------------------------------------------------


def from_pretrained(path: str, strategy: Any = None, *, param_dtype: Any = None,
                    dtype: Any = None, remat: Any = False) -> DecoderLM:
    """Loads a Hugging Face model directory into a `DecoderLM`, each weight in its final sharding.

    Reads `config.json` (either RoPE shape) and the safetensors files (one, or sharded with
    `model.safetensors.index.json`). Each process reads only the slices its devices hold.

    Args:
        path: the model directory.
        strategy: a jaxlight SPMD strategy or its name ("single", "dp", "fsdp", "tp", a
            `Hybrid(mesh_shape)`); set up on all devices if it is not yet. Default: "single".
        param_dtype: parameter dtype (default: the checkpoint's, e.g. bfloat16).
        dtype: compute dtype (default: the parameters').
        remat: what each layer recomputes in the backward pass (see `jaxlight.nn.Stacked`).

    Inside a `TrainModule.configure_model` (the fit traces it in a compiled function) the
    weights are read whole and the fit's strategy places them; `strategy` is then unused.
    Where the tensor-parallel degree does not divide the key/value heads (Gemma 3 1B's one
    under tp 4), their projections stay whole on every device and each head's keys and values
    are repeated `tp / heads` times (`config.kv_repeat`), as MaxText does.

    Returns:
        the model, its arrays sharded by `strategy`'s rules.

    Raises:
        CheckpointError: a file or tensor is missing, or a tensor's shape is not what config.json
            implies (the message names the file, tensor, expected and found shapes).
        ConfigurationError: a model type or RoPE type jaxlight does not support.
    """
    tensors = checkpoint_tensors(path)
    if param_dtype is None:
        stored = next(iter(tensors.values())).dtype
        param_dtype = stored if np.issubdtype(stored, np.floating) or stored.name == "bfloat16" \
            else np.float32
    config = from_hf_config(read_config(path), param_dtype=jnp.dtype(param_dtype), dtype=dtype,
                            remat=remat)
    layout = moe.detect_layout(tensors, config) if config.num_experts else None
    table = tensor_table(config, layout)
    for entry in table:
        _check(entry, tensors, config)
    _unused(table, tensors, config, layout.tensor_names(config) if layout else set())
    np_dtype = np.dtype(jnp.dtype(param_dtype))

    def read(entry, layers, index):
        return _read(entry, tensors, layers, index, np_dtype)

    if isinstance(jnp.zeros(()), jax.core.Tracer):
        # Called while JAX traces, as in a TrainModule's configure_model (the fit builds the
        # model inside a compiled function that places it by the fit's strategy).
        if layout is not None:
            raise ConfigurationError(
                f"from_pretrained({path!r}) inside configure_model: a mixture-of-experts model "
                f"({config.model_type}, {config.num_experts} experts) is not read inside the "
                "fit's compiled function yet. Load it before the fit, in the layout the fit "
                "uses: `model = from_pretrained(path, strategy)` in the TrainModule's __init__, "
                "and pass the same strategy to Fit.")
        return traced_model(config, table, read)
    strat = resolve_strategy(strategy)
    config = dataclasses.replace(config, kv_repeat=kv_repeat(config, strat))
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: DecoderLM(config, rngs=nnx.Rngs(0)))
    values = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    shardings = model_shardings(abstract, strat)
    for entry in table:
        node, spot = values, shardings
        for key in entry.path[:-1]:
            node, spot = node[key], spot[key]
        leaf = node[entry.path[-1]]
        sharding = spot[entry.path[-1]]
        node[entry.path[-1]] = _place(entry, tensors, tuple(leaf.shape), sharding, np_dtype)
    if layout is not None:
        moe.place_experts(values, shardings, tensors, layout, config, np_dtype)
    state = nnx.state(abstract, nnx.Param)
    nnx.replace_by_pure_dict(state, values)
    graphdef, _ = nnx.split(abstract)
    model = nnx.merge(graphdef, state)
    return model


def _place(entry: Entry, tensors, shape, sharding, dtype) -> jax.Array:
    """One parameter in its sharding, reading each layer's tensor once for all local shards.

    The box spanning this process's shards is read per layer (at most one Hugging Face tensor
    in host memory beyond the shards being filled), its parts copied into one buffer per
    distinct shard, and each buffer put on the devices that hold it.
    """
    local = sharding.addressable_devices_indices_map(tuple(shape))
    bounds = {d: tuple(s.indices(n)[:2] for s, n in zip(
        tuple(idx) + (slice(None),) * (len(shape) - len(idx)), shape, strict=True))
        for d, idx in local.items()}
    unique = sorted(set(bounds.values()))
    box = [(min(b[i][0] for b in unique), max(b[i][1] for b in unique))
           for i in range(len(shape))]
    buffers = {b: np.empty(tuple(hi - lo for lo, hi in b), dtype) for b in unique}
    lead = 1 if entry.stacked else 0
    inner = tuple(slice(lo, hi) for lo, hi in box[lead:])
    for layer in (range(*box[0]) if entry.stacked else [None]):
        block = _read(entry, tensors, None if layer is None else range(layer, layer + 1),
                      inner, dtype)
        for b, buffer in buffers.items():
            if layer is not None and not b[0][0] <= layer < b[0][1]:
                continue
            part = tuple(slice(lo - blo, hi - blo)
                         for (lo, hi), (blo, _) in zip(b[lead:], box[lead:], strict=True))
            if layer is None:
                buffer[...] = block[part]
            else:
                buffer[layer - b[0][0]] = block[(0, *part)]
        del block
    arrays = [jax.device_put(buffers[bounds[d]], d) for d in local]
    buffers.clear()
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


# -- saving --------------------------------------------------------------------------------------


def _param(model: nnx.Module, entry: Entry) -> Callable[[int | None], np.ndarray]:
    """A function giving the (gathered, LoRA-merged) parameter, one layer at a time."""
    parent = model
    for key in entry.path[:-1]:
        parent = getattr(parent, key)
    leaf = entry.path[-1]
    lora = None
    if not hasattr(parent, leaf) and hasattr(parent, "base"):  # a LoRA wrapper of a Dense
        lora, parent = parent, parent.base
    value = getattr(parent, leaf)[...]

    def get(layer: int | None) -> np.ndarray:
        w = value if layer is None else value[layer]
        if lora is not None and leaf == "kernel":
            a, b = lora.lora_a[...], lora.lora_b[...]
            if layer is not None:
                a, b = a[layer], b[layer]
            update = jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)
            w = (w.astype(jnp.float32) + update * lora.scale).astype(w.dtype)
        return np.asarray(distributed.gather(w))

    return get


def save_pretrained(model: DecoderLM, path: str, *, dtype: Any = None,
                    max_shard_bytes: int = 2 * 2**30, tokenizer_from: str | None = None) -> None:
    """Writes `model` as a Hugging Face model directory: config.json and safetensors.

    From any layout: each tensor is gathered alone (one layer of one parameter at a time), so a
    host holds at most one tensor beyond its shards. LoRA adapters (`LoRADense`, the `sft`
    recipe's, and the experts' `ExpertLoRA`) are merged into the weights they adapt. Only
    process 0 writes.

    Args:
        model: a `DecoderLM` (from `from_pretrained`, built from a config, or fine-tuned).
        path: the directory (created).
        dtype: the stored dtype (default: each parameter's own).
        max_shard_bytes: split the weights into files of at most this size (with
            `model.safetensors.index.json`, as transformers does).
        tokenizer_from: a model directory whose tokenizer files and chat template to copy.
    """
    config: DecoderConfig = model.config
    entries = []
    for entry in tensor_table(config):
        get = _param(model, entry)
        for layer in entry.stack(config):
            def fetch(entry=entry, get=get, layer=layer):
                ours = get(layer)
                inverse = np.argsort(entry.perm)
                return ours.transpose(inverse).reshape(entry.hf_shape)
            store = np.dtype(jnp.dtype(dtype)) if dtype is not None else np.dtype(
                _param_dtype(model, entry))
            entries.append((entry.name(layer), entry.hf_shape, store, fetch))
    if config.num_experts:
        entries += moe.save_entries(model, None if dtype is None else jnp.dtype(dtype))
    if jax.process_index() != 0:
        for *_, fetch in entries:  # every process takes part in each gather
            fetch()
        return
    os.makedirs(path, exist_ok=True)
    shards, size = [[]], 0
    for item in entries:
        nbytes = math.prod(item[1]) * item[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    for old in os.listdir(path):
        if old.endswith(".safetensors") or old == "model.safetensors.index.json":
            os.remove(os.path.join(path, old))
    if len(shards) == 1:
        st.write_lazy(os.path.join(path, "model.safetensors"), shards[0], {"format": "pt"})
    else:
        weight_map, total = {}, 0
        for n, shard in enumerate(shards, 1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            st.write_lazy(os.path.join(path, name), shard, {"format": "pt"})
            for item in shard:
                weight_map[item[0]] = name
                total += math.prod(item[1]) * item[2].itemsize
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    hf = dict(config.hf_config)
    stored = entries[0][2]
    hf["torch_dtype" if "torch_dtype" in hf else "dtype"] = {
        "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(stored.name,
                                                                                stored.name)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_from, name)
            if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(
                    os.path.join(path, name)):
                shutil.copyfile(src, os.path.join(path, name))


def _param_dtype(model: nnx.Module, entry: Entry) -> Any:
    node = model
    for key in entry.path[:-1]:
        node = getattr(node, key)
    if not hasattr(node, entry.path[-1]) and hasattr(node, "base"):
        node = node.base
    return getattr(node, entry.path[-1]).dtype
