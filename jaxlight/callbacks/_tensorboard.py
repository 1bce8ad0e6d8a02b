"""TensorBoardLogger: scalars and hyperparameters as TensorBoard event files (no TensorFlow)."""

from __future__ import annotations

import os
import time

import jax

from jaxlight.callbacks._base import Callback
from jaxlight.callbacks._logdir import ensure_writable, flatten, hparams_record, require
from jaxlight.callbacks._plot import MetricRows, plot_curves


class TensorBoardLogger(Callback):
    """Writes every logged metric as a TensorBoard scalar, and the run's hyperparameters.

    Uses TensorBoard's own event-file writer and protocol buffers (the `tensorboard` extra), not
    TensorFlow. The hyperparameters (module arguments, Fit and strategy configuration, mesh)
    appear in TensorBoard's HPARAMS tab; `tensorboard --logdir <save_dir>` shows the run.
    A validate or test after fit writes into the fit's run directory, and checkpoints record
    its version, so a fit resumed from one (in a new process) continues the same directory.
    Only process 0 writes. At the end of a fit the curves also go to `curves.png` in the run
    directory (`plot` extra).

    Args:
        save_dir: root directory (default: `Fit.default_root_dir`).
        name: run subdirectory; `version_N` is appended as in Lightning.
        version: the version number, or None for the next free one.
        flush_secs: how often the writer thread flushes to disk.
        plot: write `curves.png` at the end of a fit.

    Example:
        >>> logger = TensorBoardLogger("logs")   # logs/tensorboard/version_0/events.out...
    """

    is_logger = True

    def __init__(self, save_dir: str | None = None, name: str = "tensorboard",
                 version: int | None = None, flush_secs: float = 10.0, plot: bool = True):
        require("tensorboard", "tensorboard", "TensorBoardLogger")
        self.save_dir = save_dir
        self.name = name
        self.version = version
        self.flush_secs = flush_secs
        self.plot = plot
        self.log_dir: str | None = None
        self._writer = None
        self._hparams_written = False
        self._history = MetricRows()

    def setup(self, fit, module, stage: str) -> None:
        # The directory is checked now (a bad one fails before anything compiles); the version
        # is chosen at the stage's start, after a resumed fit has read the one it continues.
        if jax.process_index() == 0 and self.log_dir is None:
            ensure_writable(os.path.join(self.save_dir or fit.default_root_dir, self.name),
                            "TensorBoardLogger")

    def _open(self, fit, module) -> None:
        if jax.process_index() != 0 or self._writer is not None:
            return
        if self.log_dir is None:
            root = os.path.join(self.save_dir or fit.default_root_dir, self.name)
            version = self.version
            if version is None:
                names = os.listdir(root) if os.path.isdir(root) else []
                taken = [int(d[8:]) for d in names if d.startswith("version_") and d[8:].isdigit()]
                version = max(taken, default=-1) + 1
            self.version = version
            self.log_dir = ensure_writable(os.path.join(root, f"version_{version}"),
                                           "TensorBoardLogger")
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._writer = EventFileWriter(self.log_dir, flush_secs=self.flush_secs)
        if not self._hparams_written:  # once per run directory, not once per stage
            self._write_hparams(fit, module)
            self._hparams_written = True

    def on_fit_start(self, fit, module) -> None:
        self._open(fit, module)

    def on_validation_start(self, fit, module) -> None:
        self._open(fit, module)

    def on_test_start(self, fit, module) -> None:
        self._open(fit, module)

    def state_dict(self) -> dict:
        """The run directory's version, so that a fit resumed from the checkpoint continues
        writing into it."""
        return {"version": self.version} if self.log_dir is not None else {}

    def load_state_dict(self, state: dict) -> None:
        # A resumed fit (in a new process) continues the run directory, whose hyperparameters
        # are already written; a version given to the logger wins.
        if self.log_dir is None and self.version is None and state.get("version") is not None:
            self.version = int(state["version"])
            self._hparams_written = True

    def _write_hparams(self, fit, module) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.hparams import summary_v2

        # The HPARAMS tab takes flat bool/number/string values.
        values = {k: (v if isinstance(v, bool | int | float | str) else str(v))
                  for k, v in flatten(hparams_record(fit, module)).items()}
        summary = summary_v2.hparams_pb(values, start_time_secs=time.time())
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=fit.global_step,
                                               summary=summary))

    def on_log(self, fit, module, metrics, step) -> None:
        if self._writer is None:
            return
        from tensorboard.compat.proto import event_pb2, summary_pb2

        values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v))
                  for k, v in metrics.items()]
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                               summary=summary_pb2.Summary(value=values)))
        self._history.add(step, metrics)

    def on_train_end(self, fit, module) -> None:
        if self._writer is not None:
            self._writer.flush()

    def on_fit_end(self, fit, module) -> None:
        if self.plot and self.log_dir is not None:
            plot_curves(self._history.rows, os.path.join(self.log_dir, "curves.png"),
                        title=type(module).__name__)

    def teardown(self, fit, module, stage: str) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
