"""One run per fit, read back from real offline W&B runs and TensorBoard event files: the
command line's final validation logs into the fit's run (never a second run, never the same value
twice), and a fit resumed from a checkpoint in a new process continues the run."""

from __future__ import annotations

import os
import time

import pytest

from jaxlight._cli import run
from tests.callbacks.wandb_records import find_runs, read_run

SMALL = ["--model.width", "16", "--model.hidden", "16", "--enable-progress-bar", "false",
         "--enable-model-summary", "false", "--log-every-n-steps", "2",
         "--val-check-interval", "2"]


@pytest.fixture(autouse=True)
def _quiet_offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # pytest owns stdout
    monkeypatch.setenv("WANDB__DISABLE_STATS", "true")  # no system-metrics sampling
    monkeypatch.setenv("WANDB__DISABLE_META", "true")
    for name in ("DATA", "CACHE", "CONFIG"):
        monkeypatch.setenv(f"WANDB_{name}_DIR", str(tmp_path / f"wandb-{name.lower()}"))


def _runs(root: str, count: int, timeout: float = 60.0) -> list[str]:
    """The run files under `root` once `count` exist: wandb's service writes a finished run's
    file a moment after `finish()` returns (see wandb_records.read_run)."""
    deadline = time.monotonic() + timeout
    while len(found := find_runs(root)) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _tensorboard(root: str) -> dict[str, list[int]]:
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(root)
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.slow
def test_cli_fit_is_one_run_and_a_resumed_fit_continues_it():
    loggers = ["--logger", "wandb,tensorboard"]
    # Validates at steps 2 and 4; the fit's validation at step 4 is the final report.
    first = run("fit", "digits", ["--max-steps", "4", "--checkpoint-every-n-steps", "4",
                                  *loggers, *SMALL])
    [path] = _runs("jaxlight_logs", 1)
    wandb_run = read_run(path)
    assert wandb_run.exited
    rows = wandb_run.rows()
    assert [s for s, r in sorted(rows.items()) if "val_loss" in r] == [2, 4]
    assert rows[4]["val_loss"] == pytest.approx(first.metrics["val_loss"], rel=1e-6)
    tb = _tensorboard("jaxlight_logs/tensorboard/version_0")
    assert tb["val_loss"] == [2, 4] and tb["loss"] == [2, 4]

    # A new process (a new logger) resumes at step 4 and trains to 5: the fit validates no
    # more, the final validation at step 5 goes into the same W&B run, once.
    second = run("fit", "digits", ["--max-steps", "5", "--ckpt-path", "last", *loggers, *SMALL])
    paths = _runs("jaxlight_logs", 2)
    assert len(paths) == 2  # offline, each process writes a directory; `wandb sync` merges them
    resumed = read_run(next(p for p in paths if p != path))
    assert resumed.exited and resumed.run.run_id == wandb_run.run.run_id
    rows = resumed.rows()
    assert [s for s, r in sorted(rows.items()) if "val_loss" in r] == [5]
    assert rows[5]["val_loss"] == pytest.approx(second.metrics["val_loss"], rel=1e-6)
    assert second.metrics["global_step"] == 5
    # TensorBoard: the resumed fit continues the run directory, each value once per step.
    assert os.listdir("jaxlight_logs/tensorboard") == ["version_0"]
    tb = _tensorboard("jaxlight_logs/tensorboard/version_0")
    # The training loss at the log intervals only (step 5 is not one: Lightning's loggers get
    # no row there either); validation runs at the end, so val_loss has step 5.
    assert tb["val_loss"] == [2, 4, 5] and tb["loss"] == [2, 4]
