"""The one logical-axis lookup and the one batch-divisibility check, shared by every layout.

A leaf module (it imports no other part of jaxlight but its errors), so that the strategies,
`jaxlight.nn` and the microbatch layouts all use the same functions without import cycles:

- `partition_spec`: logical axis names -> a `PartitionSpec` through a rules table, refusing a
  dimension its mesh axes do not divide (`ShardingError` with the path, the dimension, the
  axes and their sizes). Parameters (`SpmdStrategy.spec_for`), activation constraints
  (`constrain`) and the collective matmuls (`rule_axes`) all go through it.
- `match_path`: the first path rule of a rules table that matches a parameter's path, which
  gives the parameter its logical axes for `partition_spec` (the table's logical rules then
  map them to mesh axes).
- `require_divisible`: a batch whose leading dimension a degree does not divide is refused
  (`DataError` with the leaf, the sizes and a batch size that works).
- `constrain` / `activation_sharding` / `spmd_context`: activation sharding constraints by
  logical names while an SPMD step is traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlight._errors import DataError, ShardingError

# -- the one logical-axis lookup -----------------------------------------------------------


def is_axes(x) -> bool:
    """True for a tuple of logical axis names (str or None), the leaves of a logical tree."""
    return type(x) is tuple and all(n is None or isinstance(n, str) for n in x)


def axes_of(target: Any) -> tuple[str, ...]:
    """A rule's target (None, one mesh axis, or a tuple of them) as a tuple of mesh axes."""
    if target is None:
        return ()
    if isinstance(target, str):
        return (target,)
    return tuple(target)


def rule_axes(rules: Sequence, name: str | None) -> tuple[str, ...]:
    """The mesh axes the first rule naming the logical axis `name` maps it to (() if none)."""
    if name is None:
        return ()
    for rule_name, target in rules:
        if rule_name == name:  # path rules (compiled patterns) never equal a name
            return axes_of(target)
    return ()


class PathRule(tuple):
    """A path rule `(pattern, axes)`: a compiled regular expression and one name per dimension.

    A plain 2-tuple (so a rules table iterates as `(key, target)` pairs) that also remembers the
    ready-made rule set it came from (`group`), so that a set warns as a whole, not per rule,
    when it matches nothing.
    """

    group: str | None

    def __new__(cls, pattern: str | re.Pattern, axes, group: str | None = None) -> PathRule:
        self = super().__new__(cls, (re.compile(pattern), tuple(axes)))
        self.group = group
        return self

    @property
    def pattern(self) -> re.Pattern:
        return self[0]

    @property
    def axes(self) -> tuple:
        return self[1]

    def __repr__(self) -> str:
        text = self[0].pattern
        quote = '"' if "'" in text else "'"
        shown = f"r{quote}{text}{quote}" if quote not in text else repr(text)
        return f"({shown}, {self[1]!r})"

    def __reduce__(self):
        return (PathRule, (self[0].pattern, self[1], self.group))


def match_path(rules: Sequence, path: str, ndim: int) -> tuple[int, tuple] | None:
    """`(index, axes)` of the first path rule in `rules` found in `path` for an `ndim`-d array.

    A path rule is a pair `(compiled pattern, axes)`; it matches when `pattern.search(path)`
    finds the pattern and `axes` has one entry per dimension (so rules for 2-d and 3-d kernels
    of the same name can sit side by side). Scalars match no rule.

    Example:
        >>> import re
        >>> rules = [("mlp", "tp"), (re.compile(r"kernel"), (None, "mlp"))]
        >>> match_path(rules, "['l1']['kernel']", 2), match_path(rules, "['l1']['bias']", 1)
        ((1, (None, 'mlp')), None)
    """
    if ndim == 0:
        return None
    for i, (key, target) in enumerate(rules):
        if isinstance(key, re.Pattern) and len(target) == ndim and key.search(path):
            return i, tuple(target)
    return None


