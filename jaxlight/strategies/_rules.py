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
| `expert` | the experts of a mixture-of-experts layer | `expert` |
| `batch` | activation batch | `fsdp`, `data`, `expert` |
| `length` | activation sequence | `context` (context parallelism) |
| `activation_embed` | activation model width | None |
| `activation_heads`, `activation_mlp`, `activation_vocab` | sharded activations | `tp` |
| `activation_kv` | activation per-head width | None |

| `data`, `pipe`, `fsdp`, `context`, `expert`, `tp` | a mesh axis named directly | itself |

Activation names are only used by `constrain` (sharding constraints inside the model); the
parameter names decide where weights, gradients and optimizer state live. The mesh-axis rows let
an annotation or a path rule name a mesh axis instead of a logical name.

The same table holds **path rules**: `(pattern, axes)` where `pattern` is a regular expression
searched in a parameter's `jax.tree_util.keystr` path (`['blocks'][0]['attn']['query']['kernel']`)
and `axes` gives one logical name (or mesh axis, or None) per dimension of the parameters it
matches. A key that is a plain name (letters, digits, `_`) names a logical axis; any other key,
or an `re.compile(...)` pattern, is a path rule. A path rule gives a parameter its logical axes
(parameters with annotations keep theirs unless the strategy has `override_annotations=True`),
which then map to mesh axes through the logical rows of the same table: one lookup
(`jaxlight.sharding._layout.partition_spec`) places every array. Ready-made path rules for stock
Flax NNX
layers are in `jaxlight.strategies.rules`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import yaml

from jaxlight._errors import ConfigurationError, suggest

# The lookup and the activation constraints live in the leaf `jaxlight.sharding._layout`
# (jaxlight.nn uses them too); they are re-exported here, next to the rules they read.
from jaxlight.sharding._layout import (  # noqa: F401
    PathRule,
    activation_sharding,
    axes_of,
    constrain,
    is_axes,
    logical_to_spec,
    partition_spec,
    rule_axes,
    spmd_context,
)
from jaxlight.strategies.rules import SETS

#: The mesh axes a step computes the batch over, `fsdp` major: XLA's SPMD partitioner (jax
#: 0.10.2) computes wrong gradients for weights sharded over `fsdp` (and `tp`) when the batch is
#: split over (data, fsdp) in that order, and right ones over (fsdp, data)
#: (tests/strategies/test_partitioner.py). Batches are placed `data` major (`_spmd.BATCH_AXES`)
#: and the training step relays them out (`SpmdStrategy.relayout_batch`).
COMPUTE_BATCH_AXES = ("fsdp", "data", "expert")

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
    ("batch", COMPUTE_BATCH_AXES),
    ("length", "context"),
    ("activation_embed", None),
    ("activation_heads", "tp"),
    ("activation_kv", None),
    ("activation_mlp", "tp"),
    ("activation_vocab", "tp"),
    # mesh axes named directly (annotations and path rules may name them)
    ("data", "data"),
    ("pipe", "pipe"),
    ("fsdp", "fsdp"),
    ("context", "context"),
    ("expert", "expert"),  # also the logical name of the experts' axis (jaxlight.nn.MoE)
    ("tp", "tp"),
)

#: Logical names that only label activations (never reported as unused rules).
ACTIVATION_NAMES = frozenset(
    {"batch", "length"} | {n for n, _ in DEFAULT_RULES if n.startswith("activation_")}
)


#: A logical axis name: the key of a logical rule. Any other key is a path pattern.
_LOGICAL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def is_path_key(key: Any) -> bool:
    """True for a path rule's key: a compiled pattern or a string that is not a plain name."""
    return isinstance(key, re.Pattern) or (isinstance(key, str)
                                           and not _LOGICAL_NAME.fullmatch(key))


def _mesh_axis(name: Any) -> Any:
    return AXIS_ALIASES.get(name, name) if isinstance(name, str) else name


def _refuse_repeated_axis(shown: str, target: tuple, who: str) -> None:
    """One axis can split one dimension of an array; a second use would silently replicate."""
    axes = [_mesh_axis(n) for n in target]
    for i, name in enumerate(axes):
        if name is not None and name in axes[:i]:
            first = axes.index(name)
            fixed = tuple(None if j == i else n for j, n in enumerate(target))
            raise ConfigurationError(
                f"{who}: path rule (r{shown!r} -> {target!r}) names {target[i]!r} for "
                f"dimensions {first} and {i}; one axis can split only one dimension of an "
                f"array (dimension {i} would silently be left unsplit). "
                f"Give the other dimension None or another axis, for example {fixed!r}."
            )


def _path_rule(key: Any, target: Any, who: str, group: str | None) -> PathRule:
    shown = key.pattern if isinstance(key, re.Pattern) else key
    if not isinstance(target, tuple | list) or not all(
            n is None or isinstance(n, str) for n in target):
        raise ConfigurationError(
            f"{who}: path rule (r{shown!r} -> {target!r}) must map to a tuple with one logical "
            f"axis name, mesh axis or None per dimension of the parameters it matches, for "
            f"example (r{shown!r}, (None, 'tp')) for a 2-d kernel split over tp by columns."
        )
    _refuse_repeated_axis(shown, tuple(target), who)
    try:
        return PathRule(key, tuple(_mesh_axis(n) for n in target), group)
    except re.error as err:
        raise ConfigurationError(
            f"{who}: rule key {shown!r} is not a plain logical axis name, so it is read as a "
            f"regular expression over parameter paths, and it does not compile: {err}. Escape "
            "brackets and dots (r\"\\['kernel'\\]\") or use a plain name for a logical-axis "
            "rule."
        ) from None


