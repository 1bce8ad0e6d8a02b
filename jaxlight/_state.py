"""The train state: one pytree, created abstractly first and then directly in its shards."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxlight._errors import ConfigurationError


@flax.struct.dataclass
class TrainState:
    """Everything a training step reads and writes.

    Attributes:
        step: optimizer steps taken (int32 scalar).
        params: the trainable variables as a plain nested dict of arrays.
        opt_state: the optax state.
        rest: the model's other variables (batch statistics, RNG state, frozen weights).
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rest: Any


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What is known about a module's model before any array exists."""

    graphdef: Any  # train-mode graph
    eval_graphdef: Any  # the same graph after model.eval()
    abstract_state: TrainState  # ShapeDtypeStructs
    logical_axes: TrainState  # a tuple of logical names (or None) per leaf
    # Per leaf of `rest`, True for an `nnx.Param` the module does not train (a LoRA module's
    # base weights): checkpoints skip these, configure_model rebuilds them.
    frozen: Any = None


class _Axes:
    """Logical axis names, as an opaque (non-pytree) leaf so tuples survive tree maps."""

    __slots__ = ("names",)

    def __init__(self, names):
        self.names = names


def logical_names(state: nnx.State) -> Any:
    """Per leaf, the logical axis names from `nnx.with_partitioning`, or None."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))

    def one(spec, leaf):
        names = tuple(spec) if isinstance(spec, PartitionSpec) else ()
        ndim = len(getattr(leaf, "shape", ()))
        if not any(n is not None for n in names):
            return None
        return names + (None,) * (ndim - len(names))

    return jax.tree.map(
        one, specs, nnx.to_pure_dict(state), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def frozen_mask(rest_state: nnx.State) -> Any:
    """Per leaf of `rest` (as a pure dict), whether it is an `nnx.Param` (one not trained)."""
    return nnx.to_pure_dict(jax.tree.map(lambda v: isinstance(v, nnx.Param), rest_state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))


def split_model(model: nnx.Module, trainable: Any) -> tuple[Any, dict, dict]:
    graphdef, params, rest = nnx.split(model, trainable, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


def build_model(module, rngs_seed: int) -> nnx.Module:
    # Sharding is applied by jaxlight from the annotations, not eagerly by Flax (which would
    # need a mesh context and know nothing of our rules table).
    with nnx.use_eager_sharding(False):
        return module.configure_model(nnx.Rngs(rngs_seed))


def abstract_model(module, seed: int = 0) -> tuple[nnx.Module, Any, nnx.State, nnx.State]:
    """The one abstract build of a module's model (`nnx.eval_shape`: shapes, no arrays).

    Returns `(abstract_model, graphdef, params_state, rest_state)`, split by
    `module.trainable`. Used for the train state (`model_spec`) and for loading checkpoints.
    """
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: module.configure_model(nnx.Rngs(seed)))
    if not isinstance(abstract, nnx.Module):
        raise ConfigurationError(
            f"{type(module).__name__}.configure_model returned {type(abstract).__name__}; it must "
            "return an nnx.Module built with the rngs it is given."
        )
    graphdef, params_state, rest_state = nnx.split(abstract, module.trainable, ...)
    return abstract, graphdef, params_state, rest_state


def model_spec(module, tx: optax.GradientTransformation, seed: int,
               params_transform=None) -> ModelSpec:
    """Builds the model abstractly (`abstract_model`): shapes, logical axes, no arrays.

    `params_transform` (from `Callback.transform_params`) maps the initialized parameters to
    their stored form (dtypes); it must keep the tree structure and shapes.
    """
    abstract, graphdef, params_state, rest_state = abstract_model(module, seed)
    if not jax.tree.leaves(params_state):
        raise ConfigurationError(
            f"{type(module).__name__}'s model has no variables of the trainable type "
            f"{module.trainable}: nothing to optimize."
        )
    abstract.eval()
    eval_graphdef, _, _ = nnx.split(abstract, module.trainable, ...)
    abstract.train()

    params = nnx.to_pure_dict(params_state)
    rest = nnx.to_pure_dict(rest_state)
    if params_transform is not None:
        params = jax.eval_shape(params_transform, params)
    abs_opt = jax.eval_shape(tx.init, params)
    param_axes = logical_names(params_state)
    wrapped = jax.tree.map(_Axes, param_axes, is_leaf=lambda x: x is None or isinstance(x, tuple))
    opt_axes = optax.tree_map_params(
        tx,
        lambda _, axes: axes,
        abs_opt,
        wrapped,
        transform_non_params=lambda _: _Axes(None),
        is_leaf=lambda x: isinstance(x, _Axes),
    )
    opt_axes = jax.tree.map(lambda a: a.names, opt_axes, is_leaf=lambda x: isinstance(x, _Axes))
    abstract_state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=abs_opt, rest=rest
    )
    logical = TrainState(step=None, params=param_axes, opt_state=opt_axes,
                         rest=logical_names(rest_state))
    return ModelSpec(graphdef, eval_graphdef, abstract_state, logical, frozen_mask(rest_state))


def make_init_fn(module, tx: optax.GradientTransformation, seed: int, params_transform=None):
    """A pure function creating the real TrainState; jit it with the target out_shardings."""

    def init() -> TrainState:
        _, params, rest = split_model(build_model(module, seed), module.trainable)
        if params_transform is not None:
            params = params_transform(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=tx.init(params), rest=rest)

    return init
