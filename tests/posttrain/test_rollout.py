"""GRPO's generation batch on the tiny Qwen 3 fixture: shapes and masks, rewards from text,
zero-sum advantages per group, determinism per seed, and the sampler and the training step
agreeing on the sampled tokens' probabilities."""

import os

import numpy as np
import pytest

import jaxlight as jl
from jaxlight import posttrain
from jaxlight.nn.pretrained import Tokenizer, from_pretrained

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                       "pretrained", "fixtures", "qwen3")
G, NEW = 4, 6


@pytest.fixture(scope="module")
def setup():
    tokenizer = Tokenizer(FIXTURE)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Reverse {w}"}],
                                             add_generation_prompt=True) for w in ("abc", "hello")]
    return from_pretrained(FIXTURE, "single"), tokenizer, prompts


def _rollout(setup, **kw):
    model, tokenizer, prompts = setup
    kw = {"temperature": 1.0, "seed": 0, **kw}
    return posttrain.rollout(
        model, prompts, group_size=G, max_new_tokens=NEW, decode=tokenizer.decode,
        reward_funcs=[short, has_a], **kw)


def short(prompts, completions, completion_ids, **_):
    return [float(len(c) <= 3) for c in completions]


def has_a(prompts, completions, completion_ids, **_):
    return [float("a" in c) for c in completions]


@pytest.mark.slow
def test_batch_layout_rewards_and_advantages(setup):
    _, tokenizer, prompts = setup
    batch = _rollout(setup)
    p = max(len(x) for x in prompts)
    assert batch["tokens"].shape == (2 * G, p + NEW) and batch["mask"].shape == (2 * G, NEW)
    eos = tokenizer.eos_id
    for i in range(2 * G):
        prompt = prompts[i // G]
        np.testing.assert_array_equal(batch["tokens"][i, p - len(prompt):p], prompt)
        n = int(batch["mask"][i].sum())
        completion = batch["tokens"][i, p:p + n].tolist()
        assert n == NEW or completion[-1] == eos  # a completion ends at its stop token
        text = tokenizer.decode(completion)
        np.testing.assert_array_equal(batch["rewards_by_fn"][i],
                                      [float(len(text) <= 3), float("a" in text)])
        assert batch["attention_mask"][i].sum() == len(prompt) + n
    np.testing.assert_allclose(batch["rewards"], batch["rewards_by_fn"].sum(1))
    groups = batch["advantages"].reshape(2, G)
    np.testing.assert_allclose(groups.sum(1), 0, atol=1e-5)
    np.testing.assert_allclose(batch["advantages"],
                               posttrain.group_advantages(batch["rewards"], G), atol=0)
    assert np.all(batch["old_logps"][batch["mask"] == 0] == 0)
    assert np.all(batch["old_logps"][batch["mask"] == 1] < 0)


@pytest.mark.slow
def test_same_seed_same_batch_other_seed_other_samples(setup):
    a, b, c = _rollout(setup), _rollout(setup), _rollout(setup, seed=1)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["tokens"], c["tokens"])


@pytest.mark.slow
def test_sampler_and_training_step_agree(setup):
    # Nearly greedy sampling: every sampled token is the argmax of the training forward pass
    # (positions, padding and shift right), so its log-probability is ~0.
    batch = _rollout(setup, temperature=1e-3)
    kept = batch["old_logps"][batch["mask"] == 1]
    assert kept.size and np.all(kept > -1e-3), kept.min()
    with pytest.raises(jl.ConfigurationError, match="temperature=0"):
        _rollout(setup, temperature=0.0)
