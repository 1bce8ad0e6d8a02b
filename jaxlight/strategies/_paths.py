"""Which rule places each array of the train state: annotations, path rules, or nothing.

`place(rules, abstract_state, logical_axes)` gives every leaf of the train state the logical
axes `partition_spec` maps to mesh axes, and says where they came from:

1. a parameter's own annotation (`nnx.with_partitioning`), unless `override_annotations`;
2. else the first path rule (`jaxlight.sharding._layout.match_path`) found in the parameter's
`keystr`
   path within its collection (`['blocks'][0]['attn']['query']['kernel']`, the path `Fit.plan`
   shows) with one axis per dimension;
3. else nothing: the strategy's fallback (FSDP shards the largest divisible dimension, the
   others replicate).

Optimizer slots follow their parameter. The strategy sees the state tree, not the optimizer, so
a slot is matched to its parameter by key path: optax keeps per-parameter state as trees shaped
like the parameters (`mu`, `nu` are `tree_map`s of them), so a slot whose key path ends with a
parameter's key path and whose shape equals the parameter's is that parameter's slot. Slots of
other shapes (factored second moments) keep the annotation mirrored by `model_spec`, or none.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax

from jaxlight._errors import JaxlightWarning
from jaxlight.sharding._layout import match_path
from jaxlight.strategies._rules import ACTIVATION_NAMES, MESH_AXES, PathRule

#: The collections of the train state whose arrays path rules place, by their own paths.
_PLACED = ("params", "rest")


@dataclasses.dataclass(frozen=True)
class Placed:
    """How one parameter (or other model variable) got its logical axes.

    Attributes:
        collection: "params" (trained) or "rest" (other model variables).
        path: `keystr` path within the collection, as `Fit.plan` prints it.
        shape: the array's shape.
        annotation: logical axes from `nnx.with_partitioning`, or None.
        logical: the logical axes used (annotation, path rule target, or None: nothing).
        rule: the path rule that placed it, or None.
        label: what placed it, as `Fit.plan` shows it: "annotation", "rules[i]" (the path
            rule's index in the strategy's `rules`), or "none".
    """

    collection: str
    path: str
    shape: tuple[int, ...]
    annotation: tuple | None
    logical: tuple | None
    rule: PathRule | None
    label: str


@dataclasses.dataclass(frozen=True)
class Placement:
    """Per leaf of the train state, its logical axes and what gave them (see `place`).

    Attributes:
        leaves: flat `(key path, abstract leaf, logical axes, source text)` per state leaf.
        treedef: the train state's tree structure (to unflatten per-leaf results).
        arrays: one `Placed` per leaf of `params` and `rest`.
    """

    leaves: tuple[tuple[tuple, Any, tuple | None, str], ...]
    treedef: Any
    arrays: tuple[Placed, ...]


def rule_label(rule: PathRule, rules: Sequence) -> str:
    """`rules[i]`: where a path rule sits in the rules the user gave (as `Fit.plan` names it)."""
    index = next((i for i, r in enumerate(rules) if r is rule), None)
    return f"rules[{index}]"


def describe_rule(rule: PathRule, rules: Sequence) -> str:
    """`path rule rules[i] (r'pattern', axes) (from SET)`, for messages."""
    group = f" (from {rule.group})" if rule.group else ""
    return f"path rule {rule_label(rule, rules)} {rule!r}{group}"


def place(rules: Sequence, abstract_state: Any, logical_axes: Any, *,
          override_annotations: bool = False, user_rules: Sequence = ()) -> Placement:
    """Logical axes for every leaf of `abstract_state` (annotations, path rules; see module)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    given = treedef.flatten_up_to(logical_axes)
    arrays: list[Placed] = []
    by_param: dict[tuple, tuple[tuple[int, ...], tuple | None, str]] = {}
    leaves: list = [None] * len(flat)
    for i, ((path, leaf), annotation) in enumerate(zip(flat, given, strict=True)):
        collection = getattr(path[0], "name", None) if path else None
        if collection not in _PLACED:
            continue
        relative = jax.tree_util.keystr(path[1:])
        shape = tuple(getattr(leaf, "shape", ()))
        logical, rule, source = annotation, None, "annotation" if annotation else ""
        label = source or "none"
        if annotation is None or override_annotations:
            found = match_path(rules, relative, len(shape))
            if found is not None:
                rule, logical = rules[found[0]], found[1]
                source = describe_rule(rule, user_rules or rules)
                label = rule_label(rule, user_rules or rules)
        arrays.append(Placed(collection, relative, shape, annotation, logical, rule, label))
        leaves[i] = (path, leaf, logical, source)
        if collection == "params":
            by_param[tuple(path[1:])] = (shape, logical, source)
    for i, ((path, leaf), annotation) in enumerate(zip(flat, given, strict=True)):
        if leaves[i] is not None:
            continue
        logical, source = annotation, "annotation" if annotation else ""
        if path and getattr(path[0], "name", None) == "opt_state":
            shape = tuple(getattr(leaf, "shape", ()))
            keys = tuple(path[1:])
            for start in range(len(keys)):  # the longest matching suffix first
                param = by_param.get(keys[start:])
                if param is not None and param[0] == shape:
                    _, logical, source = param
                    break
        leaves[i] = (path, leaf, logical, source)
    return Placement(tuple(leaves), treedef, tuple(arrays))


