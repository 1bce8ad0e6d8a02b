"""The user's own code as a command-line target: `jaxlight fit PATH.py:Module --data PATH.py:Data`.

A target names a `TrainModule` subclass (and `--data` a `DataModule` subclass, or a function
returning one) as `PATH.py:NAME` or `package.module:NAME`. Their `__init__` parameters become a
config dataclass with the sections `model` and `data`, so the recipe machinery (options, types,
did-you-mean, config files, `--print-config`) serves a user's module exactly as it serves a
recipe: a target is a `Recipe` whose config is read from signatures.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
import typing
from collections.abc import Mapping
from typing import Any

from jaxlight._errors import ConfigurationError, suggest
from jaxlight._module import TrainModule
from jaxlight.data._datamodule import DataModule
from jaxlight.recipes._base import Recipe, as_dict, option, section, type_name

#: The config-file key naming a section's class (`data: {class_path: data.py:Digits}`).
CLASS_PATH = "class_path"

_SCALARS = (int, float, str, bool)


class _Required:
    """The default of a parameter without one: the command line or a config file must give it."""

    def __repr__(self) -> str:
        return "required"

    def __deepcopy__(self, memo) -> _Required:
        return self


REQUIRED = _Required()


def is_target(name: str) -> bool:
    """Whether a command's first argument names user code (`x.py:Name`, `pkg.mod:Name`)."""
    return ":" in name


def _load_file(path: str, spec: str):
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ConfigurationError(
            f"{spec}: no such file {path!r} (looked for {full}); give PATH.py:NAME with a path "
            "relative to the current directory, or package.module:NAME."
        )
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(full))[0])
    # A private name: a user's `model.py` or `types.py` must not replace an importable module.
    name = f"_jaxlight_target_{stem}"
    module_spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(module_spec)
    # The file's folder is importable, as for `python PATH.py` (sibling imports work).
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses and pickle look a class's module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        sys.modules.pop(name, None)
        frames = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == full]
        line = getattr(err, "lineno", None) if isinstance(err, SyntaxError) else (
            frames[-1].lineno if frames else None)
        where = f", line {line}" if line else ""
        raise ConfigurationError(
            f"{spec}: importing {path}{where} raised {type(err).__name__}: {err}"
        ) from err
    return module


def import_object(spec: str, what: str) -> Any:
    """The object `PATH.py:NAME` or `package.module:NAME` names."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ConfigurationError(
            f"{what} {spec!r} is not of the form PATH.py:NAME or package.module:NAME (for "
            "example model.py:Classifier)."
        )
    if where.endswith(".py") or os.sep in where or "/" in where:
        module = _load_file(where, spec)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ConfigurationError(
                f"{what} {spec!r}: cannot import {where!r} ({err}); give a file as PATH.py:NAME "
                "or an importable module as package.module:NAME."
            ) from None
    if not hasattr(module, attr):
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and (inspect.isclass(v) or inspect.isfunction(v))]
        raise ConfigurationError(
            f"{what} {spec!r}: {where} has no {attr!r}.{suggest(attr, names)} It defines: "
            f"{', '.join(sorted(names)) or 'no classes or functions'}."
        )
    return getattr(module, attr)


def _describe(obj: Any) -> str:
    if inspect.isclass(obj):
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        return f"a class deriving from {bases}"
    if callable(obj):
        return f"a {type(obj).__name__}"
    return f"a {type(obj).__name__} ({obj!r:.60})"


# -- signatures to config sections ---------------------------------------------------------------


def _supported(kind: Any) -> bool:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind in _SCALARS or kind is type(None):
        return True
    if origin is typing.Literal:
        return all(isinstance(a, _SCALARS) for a in args)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return all(_supported(a) for a in args)
    if origin in (tuple, list):
        elems = [a for a in args if a is not Ellipsis]
        return len(set(elems)) <= 1 and all(a in _SCALARS for a in elems)
    return kind in (tuple, list)


def _inferred(default: Any) -> Any:
    """The type of an unannotated parameter: its default's (str without a default)."""
    if default is REQUIRED:
        return str
    if default is None:
        return str | None
    if isinstance(default, tuple | list) and default and all(
            type(v) is type(default[0]) and type(v) in _SCALARS for v in default):
        return type(default)[type(default[0]), ...] if isinstance(default, tuple) \
            else list[type(default[0])]
    return type(default)


def _arg_help(obj: Any) -> dict[str, str]:
    """Google-style `Args:` entries of the class's (or its `__init__`'s) docstring."""
    out: dict[str, str] = {}
    for doc in (inspect.getdoc(obj), inspect.getdoc(getattr(obj, "__init__", None))):
        body = re.split(r"^\s*Args:\s*$", doc or "", maxsplit=1, flags=re.M)
        if len(body) < 2:
            continue
        for line in body[1].splitlines():
            if line.strip() and not line.startswith((" ", "\t")):
                break  # the next section
            m = re.match(r"\s+([\w, ]+?)(?:\s*\([^)]*\))?:\s*(.*)", line)
            if m:
                for name in m.group(1).split(","):
                    out.setdefault(name.strip(), m.group(2).strip())
    return out


