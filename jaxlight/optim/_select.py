"""Which parameters a named optimizer updates: a sub-module, a path regex or an nnx filter.

`configure_optimizers` binds each optimizer to part of the model with its `"params"` entry:

- a string is a regular expression matched from the start of a parameter's dotted path
  (`"generator.layers.0.kernel"`) and ending at a component boundary, so a sub-module
  attribute is the simplest case: `"generator"` selects everything under `model.generator`,
  `"encoder|decoder"` two sub-modules, `".*bias"` every bias;
- anything else is an nnx filter (`nnx.PathContains("head")`, a Variable type such as
  `nnx.LoRAParam`, `nnx.Any(...)`, or `callable(path, variable) -> bool`).

Every trained parameter belongs to exactly one optimizer: an unclaimed or doubly claimed one
is refused with its path, so no parameter silently stops training.
"""

from __future__ import annotations

import re
from typing import Any

import jax
from flax import nnx

from jaxlight._errors import ConfigurationError


def _dotted(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def _predicate(binding: Any, where: str):
    if isinstance(binding, str):
        try:
            pattern = re.compile(rf"(?:{binding})(?:\.|$)")
        except re.error as exc:
            raise ConfigurationError(
                f"{where}['params'] = {binding!r} is not a valid regular expression ({exc}); "
                "give a sub-module attribute such as 'generator', a path regex such as "
                "'encoder\\..*kernel', or an nnx filter."
            ) from None
        return lambda path, _variable: pattern.match(_dotted(path)) is not None
    try:
        return nnx.filterlib.to_predicate(binding)
    except TypeError as exc:
        raise ConfigurationError(
            f"{where}['params'] is a {type(binding).__name__}; give a sub-module attribute "
            "('generator'), a path regex ('encoder\\..*kernel') or an nnx filter "
            f"(nnx.PathContains('head'), a Variable type). ({exc})"
        ) from None


def owner_labels(bindings: dict[str, Any], params_state: nnx.State, where: str) -> Any:
    """Per parameter (a pure dict like the train state's params), the name of its optimizer.

    Args:
        bindings: optimizer name -> its `"params"` entry, in configure_optimizers' order.
        params_state: the abstract model's trainable variables (`nnx.split` by
            `module.trainable`).
        where: `'Module.configure_optimizers()'`, for messages.
    """
    predicates = {name: _predicate(b, f"{where}[{name!r}]") for name, b in bindings.items()}
    owners: dict[tuple, str] = {}
    unclaimed, twice = [], []
    for path, variable in nnx.to_flat_state(params_state):
        claimed = [name for name, pred in predicates.items() if pred(path, variable)]
        if not claimed:
            unclaimed.append(_dotted(path))
        elif len(claimed) > 1:
            twice.append(f"{_dotted(path)} ({' and '.join(claimed)})")
        else:
            owners[tuple(path)] = claimed[0]
    if twice:
        raise ConfigurationError(
            f"{where}: {len(twice)} parameter(s) are claimed by more than one optimizer: "
            f"{', '.join(twice[:5])}{' ...' if len(twice) > 5 else ''}. Each parameter has "
            "one optimizer; narrow the 'params' entries."
        )
    if unclaimed:
        raise ConfigurationError(
            f"{where}: {len(unclaimed)} trained parameter(s) belong to no optimizer: "
            f"{', '.join(unclaimed[:5])}{' ...' if len(unclaimed) > 5 else ''}. Bind them in a "
            "'params' entry, or leave them out of training with TrainModule.trainable."
        )
    for name in bindings:
        if name not in owners.values():
            raise ConfigurationError(
                f"{where}[{name!r}]['params'] = {bindings[name]!r} selects no parameter; the "
                f"model's top-level attributes are {sorted({str(p[0]) for p in owners})}."
            )
    pure = nnx.to_pure_dict(params_state)
    return _label_tree(pure, owners)


def _label_tree(pure: Any, owners: dict[tuple, str]) -> Any:
    def label(path, _leaf):
        return owners[tuple(_key(k) for k in path)]

    return jax.tree_util.tree_map_with_path(label, pure)


def _key(entry: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry
