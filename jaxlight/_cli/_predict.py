"""`jaxlight predict`'s output: a summary of `Fit.predict`'s batches and the `--output` file."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxlight._errors import ConfigurationError


def check_output_path(path: str | None) -> None:
    """Refuses an `--output` the run could not write, before anything runs."""
    if path is None:
        return
    if not path.endswith(".npz"):
        raise ConfigurationError(
            f"--output {path}: predictions are saved with numpy.savez; give a file name ending "
            f"in .npz (such as {os.path.splitext(path)[0]}.npz)."
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ConfigurationError(f"--output {path}: the folder {folder} does not exist.")


def _name(path: tuple) -> str:
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return ".".join(parts) or "predictions"


def collect(outputs: Sequence[Any]) -> dict[str, np.ndarray]:
    """One array per output leaf (named by its path, `predictions` for a bare array), the
    batches concatenated along the first axis; a leaf whose batches differ in their other
    dimensions (or are scalars) keeps one array per batch, as `<name>/<batch index>`."""
    leaves: dict[str, list[np.ndarray]] = {}
    for batch in outputs:
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            leaves.setdefault(_name(path), []).append(np.asarray(leaf))
    out: dict[str, np.ndarray] = {}
    for name, arrays in leaves.items():
        if all(a.ndim >= 1 and a.shape[1:] == arrays[0].shape[1:] for a in arrays):
            out[name] = np.concatenate(arrays)
        else:
            out.update({f"{name}/{i}": a for i, a in enumerate(arrays)})
    return out


def summarize(outputs: Sequence[Any], arrays: dict[str, np.ndarray]) -> list[str]:
    """The lines `jaxlight predict` prints: batches, then each saved array's shape and dtype."""
    lines = [f"predictions: {len(outputs)} batches"]
    width = max((len(k) for k in arrays), default=0)
    lines += [f"  {k:<{width}}  shape {tuple(v.shape)}  {v.dtype}" for k, v in arrays.items()]
    return lines


def save(path: str, arrays: dict[str, np.ndarray]) -> None:
    """Writes the arrays to `path` (process 0 only: every process holds the global rows)."""
    if jax.process_index() == 0:
        np.savez(path, **arrays)
