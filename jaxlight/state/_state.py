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
    opt_axes = opt_state_axes(abs_opt, params, param_axes)
    abstract_state = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32), params=params, opt_state=abs_opt, rest=rest
    )
    logical = TrainState(step=None, params=param_axes, opt_state=opt_axes,
                         rest=logical_names(rest_state))
    return ModelSpec(graphdef, eval_graphdef, abstract_state, logical, frozen_mask(rest_state))


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _is_axes(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and not _is_masked(x))


def opt_state_axes(abstract_opt: Any, params: Any, param_axes: Any) -> Any:
    """The logical axes of `abstract_opt` (mirrors it; a tuple of names or None per leaf).

    Logical axes of an optimizer state: each slot sharded like the parameter it covers.

    An optax state holds copies of the parameter tree (Adam's `mu` and `nu`, momentum's `trace`)
    beside scalars (`count`). Partitioned transformations (`optax.multi_transform`,
    `optax.partition`, `optax.masked`) keep the same copies with `optax.MaskedNode` where a
    parameter belongs to another partition. `opt_state_axes` finds every subtree shaped like the
    parameters (MaskedNode counting as a leaf) and gives each of its arrays the logical axes of
    the parameter at the same position when the shapes agree; every other leaf (counts, a
    factored second moment of another shape, a scheduler's scalars) gets None (replicated).

    This reads the abstract state only, so it works for any transformation (`optax.tree_map_params`
    re-runs `init` on a placeholder, which a `multi_transform` with a labelling function cannot
    take, and cannot place a MaskedNode).

    Args:
        abstract_opt: the optimizer state as ShapeDtypeStructs (`jax.eval_shape(tx.init, p)`).
        params: the parameters the state was made for (ShapeDtypeStructs or arrays).
        param_axes: per leaf of `params`, its logical names (a tuple) or None.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> p = {"a": jax.ShapeDtypeStruct((4, 2), jnp.float32),
        ...      "b": jax.ShapeDtypeStruct((2,), jnp.float32)}
        >>> tx = optax.masked(optax.adam(1e-3), {"a": True, "b": False})
        >>> axes = opt_state_axes(jax.eval_shape(tx.init, p), p, {"a": ("embed", "mlp"),
        ...                                                        "b": None})
        >>> axes.inner_state[0].mu
        {'a': ('embed', 'mlp'), 'b': MaskedNode()}
    """
    params_def = jax.tree.structure(params)
    param_leaves = params_def.flatten_up_to(params)
    axes_leaves = params_def.flatten_up_to(param_axes)

    def shaped_like_params(node: Any) -> list | None:
        """`node`'s leaves (MaskedNodes included) when its structure is the parameters'."""
        leaves, treedef = jax.tree.flatten(node, is_leaf=_is_masked)
        return leaves if treedef == params_def else None

    def one(leaf: Any, param: Any, axes: Any) -> Any:
        if _is_masked(leaf):
            return leaf
        same = tuple(getattr(leaf, "shape", ())) == tuple(getattr(param, "shape", ()))
        return axes if same else None

    def walk(node: Any) -> Any:
        if _is_masked(node):
            return node
        children, treedef = jax.tree.flatten(node, is_leaf=lambda x: x is not node)
        if jax.tree_util.treedef_is_leaf(treedef):
            # an array outside any parameter-shaped tree, or an empty node (EmptyState)
            return None if children else node
        leaves = shaped_like_params(node)
        if leaves:
            return params_def.unflatten(
                [one(x, p, a) for x, p, a in zip(leaves, param_leaves, axes_leaves,
                                                 strict=True)])
        return treedef.unflatten([walk(c) for c in children])

    return walk(abstract_opt)


class StateInit:
    """Creates the real TrainState (jit it with the target out_shardings): `init()` all of it in
    one function, or in two parts that strategies compile apart (`SpmdStrategy.init_state`):
    `init_model()`, the state without its optimizer state (`opt_state=None`), then
    `init_optimizer(params)`, the optimizer state of those parameters.

    One compiled call holds the parameters' initialization temporaries (random bits, the
    normal transform) and the whole optimizer state at once; two hold at most the state.
    """

    def __init__(self, module, tx: optax.GradientTransformation, seed: int,
                 params_transform=None):
        self.module, self.tx, self.seed = module, tx, seed
        self.params_transform = params_transform

    def init_model(self) -> TrainState:
        _, params, rest = split_model(build_model(self.module, self.seed), self.module.trainable)
        if self.params_transform is not None:
            params = self.params_transform(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=None,
                          rest=rest)

    def init_optimizer(self, params: Any) -> Any:
        return self.tx.init(params)

    def __call__(self) -> TrainState:
        state = self.init_model()
        return state.replace(opt_state=self.init_optimizer(state.params))


def make_init_fn(module, tx: optax.GradientTransformation, seed: int,
                 params_transform=None) -> StateInit:
    """A pure function creating the real TrainState (a `StateInit`)."""
    return StateInit(module, tx, seed, params_transform)
