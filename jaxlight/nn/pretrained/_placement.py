"""Where `from_pretrained`'s weights go: the strategy (a name or an object), each parameter's
sharding, key/value heads replicated over a tensor-parallel degree that does not divide them,
and the whole-model read for a call inside a JAX trace (`TrainModule.configure_model`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlight import strategies
from jaxlight._errors import ConfigurationError
from jaxlight.nn.pretrained._config import DecoderConfig
from jaxlight.nn.pretrained._model import DecoderLM
from jaxlight.sharding._layout import rule_axes
from jaxlight.state._state import TrainState, logical_names


def resolve_strategy(strategy: Any):
    strat = strategies.resolve(strategy if strategy is not None else "single")
    if getattr(strat, "mesh", None) is None:
        strat.setup()
    if not hasattr(strat, "spec_for"):
        raise ConfigurationError(
            f"from_pretrained places weights with an SPMD strategy (single, dp, fsdp, tp, "
            f"Hybrid); {type(strat).__name__} keeps its own copies per device. Load with "
            "strategy='dp' for data parallelism.")
    return strat


def model_shardings(model: nnx.Module, strategy: Any) -> Any:
    """The strategy's sharding of every `nnx.Param` of `model` (a pure dict), from its rules."""
    state = nnx.state(model, nnx.Param)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            nnx.to_pure_dict(state))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    shardings = strategy.state_shardings(
        TrainState(scalar, abstract, (), {}),
        TrainState(None, logical_names(state), (), {}))
    return shardings.params



def kv_repeat(config: DecoderConfig, strategy: Any) -> int:
    """How many times each key/value head's keys and values are repeated so that the
    tensor-parallel degree divides them (1: it already does), as MaxText does: Gemma 3 1B's
    one key/value head under tp 4 is computed whole on every device and repeated 4 times."""
    mesh = dict(strategy.mesh.shape)
    tp = math.prod(mesh.get(a, 1) for a in rule_axes(strategy.rules, "heads"))
    k, h = config.num_kv_heads, config.num_heads
    if k % tp == 0:
        return 1
    if tp % k or h % tp:
        raise ConfigurationError(
            f"tensor parallelism of degree {tp} (the mesh axes of 'heads') splits neither the "
            f"{k} key/value heads nor, by replicating them, the {h} query heads: pick a degree "
            f"that divides {k}, or one that {k} divides and that divides {h}.")
    return tp // k


def stored_shape(entry) -> tuple[int, ...]:
    """One layer's shape of the parameter as the checkpoint holds it."""
    return tuple(entry.view_shape[p] for p in entry.perm)


def traced_model(config: DecoderConfig, table: Sequence, read: Callable) -> DecoderLM:
    """The model with every weight read whole into the program being traced: the fit's
    compiled initialization places them by its strategy's out-shardings (the random
    initialization they replace is dead code XLA drops). The checkpoint's bytes become
    constants of that program, as `nnx.update` with host arrays in `configure_model` does."""
    with nnx.use_eager_sharding(False):
        model = DecoderLM(config, rngs=nnx.Rngs(0))
    values = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for entry in table:
        node = values
        for key in entry.path[:-1]:
            node = node[key]
        layers = entry.stack(config) if entry.stacked else None
        whole = tuple(slice(None) for _ in stored_shape(entry))
        node[entry.path[-1]] = jnp.asarray(read(entry, layers, whole))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(nnx.split(model)[0], state)


def kv_config(config: DecoderConfig, strategy: Any) -> DecoderConfig:
    """`config` with the `kv_repeat` that `strategy` needs (`kv_repeat`), as `from_pretrained`
    loads it: for a module that builds a `DecoderLM` itself in `configure_model` (the weights'
    shapes do not change). Without a strategy or a mesh, unchanged."""
    if strategy is None or getattr(strategy, "mesh", None) is None or config.kv_repeat > 1:
        return config
    return dataclasses.replace(config, kv_repeat=kv_repeat(config, strategy))
