"""WandbLogger: Weights & Biases runs (offline when there is no API key), process 0 only."""

from __future__ import annotations

import atexit
import netrc
import os
import sys
from typing import Any
from urllib.parse import urlparse

import jax

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Logger
from jaxlight.callbacks._logdir import (
    checkpoint_dirs,
    ensure_writable,
    hparams_record,
    plain,
    require,
)
from jaxlight.callbacks._plot import MetricRows, plot_curves


def has_wandb_credentials() -> bool:
    """True when wandb could authenticate without asking: an API key in the environment, an
    identity token file, or a netrc entry for the W&B host. Reads no network."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC", os.path.join(os.path.expanduser("~"), ".netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger(Logger):
    """Logs a fit to Weights & Biases: configuration, every logged metric, summary, checkpoints.

    The run's config holds the module's constructor arguments, the Fit configuration and the
    strategy (mesh included), plus `config`. Every metric sent to `on_log` is logged at its
    optimizer step; the summary gets the final metrics, the step and compile times. With
    `log_model`, the checkpoints of `callbacks.ModelCheckpoint` become `model` artifacts.

    Without credentials (no `WANDB_API_KEY`, no `wandb login`) and no explicit `mode`, the run
    is offline: it is written under `<save_dir>/wandb/` and the logger prints the directory and
    the `wandb sync` command that uploads it. Only process 0 logs.

    One logger is one W&B run, as in Lightning: a `validate` or `test` after `fit` logs into
    the fit's run, which stays open until `finish()` or the end of the process. Checkpoints
    record the run's id, so a fit resumed from one (`ckpt_path`, in a new process) continues
    the same run (`resume="allow"`; offline, `wandb sync` merges the two directories into it).

    Args:
        project: the W&B project.
        name: the run's display name (default: chosen by W&B).
        config: extra configuration merged into the recorded hyperparameters.
        mode: "online", "offline" or "disabled"; None means online with credentials, offline
            without (`WANDB_MODE` in the environment also decides).
        log_model: False; True to log the best and last checkpoints at the end of the fit;
            "all" to log every checkpoint as it is saved.
        save_dir: where the `wandb/` directory goes (default: `Fit.default_root_dir`).
        plot: also write `curves.png` (training and validation curves) into the run's files.
        **init_kwargs: passed to `wandb.init` (entity, tags, group, notes, settings, ...).

    Example:
        >>> logger = WandbLogger(project="demo", mode="offline")  # doctest: +SKIP
    """

    def __init__(self, project: str | None = None, name: str | None = None,
                 config: dict[str, Any] | None = None, mode: str | None = None,
                 log_model: bool | str = False, save_dir: str | None = None, plot: bool = True,
                 **init_kwargs: Any):
        self._wandb = require("wandb", "wandb", "WandbLogger")
        if log_model not in (False, True, "all"):
            raise ConfigurationError(
                f"WandbLogger(log_model={log_model!r}): use False, True (best and last "
                "checkpoints at the end) or 'all' (every checkpoint as it is saved)."
            )
        if mode not in (None, "online", "offline", "disabled"):
            raise ConfigurationError(
                f"WandbLogger(mode={mode!r}): use 'online', 'offline', 'disabled' or None."
            )
        self.project = project
        self.name = name
        self.config = dict(config or {})
        self.mode = mode
        self.log_model = log_model
        self.save_dir = save_dir
        self.plot = plot
        self.init_kwargs = init_kwargs
        self.run = None
        self.run_id: str | None = None
        self.run_dir: str | None = None  # the run's directory (what `wandb sync` takes)
        self._history = MetricRows()
        self._logged_paths: set[str] = set()
        self._save_seen = False
        self._save_path: str | None = None
        self._resume_id: str | None = None  # from a checkpoint (load_state_dict)
        self._finish_at_exit = False

    # -- lifecycle ---------------------------------------------------------------------------

    def resolved_mode(self) -> str:
        """The mode the run will use, following `mode`, `WANDB_MODE` and the credentials."""
        if self.mode is not None:
            return self.mode
        env = os.environ.get("WANDB_MODE")
        if env:
            return {"run": "online", "dryrun": "offline"}.get(env, env)
        return "online" if has_wandb_credentials() else "offline"

    def setup(self, fit, module, stage: str) -> None:
        # The directory is checked now, so that a bad one fails before anything compiles; the
        # run starts at the stage's start, after a resumed fit has read the run id it continues.
        if jax.process_index() == 0 and self.run is None:
            # Absolute: wandb's service process resolves a relative dir against its own working
            # directory (the first run's), not this process's current one.
            self._save_path = os.path.abspath(ensure_writable(
                self.save_dir or fit.default_root_dir, "WandbLogger"))

    def _start_run(self, fit, module) -> None:
        if jax.process_index() != 0 or self.run is not None:
            return
        save_dir = self._save_path or os.path.abspath(ensure_writable(
            self.save_dir or fit.default_root_dir, "WandbLogger"))
        mode = self.resolved_mode()
        if mode == "offline" and self.mode is None and not os.environ.get("WANDB_MODE"):
            print("jaxlight: no W&B credentials found (WANDB_API_KEY or `wandb login`), so "
                  "the W&B run is offline.", file=sys.stderr)
        kwargs = dict(self.init_kwargs)
        resume_id = self._resume_id or self.run_id
        if resume_id is not None:  # a resumed fit, or a stage after finish(): the same run
            kwargs.setdefault("id", resume_id)
            kwargs.setdefault("resume", "allow")
        self.run = self._wandb.init(
            project=self.project, name=self.name, dir=save_dir, mode=mode,
            config={**hparams_record(fit, module), **plain(self.config)},
            reinit="create_new", **kwargs,
        )
        self.run_id = self.run.id
        self.run_dir = getattr(self.run.settings, "sync_dir", None) or os.path.dirname(
            self.run.dir)
        if not self._finish_at_exit:
            # Registered after wandb's own exit hook, so it runs first: the sync hint and a
            # complete run directory at the end of a script that never called finish().
            atexit.register(self.finish)
            self._finish_at_exit = True

    def on_fit_start(self, fit, module) -> None:
        self._start_run(fit, module)

    def on_validation_start(self, fit, module) -> None:
        self._start_run(fit, module)

    def on_test_start(self, fit, module) -> None:
        self._start_run(fit, module)

    def state_dict(self) -> dict[str, Any]:
        """The run's id, so that a fit resumed from the checkpoint continues the run."""
        return {"run_id": self.run_id} if self.run_id is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.run is None and state.get("run_id"):
            self._resume_id = state["run_id"]

    def on_log(self, fit, module, metrics, step) -> None:
        if self._save_path is None:
            return  # not set up (another process, or a predict stage)
        self._start_run(fit, module)
        self.run.log(dict(metrics), step=int(step))
        self._history.add(step, metrics)
        if self._save_seen and self.log_model == "all":
            self._log_checkpoints(fit, final=False)

    def on_save_checkpoint(self, fit, module, checkpoint) -> None:
        # The checkpoint is being written now (asynchronously, perhaps); it is logged once a
        # later hook finds it committed on disk.
        self._save_seen = True

    def on_fit_end(self, fit, module) -> None:
        if self.run is None:
            return
        if self.log_model:
            self._log_checkpoints(fit, final=True)
        if self.plot and os.path.isdir(self.run.dir):  # a disabled run has no directory
            plot_curves(self._history.rows, os.path.join(self.run.dir, "curves.png"),
                        title=type(module).__name__)

    def on_exception(self, fit, module, exception) -> None:
        if self.run is not None:
            self.run.summary["exception"] = f"{type(exception).__name__}: {exception}"

    def teardown(self, fit, module, stage: str) -> None:
        if self.run is None:
            return
        summary = {"global_step": fit.global_step, **fit.callback_metrics}
        summary.update({f"compile_time/{k}": v for k, v in fit.compile_times.items()})
        self.run.summary.update(plain(summary))

    def finish(self) -> None:
        """Ends the W&B run (offline: prints the `wandb sync` command). A later stage starts
        logging into the same run id again. Called at the end of the process if not before."""
        if self.run is None:
            return
        offline = self.run.settings.mode == "offline" or getattr(
            self.run.settings, "_offline", False)
        self.run.finish()
        self.run = None
        if offline:
            print(f"jaxlight: W&B run {self.run_id} is stored offline in {self.run_dir}; "
                  f"upload it with: wandb sync {self.run_dir}", file=sys.stderr)

    # -- checkpoints as artifacts ------------------------------------------------------------

    def _log_checkpoints(self, fit, final: bool) -> None:
        if self.run.settings.mode == "disabled":
            return
        if final and self.log_model == "all":
            self._log_checkpoints(fit, final=False)  # the saves since the last log round
        for path, aliases, meta in checkpoint_dirs(fit, final, self._logged_paths):
            artifact = self._wandb.Artifact(f"model-{self.run_id}", type="model",
                                            metadata=plain({**meta, "path": path,
                                                            "global_step": fit.global_step}))
            artifact.add_dir(path, name=os.path.basename(path.rstrip(os.sep)))
            # W&B moves "latest" to each newly logged version by itself; the final pass logs
            # the last checkpoint last, so "latest" ends on it.
            self.run.log_artifact(artifact, aliases=aliases or None)
            self._logged_paths.add(path)
