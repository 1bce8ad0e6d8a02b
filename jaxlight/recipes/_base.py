"""What a recipe is: a config with defaults, a TrainModule with its data, and Fit defaults.

A recipe module (`digits.py`, `gpt.py`, ...) defines a `Config` dataclass whose sections
(`model`, `data`, `optim`, ...) are dataclasses of plain fields, and a `RECIPE` object tying the
config to `build(config, max_steps) -> (module, data)`. The command line turns every field into a
dotted option (`--model.hidden 128`); Python users call the same pieces directly.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.module._module import TrainModule


def option(default: Any, help: str) -> Any:  # noqa: A002 - `help` reads best at the call site
    """A config field with a default and the help text the command line shows."""
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: default.copy(), metadata={"help": help})
    return dataclasses.field(default=default, metadata={"help": help})


def section(cls: type) -> Any:
    """A config field holding a nested config dataclass (a section such as `model`)."""
    return dataclasses.field(default_factory=cls)


@dataclasses.dataclass
class RecipeData:
    """A recipe's data: iterables of NumPy batches (`test` may reuse `val`; `predict` is what
    `jaxlight predict` runs `predict_step` over, None when the recipe has none)."""

    train: Iterable
    val: Iterable | None = None
    test: Iterable | None = None
    #: Anything else the recipe's report needs (a tokenizer, prompts, ...).
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    predict: Iterable | None = None


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A ready-made training job, runnable as `jaxlight fit <name>`.

    Attributes:
        name: the command-line name.
        summary: one line for `jaxlight fit --help`.
        config: the config dataclass (every field has a default).
        build: `build(config, max_steps) -> (TrainModule, RecipeData)`; `max_steps` is the fit's
            (for learning-rate schedules), possibly None.
        fit_defaults: `Fit` keyword defaults for this recipe (max_steps, log_every_n_steps, ...).
        presets: named partial configs (`{"125m": {"model": {...}, "fit": {...}}}`) applied
            before the config file and the command line.
        before_fit: optional `before_fit(fit, module, data, config) -> dict` (metrics to report).
        after_fit: optional `after_fit(fit, module, data, config) -> dict` (metrics to report,
            for example a generated sample).
        ckpt_overrides: config overrides applied when `--ckpt-path` supplies the weights, to
            skip work that only initializes them (sft's in-process pretraining of its base);
            a mapping, or a function of the config returning one (sft: only without LoRA,
            whose checkpoints leave the frozen base out).
    """

    name: str
    summary: str
    config: type
    build: Callable[[Any, int | None], tuple[TrainModule, RecipeData]]
    fit_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    presets: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    before_fit: Callable | None = None
    after_fit: Callable | None = None
    ckpt_overrides: Mapping[str, Any] | Callable[[Any], Mapping[str, Any]] = dataclasses.field(
        default_factory=dict)

    def default_config(self, preset: str | None = None) -> Any:
        """The config with its defaults, then the preset's values."""
        config = self.config()
        if preset is not None:
            config = apply_overrides(config, self.preset(preset).get("config", {}), "preset")
        return config

    def preset(self, name: str) -> Mapping[str, Any]:
        """A preset's partial config (`{"config": {...}, "fit": {...}}`)."""
        if name not in self.presets:
            valid = sorted(self.presets) or ["(this recipe has none)"]
            raise ConfigurationError(
                f"recipe {self.name!r} has no preset {name!r}; valid presets are {valid}."
                f"{suggest(name, self.presets)}"
            )
        return self.presets[name]


# -- config trees ------------------------------------------------------------------------------


def fields(config_cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every leaf field of a nested config dataclass, by dotted name, in declaration order."""
    out: dict[str, dataclasses.Field] = {}
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out.update(fields(kind, f"{prefix}{f.name}."))
        else:
            f.type = kind  # resolved annotation, for conversion
            out[f"{prefix}{f.name}"] = f
    return out


def get_path(config: Any, dotted: str) -> Any:
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def set_path(config: Any, dotted: str, value: Any) -> Any:
    """A copy of `config` with one dotted field replaced."""
    head, _, tail = dotted.partition(".")
    if not tail:
        return dataclasses.replace(config, **{head: value})
    return dataclasses.replace(config, **{head: set_path(getattr(config, head), tail, value)})


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"model": {"hidden": 8}}` -> `{"model.hidden": 8}` (dotted keys pass through)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def apply_overrides(config: Any, overrides: Mapping[str, Any], source: str) -> Any:
    """Applies nested or dotted overrides, converting each value to its field's type."""
    known = fields(type(config))
    for name, value in flatten(overrides).items():
        if name not in known:
            raise ConfigurationError(
                f"{source}: unknown config field {name!r}; valid fields are {sorted(known)}."
                f"{suggest(name, known)}"
            )
        config = set_path(config, name, convert(value, known[name].type, f"{source}: {name}"))
    return config


def as_dict(config: Any) -> dict[str, Any]:
    """The config as nested plain dicts (JSON- and YAML-safe)."""
    return dataclasses.asdict(config)


# -- value conversion --------------------------------------------------------------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def type_name(kind: Any) -> str:
    """A short readable name of an annotation (`int`, `int | None`, `one of 'a', 'b'`)."""
    origin = typing.get_origin(kind)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(kind))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " | ".join(type_name(a) for a in typing.get_args(kind))
    if origin in (tuple, list):
        args = [a for a in typing.get_args(kind) if a is not Ellipsis]
        return f"list of {type_name(args[0])}" if args else "list"
    if kind is type(None):
        return "None"
    return getattr(kind, "__name__", str(kind))


def convert(value: Any, kind: Any, where: str) -> Any:
    """Converts a command-line string (or a parsed YAML/JSON value) to the annotation `kind`."""
    origin = typing.get_origin(kind)
    args = typing.get_args(kind)
    bad = ConfigurationError(f"{where} expects {type_name(kind)}, got {value!r}.")
    if origin is typing.Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ConfigurationError(
            f"{where} expects {type_name(kind)}, got {value!r}.{suggest(str(value), args)}"
        )
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if type(None) in args and (value is None or (isinstance(value, str)
                                                     and value.lower() in ("none", "null"))):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return convert(value, arg, where)
            except ConfigurationError:
                continue
        raise bad
    if origin in (tuple, list):
        elem = next((a for a in args if a is not Ellipsis), str)
        if isinstance(value, str):
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise bad
        items = [convert(v.strip() if isinstance(v, str) else v, elem, where) for v in value]
        return tuple(items) if origin is tuple else items
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise bad
    if kind is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    as_float = float(value)
                except ValueError:
                    raise bad from None
                if as_float.is_integer():  # 1e6 is a fine way to write a step count
                    return int(as_float)
        raise bad
    if kind is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise bad
    return value