def _section_class(obj: Any, spec: str, section_name: str) -> tuple[type, list[str]]:
    """A dataclass of `obj`'s parameters and the names of those the command line cannot set."""
    fn = obj.__init__ if inspect.isclass(obj) else obj
    params = list(inspect.signature(fn).parameters.values())
    if inspect.isclass(obj):
        params = params[1:]  # self
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: that parameter is unsupported
        hints = {}
    helps = _arg_help(obj)
    fields, skipped = [], []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name == CLASS_PATH:
            raise ConfigurationError(
                f"{spec}: a parameter named {CLASS_PATH!r} clashes with the config file's key "
                f"naming the class; rename it."
            )
        default = REQUIRED if p.default is p.empty else p.default
        if p.annotation is p.empty:
            kind = _inferred(default)
        else:
            kind = hints.get(p.name, p.annotation)
        if not _supported(kind):
            shown = kind if isinstance(kind, str) else type_name(kind)
            if default is REQUIRED:
                raise ConfigurationError(
                    f"{spec}: parameter {p.name!r} has type {shown}, which the command line "
                    "cannot build (it builds int, float, str, bool, their Optional/Union, "
                    "Literal, and tuples or lists of them); give it a default, or wrap the "
                    "class in one whose parameters are plain values."
                )
            skipped.append(f"{p.name} ({shown})")
            continue
        fields.append((p.name, kind, option(default, helps.get(p.name, ""))))
    name = getattr(obj, "__name__", section_name)
    return dataclasses.make_dataclass(f"{name}Arguments", fields), skipped


@dataclasses.dataclass(frozen=True)
class TargetRecipe(Recipe):
    """A recipe made from the user's classes: `class_paths` are the specs of its sections
    (`{"model": "model.py:Net", "data": "model.py:Data"}`), `notes` their help texts."""

    class_paths: Mapping[str, str] = dataclasses.field(default_factory=dict)
    notes: Mapping[str, str] = dataclasses.field(default_factory=dict)


def load_target(spec: str, data_spec: str | None) -> TargetRecipe:
    """The recipe of `jaxlight <command> spec --data data_spec`."""
    cls = import_object(spec, "target")
    if not (inspect.isclass(cls) and issubclass(cls, TrainModule)):
        raise ConfigurationError(
            f"target {spec!r} is {_describe(cls)}, not a jaxlight.TrainModule subclass; name a "
            "class deriving from jl.TrainModule (a DataModule goes after --data)."
        )
    sections = {"model": _section_class(cls, spec, "model")}
    paths = {"model": spec}
    data = None
    if data_spec is not None:
        data = import_object(data_spec, "--data")
        if not (inspect.isclass(data) and issubclass(data, DataModule)) and not (
                inspect.isfunction(data)):
            raise ConfigurationError(
                f"--data {data_spec!r} is {_describe(data)}, not a jaxlight.DataModule subclass "
                "(or a function returning a DataModule)."
            )
        sections["data"] = _section_class(data, data_spec, "data")
        paths["data"] = data_spec
    config = dataclasses.make_dataclass(
        "TargetConfig", [(n, c, section(c)) for n, (c, _) in sections.items()])
    notes = {}
    for name, (_, skipped) in sections.items():
        obj = cls if name == "model" else data
        notes[name] = f"the arguments of {getattr(obj, '__qualname__', obj)} ({paths[name]})"
        if skipped:
            notes[name] += "; not settable here (no default to replace): " + ", ".join(skipped)

    def build(config, max_steps=None):
        module = cls(**as_dict(config.model))
        datamodule = None
        if data is not None:
            datamodule = data(**as_dict(config.data))
            if not isinstance(datamodule, DataModule):
                raise ConfigurationError(
                    f"--data {data_spec!r} returned a {type(datamodule).__name__}, not a "
                    "jaxlight.DataModule."
                )
        return module, datamodule

    summary = (inspect.getdoc(cls) or cls.__name__).splitlines()[0]
    return TargetRecipe(name=spec, summary=summary, config=config, build=build,
                        class_paths=paths, notes=notes)


def missing_required(recipe: TargetRecipe, config: Any) -> None:
    """Refuses a config that leaves a parameter without a default unset, naming each."""
    missing = [f"--{name}.{k}" for name in recipe.class_paths
               for k, v in as_dict(getattr(config, name)).items() if isinstance(v, _Required)]
    if missing:
        raise ConfigurationError(
            f"{recipe.name}: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "required (parameters without a default); give them on the command line or in a "
            "--config file's section."
        )


def take_class_paths(data: dict[str, Any]) -> dict[str, str]:
    """Removes `class_path` from a config file's `model:` and `data:` sections (in place) and
    returns them; a section left empty is dropped."""
    found = {}
    for name in ("model", "data"):
        sec = data.get(name)
        if isinstance(sec, Mapping) and CLASS_PATH in sec:
            sec = dict(sec)
            found[name] = str(sec.pop(CLASS_PATH))
            if sec:
                data[name] = sec
            else:
                del data[name]
    return found


def same_target(a: str, b: str) -> bool:
    """Whether two specs name the same object (paths compared absolute)."""
    def norm(spec: str) -> str:
        where, _, attr = spec.rpartition(":")
        if where.endswith(".py") or "/" in where:
            where = os.path.abspath(where)
        return f"{where}:{attr}"

    return norm(a) == norm(b)


def printable(recipe: Recipe, options: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """What `--print-config` prints: options, then each section (a target's with its class)."""
    sections = as_dict(config)
    for name, path in getattr(recipe, "class_paths", {}).items():
        sections[name] = {CLASS_PATH: path, **sections.get(name, {})}
    return {**options, **sections}
