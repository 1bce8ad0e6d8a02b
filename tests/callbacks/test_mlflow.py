"""MLFlowLogger against a real MLflow file store on disk, read back with MLflow's own client
(the two-process check is in test_loggers.py's `test_only_process_zero_writes`)."""

from __future__ import annotations

import os

import pytest

import jaxlight as jl
from jaxlight import callbacks
from tests.callbacks.test_loggers import Recorder, _data
from tests.models import Classifier


def _client(uri):
    # Imported here, not at collection: MLflow's import costs seconds in every pytest worker.
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a file store
    return mlflow_tracking.MlflowClient(uri)


def _only_run(client, experiment):
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, runs
    return runs[0]


def test_mlflow_run_read_back(tmp_path):
    pytest.importorskip("mlflow.tracking")
    uri = f"file:{tmp_path / 'mlruns'}"
    logger = callbacks.MLFlowLogger("exp", run_name="first", tracking_uri=uri,
                                    tags={"team": "jax"}, log_model=True)
    ckpt = callbacks.ModelCheckpoint(str(tmp_path / "ckpt"), every_n_train_steps=4, save_top_k=1)
    recorder = Recorder()
    fit = jl.Fit("single", max_steps=4, log_every_n_steps=2, callbacks=[logger, ckpt, recorder],
                 enable_progress_bar=False, enable_model_summary=False)
    fit.fit(Classifier(hidden=24, lr=0.05), _data()[0])

    client = _client(uri)
    run = _only_run(client, "exp")
    assert run.info.run_id == logger.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == "first" and run.data.tags["team"] == "jax"
    # Lightning's params: the module's hyperparameters under their names; jaxlight's records.
    assert run.data.params["lr"] == "0.05" and run.data.params["hidden"] == "24"
    assert run.data.params["fit/max_steps"] == "4"
    # Every metric the fit sent, at its step, with its value (validation metrics: the
    # conformance case tests/conformance/test_tuner.py::test_tuner_mlflow_*).
    for name in ("loss", "accuracy"):
        history = client.get_metric_history(run.info.run_id, name)
        expected = sorted((s, m[name]) for s, m in recorder.rows.items() if name in m)
        got = sorted((h.step, h.value) for h in history)
        assert [s for s, _ in got] == [s for s, _ in expected], name
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), name
    assert [h.step for h in client.get_metric_history(run.info.run_id, "loss")] == [2, 4]
    # log_model=True: the best and last checkpoints as artifacts, named by their step.
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"4"}, artifacts


class _Boom(callbacks.Callback):
    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        if fit.global_step == 3:
            raise RuntimeError("boom")


def test_mlflow_prefix_names_and_failed_status(tmp_path):
    pytest.importorskip("mlflow.tracking")
    uri = f"file:{tmp_path / 'mlruns'}"
    logger = callbacks.MLFlowLogger("exp2", tracking_uri=uri, prefix="train")
    fit = jl.Fit("single", max_steps=6, log_every_n_steps=1, callbacks=[logger, _Boom()],
                 enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match="boom"):
        fit.fit(Classifier(hidden=24), _data()[0])
    with pytest.warns(jl.JaxlightWarning, match="'train-a:b' is logged as 'train-ab'"):
        logger.on_log(fit, None, {"a:b": 1.0, "note": "text is not a metric"}, 9)
    client = _client(uri)
    run = _only_run(client, "exp2")
    assert run.info.status == "FAILED"
    assert [h.step for h in client.get_metric_history(run.info.run_id, "train-loss")] == [1, 2]
    assert [(h.step, h.value) for h in client.get_metric_history(run.info.run_id, "train-ab")] \
        == [(9, 1.0)]
    assert "loss" not in run.data.metrics and "train-note" not in run.data.metrics


def test_mlflow_bad_arguments():
    with pytest.raises(jl.ConfigurationError, match="log_model='best'"):
        callbacks.MLFlowLogger(log_model="best")
    with pytest.raises(jl.ConfigurationError, match="tracking_uri or a save_dir"):
        callbacks.MLFlowLogger(save_dir=None, tracking_uri=None)
