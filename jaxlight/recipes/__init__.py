"""Ready-made TrainModules with their data, runnable as `jaxlight fit <name>`.

| name | what it trains |
|---|---|
| `digits` | an MLP on scikit-learn's 8x8 digits (offline); ~97% validation accuracy in seconds |
| `gpt` | a byte-level decoder-only transformer on the Python standard library's source |
| `sft` | supervised fine-tuning (optionally LoRA) of a `gpt` model on string reversal |
| `dpo` | DPO of a pretrained Hugging Face model against a frozen copy of itself |
| `grpo` | GRPO of a pretrained Hugging Face model on string reversal (verifiable rewards) |

Each recipe module defines a `Config` dataclass (every field has a default and a help text), a
`TrainModule`, `build(config, max_steps) -> (module, data)` and `RECIPE`, the object the command
line uses. Recipe modules are imported on first use, so listing them costs nothing.

Example:
    >>> from jaxlight import recipes
    >>> recipes.names()
    ['digits', 'gpt', 'sft', 'dpo', 'grpo']
    >>> recipes.get("digits").config().model.hidden
    256

May import everything below the CLI, the public `jaxlight` names included (layer 22 of
docs/architecture.md).
"""

from __future__ import annotations

import importlib

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.recipes._base import Recipe, RecipeData

__all__ = ["REGISTRY", "Recipe", "RecipeData", "get", "names", "register"]

#: Recipe name -> module defining `RECIPE` (imported lazily).
REGISTRY: dict[str, str] = {
    "digits": "jaxlight.recipes.digits",
    "gpt": "jaxlight.recipes.gpt",
    "sft": "jaxlight.recipes.sft",
    "dpo": "jaxlight.recipes.dpo",
    "grpo": "jaxlight.recipes.grpo",
}


def names() -> list[str]:
    """The registered recipe names."""
    return list(REGISTRY)


def register(name: str, module: str) -> None:
    """Registers a recipe module (one defining `RECIPE`) under `name`, for the command line."""
    REGISTRY[name] = module


def get(name: str) -> Recipe:
    """The `Recipe` registered as `name`; an unknown name lists the valid ones."""
    if name not in REGISTRY:
        raise ConfigurationError(
            f"unknown recipe {name!r}; valid recipes are {names()}.{suggest(name, REGISTRY)}"
        )
    recipe = importlib.import_module(REGISTRY[name]).RECIPE
    if not isinstance(recipe, Recipe):
        raise ConfigurationError(
            f"{REGISTRY[name]}.RECIPE is a {type(recipe).__name__}, not a jaxlight.recipes.Recipe."
        )
    return recipe
