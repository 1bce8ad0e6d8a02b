"""Loggers: CSV, TensorBoard and W&B files read back; curves PNG; bad input; process 0 only."""

import csv
import math
import os
import sys
import textwrap

import pytest
import yaml

import jaxlight as jl
from jaxlight import callbacks, strategies
from jaxlight.callbacks import _plot
from tests.callbacks.wandb_records import find_runs, read_run
from tests.models import Classifier, classification_data, saves_checkpoints

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _data():
    train = jl.data.ArrayLoader(classification_data(128), 32, seed=1)
    val = jl.data.ArrayLoader(classification_data(64, seed=2), 32, shuffle=False)
    return train, val


class Recorder(callbacks.Callback):
    """What the Fit sent to `on_log`, merged per step like the loggers do."""

    def __init__(self):
        self.rows: dict[int, dict] = {}

    def on_log(self, fit, module, metrics, step):
        self.rows.setdefault(step, {}).update(metrics)


def _fit(logger_cbs, strategy="single", max_steps=12, **kw):
    recorder = Recorder()
    # 4 batches per epoch: validation every 6 steps counted across epochs (as in Lightning, an
    # interval longer than the epoch needs check_val_every_n_epoch=None).
    fit = jl.Fit(strategy, max_steps=max_steps, log_every_n_steps=3, val_check_interval=6,
                 check_val_every_n_epoch=None,
                 callbacks=[*logger_cbs, recorder], enable_progress_bar=False,
                 enable_model_summary=False,
                 enable_checkpointing=saves_checkpoints(logger_cbs), **kw)
    train, val = _data()
    fit.fit(Classifier(hidden=24, lr=0.05), train, val)
    return fit, recorder


def _close(a, b):
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-7)


def test_csv_and_tensorboard_read_back(tmp_path):
    csv_logger = callbacks.CSVLogger(str(tmp_path / "logs"))
    tb_logger = callbacks.TensorBoardLogger(str(tmp_path / "logs"))
    fit, rec = _fit([csv_logger, tb_logger])

    # CSV: one row per logged step, each holding every metric logged at that step.
    with open(csv_logger.path) as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(rec.rows) and len(steps) == len(set(steps))
    assert {3, 6, 9, 12} <= set(steps)
    for row in rows:
        for key, value in rec.rows[int(row["step"])].items():
            assert _close(row[key], value), (row["step"], key)
    assert rows[steps.index(6)]["val_loss"] and rows[steps.index(6)]["loss"]  # same row
    with open(os.path.join(csv_logger.log_dir, "hparams.yaml")) as f:
        hparams = yaml.safe_load(f)
    assert hparams["module"] == {"class": "Classifier", "din": 16, "hidden": 24, "classes": 4,
                                 "lr": 0.05}
    assert hparams["strategy"]["mesh"] == {"data": 1} and hparams["fit"]["max_steps"] == 12
    png = os.path.join(csv_logger.log_dir, "curves.png")
    with open(png, "rb") as f:
        assert f.read(8) == PNG_MAGIC and os.path.getsize(png) > 5000

    # TensorBoard: scalars at their steps, hyperparameters in the HPARAMS plugin.
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.plugins.hparams import metadata

    acc = event_accumulator.EventAccumulator(tb_logger.log_dir)
    acc.Reload()
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        logged = {s: m[key] for s, m in rec.rows.items() if key in m}
        read = {e.step: e.value for e in acc.Scalars(key)}
        assert read.keys() == logged.keys(), key
        assert all(_close(read[s], logged[s]) for s in logged), key
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG]
    start = metadata.parse_session_start_info_plugin_data(content)
    assert start.hparams["module/hidden"].number_value == 24
    assert start.hparams["strategy/name"].string_value == "single"
    assert start.hparams["strategy/mesh/data"].number_value == 1
    assert os.path.exists(os.path.join(tb_logger.log_dir, "curves.png"))


def test_plot_without_matplotlib_is_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    monkeypatch.setattr(_plot, "_NOTED", False)
    logger = callbacks.CSVLogger(str(tmp_path))
    _fit([logger], max_steps=6)
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "matplotlib is not installed" in line]
    assert len(notes) == 1 and "jaxlight[plot]" in notes[0]
    assert not os.path.exists(os.path.join(logger.log_dir, "curves.png"))
    assert os.path.getsize(logger.path) > 0


