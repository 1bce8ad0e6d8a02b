"""LightningCLI's `SaveConfigCallback`: the parsed config, as `--print_config` prints it, written
as `config.yaml` into the run's log directory when a stage starts (process 0 only)."""

from __future__ import annotations

import os

import jax
import numpy as np
import yaml

from jaxlight import callbacks as cbs
from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Logger


class SaveConfigCallback(cbs.Callback):
    """Writes `text` to `<log dir>/<config_filename>` once, when the first stage starts.

    The log directory is Lightning's `trainer.log_dir` for its CSV and TensorBoard loggers: the
    first logger's run directory (`<save_dir>/<name>/version_N`). A run without such a logger
    saves none (Lightning writes into `default_root_dir` or the logger's `save_dir`).
    An existing file is refused on every process, unless `overwrite`, as Lightning does (a
    second run in the same place would replace the record of the first).
    """

    def __init__(self, text: str, config_filename: str = "config.yaml", overwrite: bool = False,
                 resuming: bool = False):
        self.text = text
        self.config_filename = config_filename
        self.overwrite = overwrite
        #: A fit resumed from a checkpoint continues its run directory (TensorBoardLogger's):
        #: the config there is replaced by the resumed run's.
        self.resuming = resuming
        self.already_saved = False
        #: Where the file was written (process 0; None before a stage started).
        self.path: str | None = None

    def _save(self, fit, module=None) -> None:
        if self.already_saved:
            return
        self.already_saved = True
        loggers = [cb for cb in fit.callbacks if isinstance(cb, Logger)]
        # A logger chooses its run directory on process 0 only: the others see None here.
        log_dir = getattr(loggers[0], "log_dir", None) if loggers else None
        path = None if log_dir is None else os.path.join(log_dir, self.config_filename)
        exists = path is not None and jax.process_index() == 0 and os.path.isfile(path)
        if jax.process_count() > 1:
            # Every process enters this broadcast, whatever its own log_dir (a process that
            # skipped it left process 0 waiting until Gloo's deadline): all refuse, or none.
            from jax.experimental import multihost_utils

            exists = bool(multihost_utils.broadcast_one_to_all(np.asarray(exists)))
        if exists and not (self.overwrite or self.resuming):
            raise ConfigurationError(
                f"SaveConfigCallback expected {path or 'the run directory of process 0'}"
                f"{'' if path else '/' + self.config_filename} to NOT exist: a run wrote it "
                "before, and writing this run's config there would replace that record. Delete "
                "it, give another --trainer.default_root_dir, or pass --save_config_kwargs "
                "'{\"overwrite\": true}' to overwrite it (--save_config_callback null: save "
                "none), as LightningCLI's save_config_kwargs / save_config_callback do.")
        if path is None or jax.process_index() != 0:
            # A departure: without a logger's run directory Lightning writes into
            # default_root_dir (or the logger's save_dir), so that the next command there (a
            # validate after a fit, a second fit) is refused.
            return
        os.makedirs(log_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(self.text)
        self.path = path

    # Lightning saves in `setup`; a logger's run directory is chosen when its stage starts, so
    # the file is written then (after the loggers, which come before it among the callbacks).
    on_fit_start = on_validation_start = on_test_start = on_predict_start = _save


def save_config_callbacks(text: str, extras, fast_dev_run, resuming: bool) -> list:
    """LightningCLI's `SaveConfigCallback` (not under `fast_dev_run`, as in Lightning):
    `--save_config_kwargs '{"overwrite": true, "config_filename": "x.yaml"}'`, or
    `--save_config_callback null` for none."""
    which = extras["save_config_callback"]
    if fast_dev_run or (
            which is not None and str(which).lower() in ("null", "none", "false")):
        return []
    if which is not None and which not in ("SaveConfigCallback",):
        raise ConfigurationError(
            f"--save_config_callback {which}: give null (save no config.yaml) or "
            "SaveConfigCallback (the default).")
    kwargs = yaml.safe_load(extras["save_config_kwargs"] or "{}") or {}
    allowed = {"overwrite", "config_filename"}
    if not isinstance(kwargs, dict) or set(kwargs) - allowed:
        raise ConfigurationError(
            f"--save_config_kwargs {extras['save_config_kwargs']}: give a mapping of "
            f"{sorted(allowed)}, e.g. '{{\"overwrite\": true}}'.")
    return [SaveConfigCallback(text, resuming=resuming, **kwargs)]