def warn_unused(who: str, user_rules: Sequence, placement: Placement) -> None:
    """Warns about user rules that placed nothing: a logical name no array uses, a path rule
    no path matched (or whose matches all went to earlier rules), a ready-made set that matched
    nothing at all. Each is usually a typo."""
    used_names = {n for p in placement.arrays if p.logical for n in p.logical if n is not None}
    winners = {id(p.rule) for p in placement.arrays if p.rule is not None}
    groups: dict[str, list[PathRule]] = {}
    for rule in user_rules:
        if not isinstance(rule, PathRule):
            name, target = rule
            if name not in used_names and name not in ACTIVATION_NAMES and name not in MESH_AXES:
                warnings.warn(
                    f"{who}: rule ({name!r} -> {target!r}) names a logical axis no parameter "
                    f"uses; the model's logical axes are {sorted(used_names)}.",
                    JaxlightWarning, stacklevel=4,
                )
            continue
        if id(rule) in winners:
            continue
        if rule.group:
            groups.setdefault(rule.group, []).append(rule)
            continue
        warnings.warn(f"{who}: {_unused_text(rule, user_rules, placement)}", JaxlightWarning,
                      stacklevel=4)
    for group, members in groups.items():
        total = sum(1 for r in user_rules if isinstance(r, PathRule) and r.group == group)
        if len(members) == total:
            sample = ", ".join(p.path for p in placement.arrays[:3])
            warnings.warn(
                f"{who}: the ready-made rules {group} matched none of the model's "
                f"{len(placement.arrays)} parameter paths (such as {sample}); they are written "
                "for Flax NNX's stock layers. Add your own path rules for this model's names.",
                JaxlightWarning, stacklevel=4,
            )


def _unused_text(rule: PathRule, user_rules: Sequence, placement: Placement) -> str:
    text = f"{describe_rule(rule, user_rules)} matched no parameter"
    found = [p for p in placement.arrays if rule.pattern.search(p.path)]
    taken = [p for p in found if len(p.shape) == len(rule.axes)]
    if taken:
        by = sorted({p.rule is not None and describe_rule(p.rule, user_rules) or "annotations"
                     for p in taken})
        return (f"{text}: the paths it matches ({taken[0].path}"
                f"{f' and {len(taken) - 1} more' if len(taken) > 1 else ''}) were placed first "
                f"by {', '.join(by)} (the first match wins; annotations win unless "
                "override_annotations=True).")
    if found:
        p = found[0]
        return (f"{text}: it names {len(rule.axes)} axes, but the paths it matches have other "
                f"dimensions ({p.path} has shape {p.shape}); give one axis per dimension.")
    sample = ", ".join(p.path for p in placement.arrays[:4])
    return (f"{text} path (paths look like {sample}); the pattern is searched in each "
            "jax.tree_util.keystr path with re.search.")
