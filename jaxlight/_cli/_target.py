"""The user's own code as a command-line target: `jaxlight fit PATH.py:Module --data PATH.py:Data`.

A target names a `TrainModule` subclass (and `--data` a `DataModule` subclass, or a function
returning one) as `PATH.py:NAME` or `package.module:NAME`; this module imports it. The parser
(`_lightning_form`) reads their `__init__` arguments as the sections `model` and `data`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from typing import Any

from jaxlight._errors import ConfigurationError, suggest


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


def class_path_spec(path: str) -> str:
    """A config file's `class_path` as a target: `PATH.py:NAME` and `package.module:NAME` as
    they are; LightningCLI's dotted `package.module.NAME` as `package/module.py:NAME` when that
    file is under the current directory (as `python main.py` imports it), else as
    `package.module:NAME`; a script's `__main__.NAME` as `__main__:NAME`, a class that only the
    command line's `PATH.py:NAME` can find."""
    if ":" in path or "." not in path:
        return path  # import_object says what is wrong with a bare name
    where, _, attr = path.rpartition(".")
    file = os.path.join(*where.split(".")) + ".py"
    return f"{file}:{attr}" if where != "__main__" and os.path.isfile(file) else f"{where}:{attr}"


def same_target(a: str, b: str) -> bool:
    """Whether two specs name the same object (paths compared absolute; `__main__:NAME`, a
    LightningCLI script's own class, is any file's NAME)."""
    if a.startswith("__main__:") or b.startswith("__main__:"):
        return a.rpartition(":")[2] == b.rpartition(":")[2]

    def norm(spec: str) -> str:
        where, _, attr = spec.rpartition(":")
        if where.endswith(".py") or "/" in where:
            where = os.path.abspath(where)
        return f"{where}:{attr}"

    return norm(a) == norm(b)


def register(obj: Any) -> Any:
    """Makes a class loaded from a user's file importable under its file's name too, so that
    jsonargparse's `class_path` (`model.Backbone`) finds the same classes."""
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    if module is not None and module.__name__.startswith("_jaxlight_target_"):
        stem = module.__name__[len("_jaxlight_target_"):]
        known = sys.modules.get(stem)
        if known is None or getattr(known, "__name__", "").startswith("_jaxlight_target_"):
            sys.modules[stem] = module  # (a file loaded earlier under that name: the newest)
    return module
