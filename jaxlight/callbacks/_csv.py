"""CSVLogger: one row per log step, written by process 0 only."""

from __future__ import annotations

import csv
import os

import jax

from jaxlight.callbacks._base import Callback


class CSVLogger(Callback):
    """Writes `metrics.csv` (a row per logged step) and `hparams.yaml`.

    Rows are written as metrics arrive; when a new metric name appears (validation after the
    first training rows) the file is rewritten with the wider header.

    Args:
        save_dir: root directory (default: `Fit.default_root_dir`).
        name: run subdirectory; `version_N` is appended as in Lightning.
        version: the version number, or None for the next free one.
    """

    is_logger = True

    def __init__(self, save_dir: str | None = None, name: str = "csv", version: int | None = None):
        self.save_dir = save_dir
        self.name = name
        self.version = version
        self.log_dir: str | None = None
        self._rows: list[dict] = []
        self._keys: list[str] = []

    def setup(self, fit, module, stage: str) -> None:
        if jax.process_index() != 0 or self.log_dir is not None:
            return
        root = os.path.join(self.save_dir or fit.default_root_dir, self.name)
        version = self.version
        if version is None:
            existing = [int(d.split("_")[1]) for d in (os.listdir(root) if os.path.isdir(root)
                                                       else []) if d.startswith("version_")
                        and d.split("_")[1].isdigit()]
            version = max(existing, default=-1) + 1
        self.log_dir = os.path.join(root, f"version_{version}")
        os.makedirs(self.log_dir, exist_ok=True)
        import yaml

        hparams = {"module": module.hparams, "fit": fit.config,
                   "strategy": fit.strategy.describe()}
        with open(os.path.join(self.log_dir, "hparams.yaml"), "w") as f:
            yaml.safe_dump(_plain(hparams), f, sort_keys=False)

    @property
    def path(self) -> str | None:
        return None if self.log_dir is None else os.path.join(self.log_dir, "metrics.csv")

    def on_log(self, fit, module, metrics, step) -> None:
        if self.log_dir is None:
            return
        row = {"step": step, **metrics}
        self._rows.append(row)
        new = [k for k in row if k not in self._keys]
        if new:
            self._keys.extend(new)
            self._write_all()
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self._keys).writerow(row)

    def _write_all(self) -> None:
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._keys)
            writer.writeheader()
            writer.writerows(self._rows)


def _plain(value):
    """Hyperparameters as YAML-safe values (unknown objects become their repr)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return repr(value)
