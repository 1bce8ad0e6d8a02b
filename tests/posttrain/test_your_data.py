"""GRPO and DPO on a user's own data with TRL's reward-function contract: rows with extra columns
from a local file, reward functions `f(prompts, completions, completion_ids, **columns)` named
`PATH.py:fn` as the command line names them, weights, per-function logs; the built-in
arithmetic task; DPO pairs through the same reader."""

import json
import math
import os
import re

import numpy as np
import pytest

import jaxlight as jl
from jaxlight import posttrain
from jaxlight.nn.pretrained import Tokenizer
from jaxlight.posttrain._data import prompt_rows, read_rows
from jaxlight.recipes import dpo, grpo
from jaxlight.recipes._grpo_tasks import load_function

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                       "pretrained", "fixtures", "qwen3")

REWARDS = '''
SEEN = []

def correct(prompts, completions, completion_ids, *, answer, id, **kwargs):
    SEEN.append((list(prompts), list(answer), list(id), [len(c) for c in completion_ids]))
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

def short(prompts, completions, completion_ids, **kwargs):
    # Not applicable (None) to the problems with an even id.
    return [None if i % 2 == 0 else float(len(c) <= 2) for c, i in
            zip(completions, kwargs["id"])]
'''


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_read_rows_jsonl_json_and_its_errors(tmp_path):
    rows = [{"prompt": "1+1?", "answer": "2", "id": 0},
            {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4", "id": 1}]
    write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "a.json").write_text(json.dumps(rows))
    assert read_rows(str(tmp_path / "a.jsonl")) == rows == read_rows(str(tmp_path / "a.json"))
    messages, columns = prompt_rows(rows)
    assert messages[0] == [{"role": "user", "content": "1+1?"}] and messages[1] == rows[1]["prompt"]
    assert columns == {"answer": ["2", "4"], "id": [0, 1]}
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(jl.DataError, match=r"bad.jsonl:2: not JSON"):
        read_rows(str(tmp_path / "bad.jsonl"))
    with pytest.raises(jl.DataError, match=r"needs a 'prompt' column.*\['question'\]"):
        prompt_rows([{"question": "x"}])
    with pytest.raises(jl.DataError, match=r"row 1 has columns \['prompt'\], row 0 has "
                                           r"\['answer', 'prompt'\]"):
        prompt_rows([{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    with pytest.raises(jl.DataError, match=r"no dataset at 'nowhere.jsonl'"):
        read_rows("nowhere.jsonl")


def test_reward_functions_named_on_the_command_line(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    fn = load_function(f"{tmp_path}/rewards.py:correct")
    assert fn(["p"], ["4 "], [[1]], answer=["4"], id=[3]) == [1.0]
    with pytest.raises(jl.ConfigurationError, match=r"has no function 'corect' \(it has "
                                                    r"\['correct', 'short'\]\)"):
        load_function(f"{tmp_path}/rewards.py:corect")
    with pytest.raises(jl.ConfigurationError, match=r"PATH.py:function"):
        load_function("rewards.py")


def test_arithmetic_task_is_offline_deterministic_and_exact():
    rows = grpo.arithmetic_rows(50, seed=1)
    assert rows == grpo.arithmetic_rows(50, seed=1) != grpo.arithmetic_rows(50, seed=2)
    for r in rows:  # the stated answer is the problem's
        a, b = (int(x) for x in re.findall(r"\d+", r["prompt"]))
        assert int(r["answer"]) == (a + b if "more" in r["prompt"] else
                                    a - b if "away" in r["prompt"] else a * b)
    assert grpo.answer_reward(["q"] * 4, ["12", "It is 12.", "120", "1 2"], None,
                              answer=["12"] * 4) == [1.0, 1.0, 0.0, 0.0]
    assert grpo.integer_format_reward(["q"] * 3, [" 12 ", "12.", "x"]) == [0.5, 0.0, 0.0]


def _config(tmp_path, **grpo_options):
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b), "id": i}
            for i, (a, b) in enumerate((a, b) for a in range(1, 5) for b in range(1, 5))]
    write_jsonl(tmp_path / "problems.jsonl", rows)
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.data.path, config.data.val_rows = str(tmp_path / "problems.jsonl"), 4
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens = 4
    config.grpo.reward_funcs = f"{tmp_path}/rewards.py:correct,{tmp_path}/rewards.py:short"
    for k, v in grpo_options.items():
        setattr(config.grpo, k, v)
    return config, {r["id"]: r for r in rows}


def test_reward_weights_must_match_the_functions(tmp_path):
    config, _ = _config(tmp_path, reward_weights="1,0.5,2")
    with pytest.raises(jl.ConfigurationError, match=r"reward_weights has 3 values for 2 reward"):
        grpo.build(config)


@pytest.mark.slow
def test_grpo_on_a_jsonl_with_columns_and_two_weighted_reward_functions(tmp_path):
    config, by_id = _config(tmp_path, reward_weights="1,0.5")
    module, data = grpo.build(config)
    feed = data.train
    fit = jl.Fit("fsdp", max_steps=2, log_every_n_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, enable_checkpointing=False)
    fit.fit(module, feed)
    seen = feed.reward_funcs[0].__globals__["SEEN"]
    assert len(seen) == feed.generation == 1  # one batched call per generation batch
    prompts, answers, ids, lengths = seen[0]
    assert len(prompts) == 8 and all(1 <= n <= 4 for n in lengths)
    for prompt, answer, i in zip(prompts, answers, ids, strict=True):  # each row's own columns
        assert prompt == by_id[i]["prompt"] and answer == by_id[i]["answer"]
    m = fit.callback_metrics
    for key in ("rewards/correct/mean", "rewards/correct/std", "rewards/short/mean",
                "rewards/short/std", "completions/mean_length", "completions/max_length",
                "completions/clipped_ratio", "entropy", "kl", "kl_penalty", "pg_clipfrac",
                "reward", "reward_std"):
        assert key in m and math.isfinite(m[key]), (key, m)
    assert m["kl"] >= 0 and m["entropy"] > 0 and 1 <= m["completions/max_length"] <= 4
    # The held-out greedy reward names each function.
    out = grpo.after_fit(fit, module, data, config)
    assert {"val_reward", "val_reward_correct", "val_reward_short"} <= set(out)


@pytest.mark.slow
def test_rollout_sums_weighted_rewards_over_applicable_functions(tmp_path):
    from jaxlight.nn.pretrained import from_pretrained
    tokenizer = Tokenizer(FIXTURE)
    rows = [{"prompt": "What is 1 plus 1?", "answer": "2", "id": 0},
            {"prompt": "What is 1 plus 2?", "answer": "3", "id": 1}]
    (tmp_path / "rewards.py").write_text(REWARDS)
    fns = [load_function(f"{tmp_path}/rewards.py:{n}") for n in ("correct", "short")]
    messages, columns = prompt_rows(rows)
    prompts = grpo.encode_prompts(tokenizer, messages)
    batch = posttrain.rollout(from_pretrained(FIXTURE), prompts, group_size=4, max_new_tokens=3,
                              reward_funcs=fns, decode=tokenizer.decode, columns=columns,
                              reward_weights=[1.0, 0.5],
                              reward_prompts=[r["prompt"] for r in rows])
    by_fn = batch["rewards_by_fn"]
    assert np.isnan(by_fn[:4, 1]).all() and not np.isnan(by_fn[4:, 1]).any()
    np.testing.assert_allclose(batch["rewards"], np.nansum(by_fn * [1.0, 0.5], axis=1))


def test_dpo_pairs_through_the_same_reader(tmp_path):
    write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Reverse ab"}], "chosen": "ba", "rejected": "ab"},
        {"prompt": "Reverse cd", "chosen": "dc", "rejected": "cd", "source": "mine"}])
    pairs = dpo.read_pairs(str(tmp_path / "pairs.jsonl"))
    assert pairs[0]["prompt"][0]["role"] == "system" and pairs[1]["source"] == "mine"
    encoded = dpo.encode_pairs(Tokenizer(FIXTURE), pairs, 48)
    assert encoded["chosen"].shape == (2, 48) and encoded["chosen_mask"].sum(1).min() > 0
    write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "x", "chosen": "y"}])
    with pytest.raises(jl.DataError, match=r"bad.jsonl:1: .* \['rejected'\] missing"):
        dpo.read_pairs(str(tmp_path / "bad.jsonl"))


