"""MLFlowLogger: an MLflow run (a local `file:` store or a tracking server), process 0 only."""

from __future__ import annotations

import os
import re
import time
import warnings
from typing import Any, Literal

import jax

from jaxlight._errors import ConfigurationError, JaxlightWarning
from jaxlight.callbacks._base import Logger
from jaxlight.callbacks._logdir import checkpoint_dirs, flatten, hparams_record, require

FILE_PREFIX = "file:"
#: Lightning's `Logger.LOGGER_JOIN_CHAR`, between `prefix` and a metric's name.
JOIN = "-"


class MLFlowLogger(Logger):
    """Lightning's `MLFlowLogger`: every logged metric at its optimizer step, the module's
    hyperparameters as params, tags, and (with `log_model`) checkpoints as artifacts, in one
    MLflow run. Only process 0 talks to MLflow.

    As Lightning's: the experiment is found by name or created; `run_name` becomes the
    `mlflow.runName` tag; params are flattened with "/" and cut at 250 characters (the module's
    hyperparameters under their own names, jaxlight's fit, strategy and device records under
    `fit/`, `strategy/`, `devices/`); metric names get `prefix` + "-" and lose characters MLflow
    refuses; the run ends FINISHED after the stage, FAILED after an exception. Without
    `tracking_uri` (nor `MLFLOW_TRACKING_URI`) the store is `file:<save_dir>`; MLflow 3 refuses
    a file store unless `MLFLOW_ALLOW_FILE_STORE=true`, which this logger sets for such a URI.

    Needs `mlflow` (`pip install 'jaxlight[mlflow]'`, the `mlflow-skinny` client).

    Args:
        experiment_name: the experiment (created when missing).
        run_name: the run's name.
        tracking_uri: an MLflow tracking URI (`file:/path`, `http://host:5000`, ...).
        tags: tags of the run.
        save_dir: the local store when no `tracking_uri` is given.
        log_model: False; True logs the best and last checkpoints at the end of the fit (of
            `callbacks.ModelCheckpoint`); "all" logs every checkpoint once it is on disk.
        prefix: put before every metric name (with "-").
        artifact_location: where a created experiment stores artifacts.
        run_id: log into this existing run instead of creating one.
        synchronous: MLflow's `log_batch(synchronous=...)` (None: MLflow's default).

    Example:
        >>> from jaxlight import callbacks
        >>> logger = callbacks.MLFlowLogger("demo", tracking_uri="file:./mlruns")  # doctest: +SKIP
    """

    def __init__(self, experiment_name: str = "lightning_logs", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict[str, Any] | None = None,
                 save_dir: str | None = "./mlruns",
                 log_model: Literal[True, False, "all"] = False, prefix: str = "",
                 artifact_location: str | None = None, run_id: str | None = None,
                 synchronous: bool | None = None):
        require("mlflow", "mlflow", "MLFlowLogger")
        if log_model not in (False, True, "all"):
            raise ConfigurationError(
                f"MLFlowLogger(log_model={log_model!r}): use False, True (best and last "
                "checkpoints at the end) or 'all' (every checkpoint once saved).")
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not tracking_uri:
            if save_dir is None:
                raise ConfigurationError(
                    "MLFlowLogger needs a tracking_uri or a save_dir (the local store).")
            tracking_uri = f"{FILE_PREFIX}{save_dir}"
        self._experiment_name = experiment_name
        self._tracking_uri = tracking_uri
        self._run_name = run_name
        self.tags = dict(tags) if tags else None
        self._log_model = log_model
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._run_id = run_id
        self._experiment_id: str | None = None
        self._log_batch_kwargs = {} if synchronous is None else {"synchronous": synchronous}
        self._client = None
        self._params_logged = False
        self._failed = False
        self._logged_paths: set[str] = set()
        self._save_seen = False

    # -- the run -------------------------------------------------------------------------------

    @property
    def experiment(self):
        """The `mlflow.tracking.MlflowClient` (process 0), with the experiment and the run
        created on first use; `self.logger.experiment.log_text(...)` as in Lightning."""
        if self._client is not None and self._experiment_id is not None:
            return self._client
        if self._tracking_uri.startswith(FILE_PREFIX) or "://" not in self._tracking_uri:
            # MLflow 3 refuses a filesystem store unless told that the user wants one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        tracking = require("mlflow.tracking", "mlflow", "MLFlowLogger")
        self._client = tracking.MlflowClient(self._tracking_uri)
        if self._run_id is not None:
            self._experiment_id = self._client.get_run(self._run_id).info.experiment_id
            return self._client
        found = self._client.get_experiment_by_name(self._experiment_name)
        if found is not None and found.lifecycle_stage != "deleted":
            self._experiment_id = found.experiment_id
        else:
            self._experiment_id = self._client.create_experiment(
                name=self._experiment_name, artifact_location=self._artifact_location)
        tags = {str(k): str(v) for k, v in (self.tags or {}).items()}
        if self._run_name is not None:
            if "mlflow.runName" in tags:
                warnings.warn(f"MLFlowLogger: tags hold 'mlflow.runName'; run_name "
                              f"{self._run_name!r} replaces it.", JaxlightWarning, stacklevel=2)
            tags["mlflow.runName"] = self._run_name
        context = require("mlflow.tracking.context.registry", "mlflow", "MLFlowLogger")
        run = self._client.create_run(experiment_id=self._experiment_id,
                                      tags=context.resolve_tags(tags))
        self._run_id = run.info.run_id
        return self._client

    @property
    def run_id(self) -> str | None:
        """The run's id (creates the run on process 0; None on the others)."""
        if jax.process_index() != 0:
            return None
        _ = self.experiment
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        if jax.process_index() != 0:
            return None
        _ = self.experiment
        return self._experiment_id

    name = property(lambda self: self.experiment_id, doc="The experiment id (Lightning's).")
    version = property(lambda self: self.run_id, doc="The run id (Lightning's).")

    @property
    def save_dir(self) -> str | None:
        """The local store's directory for a `file:` URI, else None."""
        if self._tracking_uri.startswith(FILE_PREFIX):
            return self._tracking_uri[len(FILE_PREFIX):]
        return None

    # -- hooks ---------------------------------------------------------------------------------

    def _start(self, fit, module) -> None:
        if jax.process_index() != 0 or self._params_logged:
            return
        self._params_logged = True
        self.log_hyperparams(_params(fit, module))

    def on_fit_start(self, fit, module) -> None:
        self._start(fit, module)

    def on_validation_start(self, fit, module) -> None:
        self._start(fit, module)

    def on_test_start(self, fit, module) -> None:
        self._start(fit, module)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Logs `params` (flattened with "/", values as text cut at 250 characters)."""
        if jax.process_index() != 0:
            return
        entities = require("mlflow.entities", "mlflow", "MLFlowLogger")
        items = [entities.Param(key=k, value=str(v)[:250]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.experiment.log_batch(run_id=self.run_id, params=items[i:i + 100],
                                      **self._log_batch_kwargs)

    def on_log(self, fit, module, metrics, step) -> None:
        if jax.process_index() != 0:
            return
        entities = require("mlflow.entities", "mlflow", "MLFlowLogger")
        stamp = int(time.time() * 1000)
        batch = []
        for key, value in metrics.items():
            if isinstance(value, str):
                continue
            key = f"{self._prefix}{JOIN}{key}" if self._prefix else key
            clean = re.sub("[^a-zA-Z0-9_/. -]+", "", key)
            if clean != key:
                warnings.warn(f"MLflow allows only '_', '/', '.' and ' ' special characters in "
                              f"metric names: {key!r} is logged as {clean!r}.", JaxlightWarning,
                              stacklevel=2)
            batch.append(entities.Metric(key=clean, value=float(value), timestamp=stamp,
                                         step=int(step or 0)))
        if batch:
            self.experiment.log_batch(run_id=self.run_id, metrics=batch,
                                      **self._log_batch_kwargs)
        if self._save_seen and self._log_model == "all":
            self._log_checkpoints(fit, final=False)

    def on_save_checkpoint(self, fit, module, checkpoint) -> None:
        self._save_seen = True  # written now (perhaps asynchronously); logged once committed

    def on_fit_end(self, fit, module) -> None:
        if jax.process_index() == 0 and self._log_model and self._client is not None:
            if self._log_model == "all":
                self._log_checkpoints(fit, final=False)
            self._log_checkpoints(fit, final=True)

    def on_exception(self, fit, module, exception) -> None:
        self._failed = True

    def teardown(self, fit, module, stage: str) -> None:
        self.finalize("failed" if self._failed else "success")
        self._failed = False

    def finalize(self, status: str = "success") -> None:
        """Ends the run: FINISHED ("success"), FAILED ("failed") or the MLflow status given."""
        if jax.process_index() != 0 or self._client is None or self._run_id is None:
            return
        status = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED"}.get(
            status, status)
        self._client.set_terminated(self._run_id, status)

    def _log_checkpoints(self, fit, final: bool) -> None:
        for path, _aliases, _meta in checkpoint_dirs(fit, final, self._logged_paths):
            if path in self._logged_paths:
                continue
            self.experiment.log_artifacts(self.run_id, path,
                                          os.path.basename(path.rstrip(os.sep)))
            self._logged_paths.add(path)


def _params(fit, module) -> dict[str, Any]:
    """The module's hyperparameters under their own names (Lightning's params), then jaxlight's
    fit, strategy and device records."""
    record = hparams_record(fit, module)
    own = dict(record.pop("module"))
    own.pop("class", None)
    return {**own, **record}