def test_wandb_offline_without_credentials_read_back(tmp_path, monkeypatch, capsys):
    # No key anywhere: the logger must pick offline itself and say how to sync.
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    logger = callbacks.WandbLogger("jaxlight-tests", name="read-back", config={"note": "x"},
                                   save_dir=str(tmp_path / "runs"),
                                   settings=_quiet_settings())
    assert logger.resolved_mode() == "offline"
    fit, rec = _fit([logger], strategy=strategies.DataParallel())
    logger.finish()  # the run stays open for a later validate/test until finish() or exit

    err = capsys.readouterr().err
    assert "no W&B credentials found" in err
    assert f"wandb sync {logger.run_dir}" in err
    [path] = find_runs(str(tmp_path / "runs"))
    assert os.path.dirname(path) == logger.run_dir
    run = read_run(path)
    assert run.run.project == "jaxlight-tests" and run.run.display_name == "read-back"
    assert run.config["module"] == {"class": "Classifier", "din": 16, "hidden": 24,
                                    "classes": 4, "lr": 0.05}
    assert run.config["strategy"]["name"] == "dp"
    assert run.config["strategy"]["mesh"] == {"data": 8}
    assert run.config["fit"]["log_every_n_steps"] == 3 and run.config["note"] == "x"
    rows = run.rows()
    assert sorted(rows) == sorted(rec.rows)
    for step, logged in rec.rows.items():
        assert rows[step].keys() == logged.keys(), step
        assert all(_close(rows[step][k], v) for k, v in logged.items()), step
    assert run.summary["global_step"] == 12
    assert _close(run.summary["val_loss"], fit.callback_metrics["val_loss"])
    assert run.summary["compile_time/train"] > 0
    assert os.path.exists(os.path.join(logger.run_dir, "files", "curves.png"))


def _quiet_settings():
    import wandb

    # No console capture (pytest owns stdout) and no system-metrics sampling (CPU time).
    return wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True)


@pytest.mark.parametrize("log_model", [True, "all"])
def test_wandb_logs_checkpoints_as_artifacts(tmp_path, monkeypatch, log_model):
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    ckpt = callbacks.ModelCheckpoint(str(tmp_path / "ckpt"), every_n_steps=4, monitor="val_loss",
                                     save_top_k=-1)
    logger = callbacks.WandbLogger("jaxlight-tests", mode="offline", log_model=log_model,
                                   save_dir=str(tmp_path), settings=_quiet_settings())
    _fit([ckpt, logger])
    logger.finish()
    run = read_run(find_runs(str(tmp_path))[0])
    assert run.exited and run.artifacts, "no artifact record in the run"

    def step_dirs(artifact):
        return {entry.path.split("/")[0] for entry in artifact.manifest.contents}

    for art in run.artifacts:
        assert art.type == "model" and art.name == f"model-{logger.run_id}"
        assert len(step_dirs(art)) == 1 and len(art.manifest.contents) > 1
    [best] = [a for a in run.artifacts if "best" in a.aliases]
    assert step_dirs(best) == {os.path.basename(ckpt.best_model_path)}
    # W&B gives "latest" to the newest version: the last checkpoint is logged last.
    assert step_dirs(run.artifacts[-1]) == {"12"} and "latest" in run.artifacts[-1].aliases
    logged = set().union(*(step_dirs(a) for a in run.artifacts))
    # True: the best and the last checkpoint; "all": every checkpoint as it was saved.
    if log_model == "all":
        assert {"8", "12"} <= logged and len(run.artifacts) >= 3
    else:
        assert logged == step_dirs(best) | {"12"} and len(run.artifacts) <= 2


def test_wandb_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'jaxlight\[wandb\]'"):
        callbacks.WandbLogger("p")


def test_tensorboard_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'jaxlight\[tensorboard\]'"):
        callbacks.TensorBoardLogger("logs")


