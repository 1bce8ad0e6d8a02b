"""The experts of Qwen 3 MoE and Mixtral checkpoints: both tensor layouts in, one layout out.

Transformers stores an MoE layer's experts two ways:

- one tensor per expert (what the Hub's checkpoints hold and transformers 5 still writes):
  `model.layers.{i}.mlp.experts.{j}.{gate_proj,up_proj,down_proj}.weight` (Qwen 3 MoE) or
  `model.layers.{i}.block_sparse_moe.experts.{j}.{w1,w3,w2}.weight` (Mixtral), `(F, D)`,
  `(F, D)`, `(D, F)`;
- fused 3-D tensors (transformers 5's modules): `model.layers.{i}.mlp.experts.gate_up_proj`
  `(E, 2F, D)` (gate rows first) and `...experts.down_proj` `(E, D, F)`.

`jaxlight.nn.MoE` holds `gate`, `up` `(E, D, F)` and `down` `(E, F, D)`, stacked over layers.
Each device's shard is read straight from the files (only the experts, rows and columns it
holds, `_safetensors.read_slice`), so an `expert`-sharded model never exists whole on a host.
`save_pretrained` writes the per-expert layout, as transformers does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxlight import distributed
from jaxlight._errors import CheckpointError
from jaxlight.nn.pretrained import _safetensors as st
from jaxlight.nn.pretrained._config import DecoderConfig

#: Per family: the module prefix and the per-expert names of (gate, up, down) it saves with.
CANONICAL = {"qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
             "mixtral": ("block_sparse_moe", ("w1", "w3", "w2"))}
_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where a checkpoint keeps its experts (`detect_layout`)."""

    prefix: str
    fused: bool
    names: tuple[str, str, str]

    def router(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.prefix}.gate.weight"

    def expert(self, layer: int, expert: int, which: int) -> str:
        return (f"model.layers.{layer}.{self.prefix}.experts.{expert}."
                f"{self.names[which]}.weight")

    def fused_name(self, layer: int, which: str) -> str:
        return f"model.layers.{layer}.{self.prefix}.experts.{which}"

    def tensor_names(self, c: DecoderConfig) -> set[str]:
        if self.fused:
            return {self.fused_name(i, w) for i in c.sparse_layers
                    for w in ("gate_up_proj", "down_proj")}
        return {self.expert(i, j, w) for i in c.sparse_layers
                for j in range(c.num_experts) for w in range(3)}


def detect_layout(tensors: dict[str, st.TensorInfo], c: DecoderConfig) -> ExpertLayout:
    """The layout of the checkpoint's experts, its shapes checked against config.json."""
    found = None
    first = c.sparse_layers[0]
    for prefix in ("mlp", "block_sparse_moe"):
        if f"model.layers.{first}.{prefix}.experts.gate_up_proj" in tensors:
            found = ExpertLayout(prefix, True, _NAMES[0])
            break
        for names in _NAMES:
            if f"model.layers.{first}.{prefix}.experts.0.{names[0]}.weight" in tensors:
                found = ExpertLayout(prefix, False, names)
                break
        if found:
            break
    if found is None:
        near = sorted(n for n in tensors if n.startswith(f"model.layers.{first}.") and
                      "self_attn" not in n)[:6]
        raise CheckpointError(
            f"{c.model_type}: config.json says {c.num_experts} experts per layer, but the "
            "checkpoint has no expert tensors in either of transformers' layouts "
            f"(model.layers.{first}.mlp.experts.0.gate_proj.weight, ...block_sparse_moe.experts."
            f"0.w1.weight, or ...mlp.experts.gate_up_proj); layer {first} holds {near}.")
    e, d, f = c.num_experts, c.hidden_size, c.expert_size
    expected = {}
    for i in c.sparse_layers:
        expected[found.router(i)] = (e, d)
        if found.fused:
            expected[found.fused_name(i, "gate_up_proj")] = (e, 2 * f, d)
            expected[found.fused_name(i, "down_proj")] = (e, d, f)
        else:
            for j in range(e):
                expected[found.expert(i, j, 0)] = (f, d)
                expected[found.expert(i, j, 1)] = (f, d)
                expected[found.expert(i, j, 2)] = (d, f)
    for name, shape in expected.items():
        info = tensors.get(name)
        if info is None:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint, which a "
                                  f"{c.model_type} model with {e} experts per layer needs.")
        if tuple(info.shape) != shape:
            raise CheckpointError(
                f"{info.file}: tensor {name!r} has shape {tuple(info.shape)}, but config.json "
                f"({c.model_type}: {e} experts of width {f}, hidden {d}) expects {shape}; the "
                "weights and the config do not belong together.")
    return found


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]


