"""CSVLogger: one row per log step and the curves as a PNG, written by process 0 only."""

from __future__ import annotations

import csv
import os

import jax
import yaml

from jaxlight.callbacks._base import Logger
from jaxlight.callbacks._logdir import ensure_writable, hparams_record
from jaxlight.callbacks._plot import plot_curves


class CSVLogger(Logger):
    """Writes `metrics.csv` (one row per logged step), `hparams.yaml` and `curves.png`.

    Metrics logged at the same step (training metrics, then validation metrics or a monitor's
    throughput) share one row. A row is written once its step is complete (the next step
    arrives, or a stage ends); when a new metric name appears the file is rewritten with the
    wider header, so the CSV always reads back with one header. At the end of a fit the
    training and validation curves go to `curves.png` (needs the `plot` extra; without it,
    one line says so).

    This is the default logger (`Fit(logger=True)`), so a plain fit leaves its curves in
    `jaxlight_logs/csv/version_N/`.

    Args:
        save_dir: root directory (default: `Fit.default_root_dir`).
        name: run subdirectory; `version_N` is appended as in Lightning.
        version: the version number, or None for the next free one.
        plot: write `curves.png` at the end of a fit.

    Example:
        >>> logger = CSVLogger("logs", name="mlp")   # logs/mlp/version_0/metrics.csv
    """

    def __init__(self, save_dir: str | None = None, name: str = "csv", version: int | None = None,
                 plot: bool = True):
        self.save_dir = save_dir
        self.name = name
        self.version = version
        self.plot = plot
        self.log_dir: str | None = None
        self._rows: list[tuple[int, dict[str, float]]] = []  # every complete row, in order
        self._open: tuple[int, dict[str, float]] | None = None  # the row still collecting
        self._keys: list[str] = []
        self._written = 0  # rows of self._rows already in the file

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
        log_dir = ensure_writable(os.path.join(root, f"version_{version}"), "CSVLogger")
        with open(os.path.join(log_dir, "hparams.yaml"), "w") as f:
            yaml.safe_dump(hparams_record(fit, module), f, sort_keys=False)
        self.log_dir = log_dir

    @property
    def path(self) -> str | None:
        """The CSV file, once `setup` has chosen the run directory."""
        return None if self.log_dir is None else os.path.join(self.log_dir, "metrics.csv")

    @property
    def rows(self) -> list[tuple[int, dict[str, float]]]:
        """Every logged `(step, metrics)` row so far, the one still collecting included."""
        return self._rows + ([self._open] if self._open is not None else [])

    def on_log(self, fit, module, metrics, step) -> None:
        if self.log_dir is None:
            return
        if self._open is not None and self._open[0] == step:
            self._open[1].update(metrics)
            return
        self._close_row()
        self._open = (int(step), dict(metrics))

    def _close_row(self) -> None:
        if self._open is not None:
            self._rows.append(self._open)
            self._open = None
        self._flush()

    def _flush(self) -> None:
        pending = self._rows[self._written:]
        if not pending or self.path is None:
            return
        new = [k for _, m in pending for k in m if k not in self._keys]
        if new or self._written == 0:
            self._keys.extend(dict.fromkeys(new))
            self._write(self._rows, "w")
        else:
            self._write(pending, "a")
        self._written = len(self._rows)

    def _write(self, rows, mode: str) -> None:
        with open(self.path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", *self._keys])
            if mode == "w":
                writer.writeheader()
            writer.writerows({"step": s, **m} for s, m in rows)

    # A stage's end completes its last row, so the file is whole whenever the loop is idle.
    def on_train_end(self, fit, module) -> None:
        self._close_row()

    def on_exception(self, fit, module, exception) -> None:
        self._close_row()

    def on_fit_end(self, fit, module) -> None:
        self._close_row()
        if self.plot and self.log_dir is not None:
            plot_curves(self._rows, os.path.join(self.log_dir, "curves.png"),
                        title=type(module).__name__)

    def teardown(self, fit, module, stage: str) -> None:
        self._close_row()
