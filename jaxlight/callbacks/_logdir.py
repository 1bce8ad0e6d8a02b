"""Shared pieces of the loggers: writable run directories, hyperparameter records, extras."""

from __future__ import annotations

import importlib
import os
import uuid
from typing import Any

import jax

from jaxlight._errors import ConfigurationError, MissingDependency
from jaxlight.callbacks._checkpoint import ModelCheckpoint


def ensure_writable(path: str | os.PathLike, who: str) -> str:
    """Creates `path` and checks that a file can be written in it; refuses it otherwise.

    Called from a logger's `setup`, so a bad directory fails before anything compiles.
    """
    path = os.fspath(path)
    probe = os.path.join(path, f".jaxlight-write-test-{uuid.uuid4().hex}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigurationError(
            f"{who} cannot write to {os.path.abspath(path)!r}: {reason} "
            f"({type(exc).__name__}). Choose a directory you can write to (save_dir=... or "
            "Fit(default_root_dir=...)); nothing was trained."
        ) from exc
    return path


def require(module: str, extra: str, who: str):
    """Imports an optional dependency, or says which jaxlight extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(
            f"{who} needs the {module!r} package, which is not installed: "
            f"pip install 'jaxlight[{extra}]' (or pip install {module}).",
            name=module,
        ) from exc


def hparams_record(fit, module, extra: dict | None = None) -> dict[str, Any]:
    """What a run records as its configuration: module hyperparameters, Fit, strategy, mesh."""
    devices = jax.devices()
    record = {
        "module": {"class": type(module).__name__, **module.hparams},
        "fit": dict(fit.config),
        "strategy": fit.strategy.describe(),
        "devices": {"count": len(devices), "kind": devices[0].device_kind,
                    "platform": devices[0].platform, "processes": jax.process_count()},
    }
    if extra:
        record.update(extra)
    return plain(record)


def plain(value: Any) -> Any:
    """JSON/YAML-safe values (tuples become lists, unknown objects their repr)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()  # NumPy / JAX scalars
    return repr(value)


def flatten(tree: dict, prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a/b": 1}`, for writers that take flat hyperparameters."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name, sep))
        else:
            out[name] = value
    return out


def is_global_zero() -> bool:
    return jax.process_index() == 0


def checkpoint_dirs(fit, final: bool, logged: set[str]) -> list[tuple[str, list[str], dict]]:
    """Committed checkpoint directories of the fit's ModelCheckpoint callbacks, for loggers
    that upload them (`log_model`).

    Returns (path, aliases, metadata). Final: the best and the last checkpoint; otherwise
    every committed step directory not in `logged` yet.
    """
    found: dict[str, tuple[list[str], dict]] = {}
    for cb in fit.callbacks:
        if not isinstance(cb, ModelCheckpoint):
            continue
        meta = {"monitor": cb.monitor, "mode": cb.mode}
        if final:
            for path, alias in ((cb.best_model_path, "best"), (cb.last_model_path, "latest")):
                if path and os.path.isdir(path):
                    entry = found.setdefault(os.path.abspath(path), ([], dict(meta)))
                    entry[0].append(alias)
            best = cb.best_model_path and os.path.abspath(cb.best_model_path)
            if best in found and cb.best_model_score is not None:
                found[best][1]["score"] = float(cb.best_model_score)
            continue
        dirpath = cb.resolved_dirpath(fit)
        if os.path.isdir(dirpath):
            # orbax writes into "<step>.orbax-checkpoint-tmp..." and renames on commit.
            steps = [e for e in os.scandir(dirpath) if e.is_dir() and e.name.isdigit()]
            for entry in sorted(steps, key=lambda e: int(e.name)):
                found.setdefault(os.path.abspath(entry.path), ([], dict(meta)))
    return [(p, a, m) for p, (a, m) in found.items() if final or p not in logged]
