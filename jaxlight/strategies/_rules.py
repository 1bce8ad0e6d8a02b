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

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import yaml

from jaxlight._errors import ConfigurationError, suggest

# The lookup and the activation constraints live in the leaf `jaxlight._layout` (jaxlight.nn
# uses them too); they are re-exported here, next to the rules they read.
from jaxlight._layout import (  # noqa: F401
    activation_sharding,
    axes_of,
    constrain,
    is_axes,
    logical_to_spec,
    partition_spec,
    rule_axes,
    spmd_context,
)

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


# -- mesh shapes: the one grammar (Python, CLI flags, YAML) -----------------------------------

#: Mesh axes, outermost first: data-parallel axes outside so that their collectives cross the
#: slowest links, tensor parallelism innermost (fastest links).
MESH_AXES = ("data", "pipe", "fsdp", "tp")

#: Other names for mesh axes (the seeds' and other frameworks' spellings), accepted everywhere.
AXIS_ALIASES = {"model": "tp", "tensor": "tp", "pipeline": "pipe", "stage": "pipe"}

MESH_FORMS = """accepted forms of a mesh shape:
  {"data": 4, "tp": 2}          a mapping of axis name to size (also as JSON or YAML text)
  'data=4,tp=2'                 axis=size pairs
  [[4, 2], ["data", "tp"]]      the Tunix form: [sizes, axis names] (also as text)
one size may be -1 (it fills the remaining devices); mesh axes: data, pipe, fsdp, tp
(aliases: model -> tp, tensor -> tp, pipeline -> pipe, stage -> pipe)"""


def _parse_text(text: str, who: str) -> Any:
    """A mesh shape given as text: `data=4,tp=2`, or JSON/YAML of a mapping or the pair form."""
    text = text.strip()
    bad = f"{who}: mesh shape {text!r} does not parse"
    if not text:
        raise ConfigurationError(f"{bad}: it is empty.\n{MESH_FORMS}")
    if "=" in text and text[0] not in "{[":
        shape = {}
        for pair in text.split(","):
            name, eq, size = pair.partition("=")
            if not eq or not name.strip():
                raise ConfigurationError(f"{bad}: {pair.strip()!r} is not axis=size.\n{MESH_FORMS}")
            try:
                shape[name.strip()] = int(size)
            except ValueError:
                raise ConfigurationError(
                    f"{bad}: size {size.strip()!r} of axis {name.strip()!r} is not an integer."
                    f"\n{MESH_FORMS}"
                ) from None
        return shape
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigurationError(
            f"{bad}: {getattr(err, 'problem', None) or err}.\n{MESH_FORMS}") from None


def _is_pair_form(value: Any) -> bool:
    return (isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2
            and all(isinstance(part, Sequence) and not isinstance(part, str) for part in value))


def parse_mesh_shape(mesh_shape: str | Sequence | Mapping, who: str = "mesh_shape"
                     ) -> dict[str, int]:
    """The one mesh-shape grammar: `{"data": 2, "fsdp": -1}`, the Tunix form
    `[[2, -1], ["data", "fsdp"]]` (or `[names, sizes]`), or either as text (JSON/YAML), or
    `"data=2,fsdp=-1"`. Axis aliases (`model` -> `tp`, `pipeline` -> `pipe`) become the real
    names.

    Refuses unknown axes, duplicate names, mismatched lengths, sizes that are not positive
    integers or -1, and more than one `-1` (sizes are checked against the devices by
    `fill_mesh_shape` in `setup`).

    Example:
        >>> parse_mesh_shape([[4, 2], ["fsdp", "model"]])
        {'fsdp': 4, 'tp': 2}
        >>> parse_mesh_shape("data=2,fsdp=-1")
        {'data': 2, 'fsdp': -1}
    """
    value = _parse_text(mesh_shape, who) if isinstance(mesh_shape, str) else mesh_shape
    if isinstance(value, Mapping):
        pairs = [(k, v) for k, v in value.items()]
    elif _is_pair_form(value):
        sizes, names = list(value[0]), list(value[1])
        if all(isinstance(s, str) for s in sizes) and not all(isinstance(n, str) for n in names):
            sizes, names = names, sizes  # [[names], [sizes]] is unambiguous too
        if len(sizes) != len(names):
            raise ConfigurationError(
                f"{who}: mesh_shape {mesh_shape!r} has {len(sizes)} sizes but {len(names)} axis "
                "names; give one size per name, as in [[2, 4], ['data', 'fsdp']]."
            )
        pairs = list(zip(names, sizes, strict=True))
    else:
        raise ConfigurationError(
            f"{who}: mesh_shape must be a dict like {{'data': 2, 'fsdp': -1}} or the pair "
            f"[[2, -1], ['data', 'fsdp']], got {mesh_shape!r}.\n{MESH_FORMS}"
        )
    if not pairs:
        raise ConfigurationError(f"{who}: mesh_shape is empty; name at least one axis.")
    shape: dict[str, int] = {}
    for name, size in pairs:
        if not isinstance(name, str):
            raise ConfigurationError(
                f"{who}: mesh axis name {name!r} in {mesh_shape!r} is not a string; axis names "
                f"are {list(MESH_AXES)}.")
        axis = AXIS_ALIASES.get(name, name)
        if axis not in MESH_AXES:
            raw = dict(pairs)
            raise ConfigurationError(
                f"{who}: unknown mesh axis {name!r} in {raw}; valid axes are {list(MESH_AXES)}."
                f"{suggest(name, [*MESH_AXES, *AXIS_ALIASES])}"
            )
        if axis in shape:
            raise ConfigurationError(
                f"{who}: mesh_shape {mesh_shape!r} repeats an axis name ({axis!r}"
                + (f", given as {name!r}" if name != axis else "") + ")."
            )
        if size != -1 and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigurationError(
                f"{who}: mesh axis {name!r} has size {size!r}; sizes are positive integers or -1."
            )
        shape[axis] = size
    free = [n for n, s in shape.items() if s == -1]
    if len(free) > 1:
        raise ConfigurationError(
            f"{who}: mesh_shape {shape} has {len(free)} axes set to -1 ({free}); at most one "
            "axis may be -1 (it fills the remaining devices)."
        )
    return shape


def fill_mesh_shape(shape: Mapping[str, int], num_devices: int, who: str) -> dict[str, int]:
    """Resolves the one `-1` axis of a parsed shape and checks the mesh covers the devices."""
    shape = dict(shape)
    free = [name for name, size in shape.items() if size == -1]
    known = math.prod(s for s in shape.values() if s != -1)
    if free:
        if num_devices % known:
            raise ConfigurationError(
                f"{who}: cannot fill axis {free[0]!r}: the other axes use {known} devices, which "
                f"does not divide the {num_devices} devices available."
            )
        shape[free[0]] = num_devices // known
    total = math.prod(shape.values())
    if total != num_devices:
        where = jax.devices()[0].platform
        if jax.process_count() > 1:  # name the layout: the mesh spans every process's devices
            where += (f"; {jax.process_count()} processes x {jax.local_device_count()} local "
                      "devices")
        raise ConfigurationError(
            f"{who}: mesh_shape {shape} has {total} devices but {num_devices} are available "
            f"({where}). Make the product of the axes {num_devices}, or set "
            "one axis to -1 to fill the rest."
        )
    return shape
