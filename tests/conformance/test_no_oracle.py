"""The shared names whose Lightning class cannot run in the oracle's environment (torch CPU and
Lightning only: no mlflow, wandb or rich): MLFlowLogger's, WandbLogger's and RichProgressBar's
arguments. Each test checks jaxlight against what Lightning 2.6's documentation and source say
the argument does, read back with the backend's own client; porting.md's coverage table marks
them "no oracle" (not a conformance case)."""

from __future__ import annotations

import io
import os

import pytest

from jaxlight import callbacks
from tests.conformance._cases import covers, departure
from tests.conformance._jaxlight import Reg, batches, make_fit
from tests.conformance.table import NO_ORACLE

G = "hooks"  # the problem's numbers only: no Lightning fixture of this group's own


class Logged(Reg):
    def __init__(self, lr=0.1, width=3):
        super().__init__(G, lr=lr)


@departure("MLFlowLogger(experiment_name, run_name, tracking_uri, tags, prefix, "
           "artifact_location, synchronous, log_model, run_id): Lightning's documented "
           "behaviour read back with MlflowClient: the run's name and tags, metrics named "
           "'<prefix>-<name>', the experiment's artifact location, checkpoints as artifacts, a "
           "second logger given run_id logging into the same run (with the same Fit arguments: "
           "jaxlight logs them as params, which MLflow will not change); name is the "
           "experiment id, "
           "version the run id, save_dir the file store's path; finalize(status) and "
           "log_hyperparams(params) as Lightning's",
           section=NO_ORACLE)
@covers("MLFlowLogger(experiment_name)", "MLFlowLogger(tracking_uri)", "MLFlowLogger.run_id",
        "MLFlowLogger(run_name)", "MLFlowLogger(tags)", "MLFlowLogger(prefix)",
        "MLFlowLogger(artifact_location)", "MLFlowLogger(synchronous)", "MLFlowLogger(log_model)",
        "MLFlowLogger(run_id)", "MLFlowLogger(save_dir)", "MLFlowLogger.experiment",
        "MLFlowLogger.experiment_id", "MLFlowLogger.name", "MLFlowLogger.version",
        "MLFlowLogger.save_dir", "MLFlowLogger.finalize", "MLFlowLogger.finalize(status)",
        "MLFlowLogger.log_hyperparams", "MLFlowLogger.log_hyperparams(params)")
def test_mlflow_logger_arguments(tmp_path, monkeypatch):
    tracking = pytest.importorskip("mlflow.tracking")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tmp_path / "mlruns"
    uri = f"file:{store}"
    logger = callbacks.MLFlowLogger("exp", run_name="r1", tracking_uri=uri, tags={"team": "jax"},
                                    prefix="pre", artifact_location=str(tmp_path / "art"),
                                    synchronous=True, log_model=True)
    ck = callbacks.ModelCheckpoint(tmp_path / "ck", every_n_train_steps=2)
    make_fit(max_steps=4, log_every_n_steps=2, logger=logger, callbacks=[ck]).fit(
        Logged(width=5), batches(G))
    client = tracking.MlflowClient(uri)
    run = client.get_run(logger.run_id)
    assert (run.info.run_name, run.data.tags["team"]) == ("r1", "jax")
    assert "pre-train_loss" in run.data.metrics and "train_loss" not in run.data.metrics
    assert client.get_experiment(logger.experiment_id).artifact_location.endswith("art")
    assert client.list_artifacts(run.info.run_id)  # log_model=True: the checkpoints
    assert (logger.name, logger.version) == (logger.experiment_id, logger.run_id)
    assert logger.save_dir == str(store)
    assert isinstance(logger.experiment, tracking.MlflowClient)
    logger.log_hyperparams({"extra": 7})
    assert client.get_run(logger.run_id).data.params["extra"] == "7"
    logger.finalize("failed")
    assert client.get_run(logger.run_id).info.status == "FAILED"
    again = callbacks.MLFlowLogger("exp", tracking_uri=uri, run_id=logger.run_id)
    # The Fit's own arguments are params too (fit/max_steps): a run continued with other ones
    # is refused by MLflow, where Lightning (the module's hyperparameters only) continues it.
    with pytest.raises(Exception, match="Changing param values is not allowed"):
        make_fit(max_steps=2, logger=again).fit(Logged(width=5), batches(G))
    again = callbacks.MLFlowLogger("exp", tracking_uri=uri, run_id=logger.run_id)
    make_fit(max_steps=4, log_every_n_steps=2, logger=again).fit(Logged(width=5), batches(G))
    assert again.run_id == logger.run_id
    assert len(client.search_runs([logger.experiment_id])) == 1
    local = callbacks.MLFlowLogger("exp2", save_dir=str(tmp_path / "local"))
    make_fit(max_steps=1, logger=local).fit(Logged(), batches(G))
    assert os.path.isdir(tmp_path / "local") and local.save_dir == str(tmp_path / "local")


@departure("WandbLogger(project, name, save_dir, log_model), offline: the run's project and "
           "name, its files under save_dir, the logger's name and save_dir read back as "
           "Lightning's",
           section=NO_ORACLE)
@covers("WandbLogger(project)", "WandbLogger(name)", "WandbLogger(save_dir)",
        "WandbLogger(log_model)", "WandbLogger.name", "WandbLogger.save_dir")
def test_wandb_logger_arguments(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = callbacks.WandbLogger(project="proj", name="r1", save_dir=str(tmp_path / "wb"),
                                   log_model=False)
    make_fit(max_steps=2, log_every_n_steps=1, logger=logger).fit(Logged(), batches(G))
    assert (logger.name, logger.save_dir) == ("r1", str(tmp_path / "wb"))
    assert os.path.isdir(tmp_path / "wb" / "wandb")
    assert (logger.run.project, logger.run.name) == ("proj", "r1")


@departure("RichProgressBar(refresh_rate, leave, theme, console_kwargs): the bar is drawn on "
           "the console console_kwargs describe, in the theme's style, refreshed every "
           "refresh_rate steps",
           section=NO_ORACLE)
@covers("RichProgressBar(refresh_rate)", "RichProgressBar(leave)", "RichProgressBar(theme)",
        "RichProgressBar(console_kwargs)")
def test_rich_progress_bar_arguments():
    pytest.importorskip("rich")
    out = io.StringIO()
    bar = callbacks.RichProgressBar(refresh_rate=2, leave=True,
                                    theme=callbacks.RichProgressBarTheme(description="green"),
                                    console_kwargs={"file": out, "force_terminal": True,
                                                    "width": 100})
    make_fit(max_epochs=1, limit_train_batches=4, enable_progress_bar=True,
             callbacks=[bar]).fit(Reg(G), batches(G))
    assert "4/4" in out.getvalue()
    out = io.StringIO()
    make_fit(max_epochs=1, limit_train_batches=4, enable_progress_bar=True, callbacks=[
        callbacks.RichProgressBar(refresh_rate=0, console_kwargs={"file": out})]).fit(
        Reg(G), batches(G))
    assert out.getvalue() == ""  # refresh_rate=0: no bar, as Lightning's