def normalize_rules(rules: Mapping[str, Any] | Sequence | None, who: str) -> tuple:
    """Rules as a tuple of pairs: `(logical_name, mesh_axes)` and `PathRule`s, in order.

    Accepts a dict or a sequence of pairs. A pair whose key is a plain name (letters, digits,
    `_`) is a logical-axis rule and its target must be mesh axes (aliases such as `model` become
    `tp`); any other key, or a compiled pattern, makes a path rule (`PathRule`). A string names
    a ready-made set of `jaxlight.strategies.rules` (`"NNX"`), alone or as an item.
    """
    if rules is None:
        return ()
    if isinstance(rules, str):
        rules = [rules]
    items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
    out = []
    for item in items:
        if isinstance(item, PathRule):
            out.append(item)
            continue
        if isinstance(item, str):
            out.extend(_ready_made(item, who))
            continue
        if not (isinstance(item, tuple | list) and len(item) == 2
                and isinstance(item[0], str | re.Pattern)):
            raise ConfigurationError(
                f"{who}: a rule must be a pair (logical_name, mesh_axes) or (path_pattern, "
                f"axes per dimension), got {item!r}; for example rules=[('mlp', 'tp'), "
                "(r'.*out.*kernel', ('tp', None))] or {'mlp': 'tp'}."
            )
        name, target = item
        if is_path_key(name):
            out.append(_path_rule(name, target, who, None))
            continue
        if isinstance(target, list):
            target = tuple(target)
        axes = [_mesh_axis(a) for a in axes_of(target)]
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            looks_like_path = isinstance(target, tuple) and (None in target or len(target) > 1)
            raise ConfigurationError(
                f"{who}: rule ({name!r} -> {target!r}) maps the logical axis {name!r} to "
                f"{bad[0]!r}, which is not a mesh axis; a logical rule's target is a mesh axis, "
                f"a tuple of them, or None (mesh axes: {list(MESH_AXES)})."
                + (f" To match parameter paths containing {name!r}, write a regular expression"
                   f" such as (r'.*{name}', {target!r})." if looks_like_path
                   else suggest(str(bad[0]), [*MESH_AXES, *AXIS_ALIASES]))
            )
        if isinstance(target, str):
            target = _mesh_axis(target)
        elif isinstance(target, tuple):
            target = _fsdp_major(tuple(axes))
        out.append((name, target))
    return tuple(out)


def _fsdp_major(target: tuple) -> tuple:
    """A rule naming both `data` and `fsdp` splits over `fsdp` first (`COMPUTE_BATCH_AXES`):
    the same devices hold the same number of rows either way, and with `data` first XLA
    computes wrong gradients (a model constraining its input by such a "batch" rule: step
    losses 5.7% off on tests/strategies/test_partitioner.py's net)."""
    major, minor = COMPUTE_BATCH_AXES[:2]
    if major in target and minor in target:
        i, j = target.index(minor), target.index(major)
        if i < j:
            swapped = list(target)
            swapped[i], swapped[j] = major, minor
            return tuple(swapped)
    return target


def _ready_made(name: str, who: str) -> tuple[PathRule, ...]:
    found = SETS.get(name.upper())
    if found is None:
        raise ConfigurationError(
            f"{who}: rules={name!r} names no ready-made rule set; the sets of "
            f"jaxlight.strategies.rules are {sorted(SETS)}.{suggest(name.upper(), SETS)} A "
            "rule is a pair: ('mlp', 'tp') or (r'.*out.*kernel', ('tp', None))."
        )
    return found


def check_path_rules(rules: Sequence, who: str) -> None:
    """Refuses a path rule naming a dimension's axis that no logical rule (or mesh axis) defines."""
    known = [name for name, _ in rules if isinstance(name, str)]
    for rule in rules:
        if not isinstance(rule, PathRule):
            continue
        for entry in rule.axes:
            if entry is not None and entry not in known and _mesh_axis(entry) not in MESH_AXES:
                raise ConfigurationError(
                    f"{who}: path rule {rule!r} names {entry!r}, which is neither a logical "
                    f"axis of the rules table nor a mesh axis; logical axes: "
                    f"{sorted(set(known) - set(MESH_AXES))}, mesh axes: {list(MESH_AXES)}."
                    f"{suggest(entry, known)} Add a rule ({entry!r}, 'tp') (or another mesh "
                    "axis) to define it."
                )


# -- mesh shapes: the one grammar (Python, CLI flags, YAML) -----------------------------------

#: Mesh axes, outermost first: data-parallel axes outside so that their collectives cross the
#: slowest links, tensor parallelism innermost (fastest links); context parallelism's ring of
#: key/value permutes next to it.
MESH_AXES = ("data", "pipe", "fsdp", "context", "expert", "tp")

#: Other names for mesh axes (the seeds' and other frameworks' spellings), accepted everywhere.
AXIS_ALIASES = {"model": "tp", "tensor": "tp", "pipeline": "pipe", "stage": "pipe",
                "sequence": "context"}

MESH_FORMS = """accepted forms of a mesh shape:
  {"data": 4, "tp": 2}          a mapping of axis name to size (also as JSON or YAML text)
  'data=4,tp=2'                 axis=size pairs
  [[4, 2], ["data", "tp"]]      the Tunix form: [sizes, axis names] (also as text)
one size may be -1 (it fills the remaining devices); mesh axes: data, pipe, fsdp, context,
expert, tp
(aliases: model -> tp, tensor -> tp, pipeline -> pipe, stage -> pipe, sequence -> context)"""


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
