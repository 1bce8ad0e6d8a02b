"""Logical-axis rules: the one table behind DataParallel, FSDP, TensorParallel and Hybrid.

A rule maps a logical axis name to a mesh axis, a tuple of mesh axes, or None (replicated). The
first rule naming an axis wins, so user rules go in front of the defaults. Mesh axes of size 1
(or absent) drop out, which is why one table serves every mesh, as in MaxText:

| logical name | meaning | default mesh axes |
|---|---|---|
| `layers` | stacked-layers axis of `jaxlight.nn.Stacked` | None (GPipe: `pipe`) |
| `vocab` | vocabulary rows of an embedding / output head | `tp` |
| `embed` | model width of a weight | `fsdp` |
| `mlp` | hidden width of an MLP | `tp` |
| `heads` | attention heads | `tp` |
| `kv` | per-head width | None |
| `norm` | norm scales | None |
| `batch` | activation batch | `data`, `fsdp` |
| `length` | activation sequence | None |
| `activation_embed` | activation model width | None |
| `activation_heads`, `activation_mlp`, `activation_vocab` | sharded activations | `tp` |
| `activation_kv` | activation per-head width | None |

Activation names are only used by `constrain` (sharding constraints inside the model); the
parameter names decide where weights, gradients and optimizer state live.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlight._errors import ConfigurationError

#: The default rules table shared by every SPMD strategy (see the module docstring).
DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # parameters
    ("layers", None),
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("mlp", "tp"),
    ("heads", "tp"),
    ("kv", None),
    ("norm", None),
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("activation_embed", None),
    ("activation_heads", "tp"),
    ("activation_kv", None),
    ("activation_mlp", "tp"),
    ("activation_vocab", "tp"),
)

#: Logical names that only label activations (never reported as unused rules).
ACTIVATION_NAMES = frozenset(
    {"batch", "length"} | {n for n, _ in DEFAULT_RULES if n.startswith("activation_")}
)


def normalize_rules(rules: Mapping[str, Any] | Sequence | None, who: str) -> tuple:
    """Rules as a tuple of `(logical_name, target)` pairs; accepts a dict or a sequence."""
    if rules is None:
        return ()
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    out = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise ConfigurationError(
                f"{who}: a rule must be a pair (logical_name, mesh_axes), got {item!r}; for "
                "example rules=[('mlp', 'tp'), ('embed', None)] or {'mlp': 'tp'}."
            )
        name, target = item
        if isinstance(target, list):
            target = tuple(target)
        out.append((name, target))
    return tuple(out)


def parse_mesh_shape(mesh_shape: Any, who: str) -> dict[str, int]:
    """Accepts `{"data": 2, "fsdp": -1}` or the Tunix form `[[2, -1], ["data", "fsdp"]]`.

    Refuses duplicate names, mismatched lengths and more than one `-1` (sizes are checked
    against the devices in `setup`).
    """
    if isinstance(mesh_shape, Mapping):
        shape = {str(k): v for k, v in mesh_shape.items()}
    elif (isinstance(mesh_shape, Sequence) and len(mesh_shape) == 2
          and all(isinstance(part, Sequence) and not isinstance(part, str) for part in mesh_shape)):
        sizes, names = list(mesh_shape[0]), list(mesh_shape[1])
        if len(sizes) != len(names):
            raise ConfigurationError(
                f"{who}: mesh_shape {mesh_shape!r} has {len(sizes)} sizes but {len(names)} axis "
                "names; give one size per name, as in [[2, 4], ['data', 'fsdp']]."
            )
        if len(set(names)) != len(names):
            raise ConfigurationError(f"{who}: mesh_shape {mesh_shape!r} repeats an axis name.")
        shape = {str(n): s for s, n in zip(sizes, names, strict=True)}
    else:
        raise ConfigurationError(
            f"{who}: mesh_shape must be a dict like {{'data': 2, 'fsdp': -1}} or the pair "
            f"[[2, -1], ['data', 'fsdp']], got {mesh_shape!r}."
        )
    if not shape:
        raise ConfigurationError(f"{who}: mesh_shape is empty; name at least one axis.")
    for name, size in shape.items():
        if size != -1 and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigurationError(
                f"{who}: mesh axis {name!r} has size {size!r}; sizes are positive integers or -1."
            )
    free = [n for n, s in shape.items() if s == -1]
    if len(free) > 1:
        raise ConfigurationError(
            f"{who}: mesh_shape {shape} has {len(free)} axes set to -1 ({free}); at most one "
            "axis may be -1 (it fills the remaining devices)."
        )
    return shape


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


def _lookup(rules: Sequence, name: str | None) -> tuple[str, ...]:
    if name is None:
        return ()
    for rule_name, target in rules:
        if rule_name == name:
            if target is None:
                return ()
            return (target,) if isinstance(target, str) else tuple(target)
    return ()


def logical_to_spec(mesh: Mesh, rules: Sequence, names: Sequence[str | None],
                    shape: Sequence[int]) -> PartitionSpec:
    """A PartitionSpec for an activation; axes that do not divide its dimension are dropped."""
    used: set[str] = set()
    spec: list[Any] = []
    for dim, name in zip(shape, names, strict=True):
        axes = [a for a in _lookup(rules, name) if mesh.shape.get(a, 1) > 1 and a not in used]
        # Keep the longest prefix of axes that divides the dimension (a size-1 eval batch, say).
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes.pop()
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else (tuple(axes) or None))
    return PartitionSpec(*spec)


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
        raise ValueError(f"constrain: {len(names)} names {tuple(names)} for a {x.ndim}-d array.")
    spec = logical_to_spec(mesh, rules, names, x.shape)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@contextlib.contextmanager
def spmd_context(mesh: Mesh, rules: Sequence = ()) -> Iterator[None]:
    """The mesh (`jax.set_mesh`) plus activation rules, active while an SPMD step is traced."""
    with jax.set_mesh(mesh), activation_sharding(mesh, rules):
        yield