def _read_block(tensors, layout: ExpertLayout, c: DecoderConfig, which: int, layer: int,
                experts: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int]
                ) -> np.ndarray:
    """ours[layer, e0:e1, r0:r1, c0:c1] of `gate` (0), `up` (1) or `down` (2)."""
    (e0, e1), (r0, r1), (c0, c1) = experts, rows, cols
    if layout.fused:
        if which == 2:  # down (E, D, F) -> ours (E, F, D)
            info = tensors[layout.fused_name(layer, "down_proj")]
            raw = st.read_slice(info, (slice(e0, e1), slice(c0, c1), slice(r0, r1)))
        else:  # gate_up (E, 2F, D), gate rows first -> ours (E, D, F)
            off = which * c.expert_size
            info = tensors[layout.fused_name(layer, "gate_up_proj")]
            raw = st.read_slice(info, (slice(e0, e1), slice(off + c0, off + c1),
                                       slice(r0, r1)))
        return raw.transpose(0, 2, 1)
    blocks = [st.read_slice(tensors[layout.expert(layer, j, which)],
                            (slice(c0, c1), slice(r0, r1))).T for j in range(e0, e1)]
    return np.stack(blocks)


def place_experts(values: dict, shardings: dict, tensors, layout: ExpertLayout,
                  c: DecoderConfig, dtype: np.dtype) -> None:
    """Fills `values["layers"]["layers"]["mlp"]` (`gate`, `up`, `down`) in their shardings,
    each device's block read from the files."""
    node, spots = values["layers"]["layers"]["mlp"], shardings["layers"]["layers"]["mlp"]
    ids = c.sparse_layers  # the checkpoint's layer of each stacked index
    for which, name in enumerate(("gate", "up", "down")):
        shape = tuple(node[name].shape)

        def read(index, which=which, shape=shape):
            (l0, l1), experts, rows, cols = _bounds(index, shape)
            return np.stack([_read_block(tensors, layout, c, which, ids[s], experts, rows,
                                         cols).astype(dtype, copy=False)
                             for s in range(l0, l1)])

        node[name] = jax.make_array_from_callback(shape, spots[name], read)


def save_entries(model: Any, dtype: Any) -> list[tuple[str, tuple, np.dtype, Any]]:
    """`(name, shape, dtype, fetch)` of every expert tensor, in transformers' per-expert
    layout, one (gathered) layer of one weight at a time, the experts' LoRA adapters (if any,
    `jaxlight.nn.ExpertLoRA`) merged: `W_e + A_e·B_e · alpha/r`."""
    c: DecoderConfig = model.config
    prefix, names = CANONICAL[c.model_type]
    layout = ExpertLayout(prefix, False, names)
    mlp = model.layers.layers.mlp
    out = []
    for which, name in enumerate(("gate", "up", "down")):
        param = getattr(mlp, name)
        store = np.dtype(dtype) if dtype is not None else np.dtype(param.dtype)
        cache: dict[int, np.ndarray] = {}

        def fetch(layer, expert, param=param, cache=cache, name=name):
            if layer not in cache:  # one layer of one weight gathered at a time
                cache.clear()
                w = param[...][layer]
                if mlp.lora is not None:
                    w = mlp.lora.merged(name, w, layer)
                cache[layer] = np.asarray(distributed.gather(w))
            return np.ascontiguousarray(cache[layer][expert].T)

        shape = tuple(param.shape[-1:] + param.shape[-2:-1])
        for s, i in enumerate(c.sparse_layers):
            for j in range(c.num_experts):
                out.append((layout.expert(i, j, which), shape, store,
                            lambda s=s, j=j, fetch=fetch: fetch(s, j)))
    return out


def router_name(model_type: str, layout: ExpertLayout | None) -> str:
    """The router's module path (`{prefix}.gate`) in a layer."""
    return f"{layout.prefix if layout else CANONICAL[model_type][0]}.gate"