def partition_spec(mesh_shape: Mapping[str, int], rules: Sequence, shape: Sequence[int],
                   logical: Sequence[str | None] | None, *, path: str,
                   what: str = "parameter", source: str = "") -> PartitionSpec:
    """The PartitionSpec of one array from its logical axes: the one lookup every layout uses.

    Each dimension's logical name maps through `rules` (first match wins) to mesh axes; axes of
    size 1 (or absent from the mesh) and axes an earlier dimension already uses drop out. A
    dimension the remaining axes do not divide raises `ShardingError` naming `what` and
    `path`, the dimension, the axes and their sizes (and `source`, what gave the array its
    logical axes, such as a path rule).

    Example:
        >>> partition_spec({"fsdp": 4, "tp": 2}, [("embed", "fsdp"), ("mlp", "tp")], (8, 6),
        ...                ("embed", "mlp"), path="['w']")
        P('fsdp', 'tp')
    """
    shape = tuple(shape)
    logical = tuple(logical) if logical else (None,) * len(shape)
    if len(logical) != len(shape):
        raise ShardingError(
            f"{what} {path} has shape {shape} but {len(logical)} logical axes {logical}; "
            "give one name (or None) per dimension in nnx.with_partitioning."
        )
    used: set[str] = set()
    spec: list[Any] = []
    for i, (dim, name) in enumerate(zip(shape, logical, strict=True)):
        axes = tuple(a for a in rule_axes(rules, name)
                     if mesh_shape.get(a, 1) > 1 and a not in used)
        size = math.prod(mesh_shape[a] for a in axes)
        if dim % size:
            sizes = ", ".join(f"{a}={mesh_shape[a]}" for a in axes)
            origin = f", from {source}" if source else ""
            raise ShardingError(
                f"{what} {path}: dimension of size {dim} (logical axis {name!r}{origin}) is not "
                f"divisible by mesh axes {axes} of total size {size} ({sizes}; dimension {i} of "
                f"shape {shape}). Change the model dimension to a multiple of {size}, or map "
                f"{name!r} to another axis with rules=[({name!r}, None), ...]"
                + (", or give this path its own rule in front" if source else "") + "."
            )
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (axes or None))
    return PartitionSpec(*spec)



# -- the one batch-divisibility check -------------------------------------------------------


def require_divisible(abstract_batch: Any, what: str, need: int, divisor: Callable[[], str],
                      advice: str = "", *, scale: int = 1,
                      scalar_reason: str = "every batch leaf needs a leading batch dimension"
                      ) -> None:
    """Refuses a scalar batch leaf, or one whose global leading dimension `need` does not divide.

    Args:
        abstract_batch: the batch (arrays, tracers or ShapeDtypeStructs).
        what: what the batch is ("batch", "validate batch", ...), for the message.
        need: the number the global batch size must be a multiple of.
        divisor: says what `need` is (called only for the message).
        advice: ends the message (", or change k").
        scale: global rows per row of a leaf (the replica count when a leaf is one replica's
            share, as inside DDP's pmap).
        scalar_reason: why a scalar leaf is refused.
    """
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_batch):
        if not np.shape(leaf):
            raise DataError(
                f"{what} leaf {jax.tree_util.keystr(path)} is a scalar; {scalar_reason}."
            )
        size = np.shape(leaf)[0] * scale
        if size % need:
            lower, upper = size - size % need, size - size % need + need
            example = f"{lower} or {upper}" if lower else f"{upper}"
            error = DataError(
                f"global {what} size {size} (leaf {jax.tree_util.keystr(path)}) is not "
                f"divisible by {divisor()}. Use a batch size that is a multiple of {need} "
                f"(for example {example}){advice}."
            )
            error.need, error.divisor = need, divisor()  # for a caller's own message
            raise error


# -- activation sharding constraints --------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, tuple] | None] = contextvars.ContextVar(
    "jaxlight_activation_rules", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules: Sequence = ()) -> Iterator[None]:
    """Makes `constrain` map logical names with `rules` on `mesh` while a step is traced.

    `activation_sharding(None)` switches constraints off (inside `shard_map`, for example).
    """
    token = _ACTIVE.set((mesh, tuple(rules)) if mesh is not None and rules else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_layout() -> tuple[Mesh, tuple] | None:
    """(mesh, rules) of the SPMD step being traced, or None outside one (layers that place
    their own collectives, such as the mixture-of-experts dispatch, read it)."""
    return _ACTIVE.get()


def logical_to_spec(mesh: Mesh, rules: Sequence, names: Sequence[str | None],
                    shape: Sequence[int]) -> PartitionSpec:
    """A PartitionSpec for an activation, by `partition_spec`.

    A dimension of size 1 stays unsharded (a batch of one example);
    any other dimension its axes do not divide raises `ShardingError`.
    """
    names = [None if dim == 1 else name for dim, name in zip(shape, names, strict=True)]
    return partition_spec(dict(mesh.shape), rules, shape, names,
                          path=f"of shape {tuple(shape)} (constrain {tuple(names)})",
                          what="activation")


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Constrains an activation's sharding by logical names; identity outside an SPMD step.

    Example:
        >>> import jax.numpy as jnp
        >>> constrain(jnp.ones((2, 3)), ("batch", "activation_embed")).shape
        (2, 3)
    """
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    if len(names) != x.ndim:
        raise ShardingError(f"constrain: {len(names)} names {tuple(names)} for a {x.ndim}-d array "
                            f"of shape {x.shape}; give one logical name (or None) per dimension.")
    spec = logical_to_spec(mesh, rules, names, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@contextlib.contextmanager
def spmd_context(mesh: Mesh, rules: Sequence = ()) -> Iterator[None]:
    """The mesh (`jax.set_mesh`) plus activation rules, active while an SPMD step is traced."""
    with jax.set_mesh(mesh), activation_sharding(mesh, rules):
        yield