@pytest.mark.parametrize("make", [
    lambda d: callbacks.CSVLogger(d),
    lambda d: callbacks.TensorBoardLogger(d),
    lambda d: callbacks.WandbLogger("p", mode="offline", save_dir=d),
    lambda d: callbacks.Profiler(logdir=d),
], ids=["csv", "tensorboard", "wandb", "profiler"])
def test_unwritable_logdir_fails_before_training(tmp_path, make):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = str(blocker / "logs")
    fit = jl.Fit("single", max_steps=3, callbacks=[make(bad)], enable_progress_bar=False,
                 enable_model_summary=False)
    train, _ = _data()
    with pytest.raises(jl.ConfigurationError, match=r"cannot write to '.*a-file.*': Not a direct"):
        fit.fit(Classifier(), train)
    assert fit.global_step == 0 and "train" not in fit.compile_counts


_TWO_PROCESS_SCRIPT = textwrap.dedent("""
    import os, sys
    root = sys.argv[1]
    rank = int(os.environ["RANK"])
    os.chdir(os.path.join(root, f"cwd{rank}"))  # default_root_dir: one per process
    import wandb
    import jax
    import jaxlight as jl
    from jaxlight import callbacks, strategies
    from tests.models import Classifier, classification_data

    logs = os.path.join(root, "logs")
    cbs = [callbacks.CSVLogger(logs), callbacks.TensorBoardLogger(logs),
           callbacks.WandbLogger("two-proc", save_dir=logs, mode="offline",
                                 settings=wandb.Settings(console="off", x_disable_stats=True)),
           callbacks.ThroughputMonitor(), callbacks.Profiler(start_step=2, num_steps=1),
           callbacks.MLFlowLogger("two-proc", tracking_uri="file:" + os.path.join(logs, "ml"))]
    fit = jl.Fit(strategies.DataParallel(), max_steps=6, log_every_n_steps=3, callbacks=cbs,
                 enable_progress_bar=False, enable_model_summary=False)
    fit.fit(Classifier(), jl.data.ArrayLoader(classification_data(256), 32, shuffle=False))
    print("DONE", rank, jax.process_count(), jax.device_count(), fit.logged_metrics["loss"])
""")


@pytest.mark.slow
def test_only_process_zero_writes(tmp_path):
    from tests.distributed._launch_util import run_processes

    for rank in (0, 1):
        (tmp_path / f"cwd{rank}").mkdir()
    results = run_processes(_TWO_PROCESS_SCRIPT, [str(tmp_path)], nprocs=2, devices_per_proc=4,
                            timeout=300)
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
        assert f"DONE {r.rank} 2 8" in r.stdout, r.output[-4000:]
    logs = tmp_path / "logs"
    # One run directory per logger, written by process 0 alone.
    assert sorted(os.listdir(logs / "csv")) == ["version_0"]
    assert sorted(os.listdir(logs / "tensorboard")) == ["version_0"]
    assert len(find_runs(str(logs))) == 1
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for a file store
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file:{logs / 'ml'}")
    [run] = client.search_runs([client.get_experiment_by_name("two-proc").experiment_id])
    assert [h.step for h in client.get_metric_history(run.info.run_id, "loss")] == [3, 6]
    events = os.listdir(logs / "tensorboard" / "version_0")
    assert len([e for e in events if e.startswith("events.out")]) == 1
    with open(logs / "csv" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows if r["loss"]] == [3, 6]
    # Samples count the global batch (16 per process x 2 processes).
    assert float(rows[-1]["throughput/samples_per_sec"]) == pytest.approx(
        32 * float(rows[-1]["throughput/steps_per_sec"]))
    # Each process traces its own devices; process 1 writes nothing else.
    for rank in (0, 1):
        profile = tmp_path / f"cwd{rank}" / "jaxlight_logs" / "profile" / f"process_{rank}"
        traces = list(profile.glob("plugins/profile/*/*.xplane.pb"))
        assert traces and all(t.stat().st_size > 0 for t in traces), rank
    assert sorted(os.listdir(tmp_path / "cwd1" / "jaxlight_logs")) == ["profile"]
    # The default checkpoint goes to process 0's <default_root_dir>/checkpoints, as Lightning's
    # ModelCheckpoint broadcasts its directory: one directory for the job, not one per process.
    saved = os.listdir(tmp_path / "cwd0" / "jaxlight_logs" / "checkpoints")
    assert saved == ["6"], saved  # max_steps=6 ends the first epoch at step 6
