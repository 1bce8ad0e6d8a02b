"""GRPO's sampled completions reach the loggers that take text tables: a real offline W&B run and
a real MLflow file store, both read back from disk; the CSV logger gets only numbers."""

import csv
import json
import os

import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.recipes import grpo
from tests.callbacks.wandb_records import find_runs, read_run

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                       "pretrained", "fixtures", "qwen3")

REWARDS = '''
def correct(prompts, completions, completion_ids, *, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]

def short(prompts, completions, completion_ids, *, id, **kwargs):
    return [None if i % 2 == 0 else float(len(c) <= 2) for c, i in zip(completions, id)]
'''


def _config(tmp_path, log_samples):
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b), "id": i}
            for i, (a, b) in enumerate((a, b) for a in range(1, 5) for b in range(1, 5))]
    with open(tmp_path / "problems.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.data.path, config.data.val_rows = str(tmp_path / "problems.jsonl"), 4
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.updates = 4, 2
    config.grpo.reward_funcs = f"{tmp_path}/rewards.py:correct,{tmp_path}/rewards.py:short"
    config.grpo.log_samples = log_samples
    return config, {r["prompt"]: r for r in rows}


def _check_table(columns, data, by_prompt, steps):
    assert columns == ["step", "generation", "prompt", "completion", "correct", "short",
                       "reward", "advantage"]
    assert len(data) == 6  # --grpo.log_samples rows of each generation batch
    for step, generation, prompt, completion, right, short, reward, advantage in data:
        assert step in steps and generation == (step - 1) // 2
        row = by_prompt[prompt.removeprefix("user: ")] if prompt.startswith("user: ") \
            else by_prompt[prompt]
        assert right == float(completion.strip() == row["answer"])  # the function's own value
        assert (short is None) == (row["id"] % 2 == 0)
        assert reward == pytest.approx(right + (short or 0.0))
        assert isinstance(advantage, float)


@pytest.mark.slow
def test_samples_reach_wandb_and_mlflow_as_tables_read_back(tmp_path, monkeypatch):
    import wandb
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    config, by_prompt = _config(tmp_path, log_samples=6)
    module, data = grpo.build(config)
    w = callbacks.WandbLogger("jaxlight-tests", mode="offline", save_dir=str(tmp_path / "runs"),
                              settings=wandb.Settings(console="off", x_disable_stats=True,
                                                      x_disable_meta=True))
    m = callbacks.MLFlowLogger("samples", tracking_uri=f"file:{tmp_path / 'ml'}")
    c = callbacks.CSVLogger(str(tmp_path / "csv"), plot=False)  # its CSV is read, not its plot
    fit = jl.Fit("single", max_steps=4, log_every_n_steps=2, enable_progress_bar=False,
                 enable_model_summary=False, enable_checkpointing=False, callbacks=[w, m, c])
    fit.fit(module, data.train)
    w.finish()
    assert data.train.generation == 2

    # W&B: a wandb.Table under "completions" at each logging step, beside the metrics.
    [path] = find_runs(str(tmp_path / "runs"))
    rows = read_run(path).rows()
    assert sorted(rows) == [2, 4]
    for step in (2, 4):
        # wandb records the table's reference as nested keys under its name (as TRL's, the
        # name also prefixes the completion-length metrics).
        row = rows[step]
        assert row["completions/_type"] == "table-file" and "loss" in row
        assert row["completions/nrows"] == 6 and row["completions/ncols"] == 8
        with open(os.path.join(w.run_dir, "files", row["completions/path"])) as f:
            table = json.load(f)
        _check_table(table["columns"], table["data"], by_prompt, {step})

    # MLflow: the rows of both logging steps appended to the run's table artifact.
    client = MlflowClient(f"file:{tmp_path / 'ml'}")
    local = client.download_artifacts(m.run_id, "completions.json", str(tmp_path / "dl"))
    with open(local) as f:
        table = json.load(f)
    _check_table(table["columns"], table["data"][:6], by_prompt, {2})
    _check_table(table["columns"], table["data"][6:], by_prompt, {4})
    tags = json.loads(client.get_run(m.run_id).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "completions.json", "type": "table"} in tags

    # CSV: numbers only.
    with open(c.path) as f:
        header = next(csv.reader(f))
    assert "completions" not in header and "rewards/correct/mean" in header


@pytest.mark.slow
def test_no_samples_logged_with_log_samples_zero(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    config, _ = _config(tmp_path, log_samples=0)
    module, data = grpo.build(config)
    m = callbacks.MLFlowLogger("samples", tracking_uri=f"file:{tmp_path / 'ml'}")
    fit = jl.Fit("single", max_steps=2, log_every_n_steps=2, enable_progress_bar=False,
                 enable_model_summary=False, enable_checkpointing=False, callbacks=[m])
    fit.fit(module, data.train)
    client = MlflowClient(f"file:{tmp_path / 'ml'}")
    assert [a.path for a in client.list_artifacts(m.run_id)] == []
    assert client.get_metric_history(m.run_id, "rewards/correct/mean")


def test_sample_table_without_pandas_goes_to_mlflow_as_json_text(tmp_path, monkeypatch):
    import sys

    from mlflow.tracking import MlflowClient

    from jaxlight.posttrain._samples import log_samples

    m = callbacks.MLFlowLogger("samples", tracking_uri=f"file:{tmp_path / 'ml'}")
    monkeypatch.setitem(sys.modules, "pandas", None)
    columns, rows = ["step", "prompt", "completion"], [[3, "1+1?", "2"]]
    assert log_samples([m, callbacks.CSVLogger(str(tmp_path))], columns, rows, 3) == [
        "MLFlowLogger"]
    client = MlflowClient(f"file:{tmp_path / 'ml'}")
    local = client.download_artifacts(m.run_id, "completions/step_000003.json",
                                      str(tmp_path / "dl"))
    with open(local) as f:
        assert json.load(f) == {"columns": columns, "data": rows}


def test_a_negative_log_samples_is_refused(tmp_path):
    config, _ = _config(tmp_path, log_samples=-1)
    with pytest.raises(jl.ConfigurationError, match=r"--grpo.log_samples=-1: give the number"):
        grpo.build(config)