ROWS = [{"prompt": "1+1?", "answer": "2", "id": 0},
        {"prompt": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "2+2?"}], "answer": "4", "id": 1}]
PAIRS = [{"prompt": "Reverse ab", "chosen": "ba", "rejected": "ab", "source": "mine"},
         {"prompt": [{"role": "user", "content": "Reverse cd"}], "chosen": "dc",
          "rejected": "cd", "source": "theirs"}]


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), path)


def _save_to_disk(path, rows, split=None):
    import datasets
    data = datasets.Dataset.from_list(rows)
    (datasets.DatasetDict({split: data}) if split else data).save_to_disk(str(path))


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "save_to_disk_train_split"])
def test_grpo_prompts_and_dpo_pairs_from_parquet_and_a_saved_dataset(tmp_path, kind):
    pytest.importorskip("pyarrow")
    if kind.startswith("save_to_disk"):
        pytest.importorskip("datasets")
    for name, rows in (("prompts", ROWS),
                       ("pairs", PAIRS)):
        # One storage type per column, as Arrow needs: the prompts of a file are all text or
        # all messages.
        for form, subset in (("text", rows[:1]), ("messages", rows[1:])):
            path = tmp_path / f"{name}-{form}-{kind}"
            if kind == "parquet":
                path = tmp_path / f"{name}-{form}.parquet"
                _write_parquet(path, subset)
            else:
                _save_to_disk(path, subset, "train" if kind.endswith("split") else None)
            got, places = read_rows(str(path), locate=True)
            assert got == subset and places == [f"{path} row 0"]
            if name == "prompts":
                messages, columns = prompt_rows(got)
                assert columns == {"answer": [subset[0]["answer"]], "id": [subset[0]["id"]]}
                assert messages[0][-1]["role"] == "user"
            else:  # DPO reads its pairs through the same reader
                pairs = dpo.read_pairs(str(path))
                assert pairs[0]["chosen"] == subset[0]["chosen"]
                assert pairs[0]["source"] == subset[0]["source"]


def test_unreadable_parquet_and_saved_dataset_directories_are_named(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(jl.DataError, match=r"bad.parquet: not a readable Parquet file"):
        read_rows(str(tmp_path / "bad.parquet"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(jl.DataError, match=r"plain is a directory but not one written by "
                                           r"datasets' save_to_disk"):
        read_rows(str(tmp_path / "plain"))
    _save_to_disk(tmp_path / "splits", ROWS[:1], "test")
    with pytest.raises(jl.DataError, match=r"holds splits \['test'\] and no 'train'"):
        read_rows(str(tmp_path / "splits"))


def test_without_pyarrow_or_datasets_the_message_names_the_extra(tmp_path, monkeypatch):
    import sys
    (tmp_path / "x.parquet").write_bytes(b"")
    (tmp_path / "saved").mkdir()
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(jl.ConfigurationError, match=r"x.parquet needs `pyarrow`: pip install "
                                                    r"'jaxlight\[posttrain\]'"):
        read_rows(str(tmp_path / "x.parquet"))
    with pytest.raises(jl.ConfigurationError, match=r"needs the `datasets` package: pip install "
                                                    r"'jaxlight\[posttrain\]'"):
        dpo.read_pairs(str(tmp_path / "saved"))
