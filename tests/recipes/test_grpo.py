"""The grpo recipe on the tiny Qwen 3 fixture (tests/nn/pretrained/fixtures): generation batches
are sampled from the policy the previous step left (one sampler and one train compile), the
reference stays the loaded weights, and a run SIGKILLed mid-generation-batch resumes bitwise
equal to the uninterrupted one, sampling included."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import posttrain
from jaxlight.nn.pretrained._generate import compiled_programs
from jaxlight.posttrain._rollout import _old_log_probs
from jaxlight.recipes import grpo
from tests.models import saves_checkpoints

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                       "pretrained", "fixtures", "qwen3")
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_grpo_child.py")


@dataclasses.dataclass
class Run:
    module: grpo.PolicyOptimizer
    feed: grpo.GenerationFeed
    fit: jl.Fit
    programs: int  # sampler programs compiled during the fit
    logp_programs: int

    def policy(self) -> dict:
        params = nnx.to_pure_dict(nnx.state(self.module.policy(self.module.model), nnx.Param))
        flat = jax.tree_util.tree_leaves_with_path(jax.device_get(params))
        return {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}

    def save(self, path: str) -> None:
        rewards = np.array([r for _, r, _ in self.feed.history], np.float64)
        np.savez(path, rewards=rewards, last_tokens=self.feed.batch["tokens"],
                 generation=self.feed.generation, **self.policy())


def run_grpo(steps: int, strategy="single", callbacks=(), ckpt_path=None) -> Run:
    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.updates = 4, 2
    config.optim.lr = 1e-2  # the random fixture: big steps, so that every generation differs
    module, data = grpo.build(config)
    fit = jl.Fit(strategy, enable_progress_bar=False, enable_model_summary=False, logger=False,
                 callbacks=list(callbacks), enable_checkpointing=saves_checkpoints(callbacks),
                 **grpo.RECIPE.fit_defaults | {"max_steps": steps, "log_every_n_steps": 1})
    programs, logps = compiled_programs(), _old_log_probs._cache_size()
    fit.fit(module, data.train, ckpt_path=ckpt_path)
    return Run(module, data.train, fit, compiled_programs() - programs,
               _old_log_probs._cache_size() - logps)


@pytest.fixture(scope="module")
def straight():
    return run_grpo(6)


@pytest.mark.slow
def test_grpo_samples_from_the_policy_after_each_step(straight):
    run, feed = straight, straight.feed
    # 6 steps, 2 updates per generation batch: 3 generation batches, sampled by one program.
    assert feed.generation == 3 and [g for g, _, _ in feed.history] == [0, 1, 2]
    assert dict(run.fit.compile_counts) == {"init": 1, "train": 1}
    assert run.programs == 1 and run.logp_programs == 1
    # The last batch was sampled after step 4 and trained by steps 5 and 6: re-sampling it from
    # the policy after step 4 would need that policy; instead check the sampler read the live
    # state: the policy moved (lr 1e-2), and the stored old log-probabilities are those of a
    # policy that is neither the pretrained one nor the final one.
    batch = {k: jax.numpy.asarray(v) for k, v in feed.batch.items()}

    def logps(model):
        return np.asarray(_old_log_probs(*nnx.split(model), batch, temperature=1.0))

    final = logps(run.module.policy(run.module.model)) * feed.batch["mask"]
    start = logps(run.module.model.reference) * feed.batch["mask"]
    old = feed.batch["old_logps"]
    assert np.abs(old - start).max() > 1e-3 and np.abs(old - final).max() > 1e-3
    # The reference is still the loaded checkpoint, bit for bit; only the policy trained.
    loaded = jax.tree.map(np.asarray, run.module.base_params)
    reference = jax.device_get(nnx.to_pure_dict(nnx.state(run.module.model.reference,
                                                          nnx.Param)))
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(a, b)
    assert set(run.fit.state.params) == {"policy"}


@pytest.mark.slow
def test_on_policy_when_each_batch_feeds_one_step():
    """updates=1: generation 1 is sampled from the policy after step 1 and trained by step 2:
    re-sampled from a copy of that policy with its prompts and seed it is the batch step 2
    trained on, bit for bit, although the Fit asks for prefetching (the feed's
    `reads_live_model` turns read-ahead off)."""
    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.updates = 4, 1
    config.optim.lr = 1e-2
    module, data = grpo.build(config)
    copies = {}

    class Keep(jl.callbacks.Callback):
        def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
            graphdef, state = nnx.split(module.policy(module.model))
            copies[fit.global_step] = nnx.merge(graphdef, jax.tree.map(jax.numpy.copy, state))

    fit = jl.Fit("single", max_steps=2, prefetch_batches=2, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, callbacks=[Keep()],
                 enable_checkpointing=False)
    fit.fit(module, data.train)
    feed = data.train
    assert feed.generation == 2
    prompts, seed = feed.prompt_rows(1)
    again = posttrain.rollout(copies[1], prompts, group_size=4, max_new_tokens=4,
                              reward_funcs=feed.reward_funcs, decode=feed.tokenizer.decode,
                              seed=seed, prompt_len=feed.prompt_len, strategy=fit.strategy,
                              columns={"word": [feed.columns["word"][i]
                                                for i in feed.picked(1)[0]]})
    for key in ("tokens", "old_logps", "rewards"):
        np.testing.assert_array_equal(feed.batch[key], again[key])


@pytest.mark.slow
def test_sigkill_mid_generation_resumes_bitwise(straight, tmp_path):
    env = dict(os.environ)
    cfg = {"dir": str(tmp_path), "steps": 6}
    # Paused after step 3's checkpoint: generation 1 has fed one of its two updates.
    first = subprocess.Popen([sys.executable, CHILD, json.dumps({**cfg, "pause_at": 3})],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = first.stdout.readline()
        assert line.strip() == "paused", line
        first.kill()  # SIGKILL
    finally:
        first.wait(60)
    assert first.returncode == -9
    done = subprocess.run([sys.executable, CHILD, json.dumps({**cfg, "resume": True})],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]
    resumed = np.load(tmp_path / "resumed.npz")
    policy = straight.policy()
    assert sorted(policy) == sorted(k for k in resumed.files if k.startswith("["))
    for key, value in policy.items():
        np.testing.assert_array_equal(resumed[key], value, err_msg=key)
    np.testing.assert_array_equal(resumed["last_tokens"], straight.feed.batch["tokens"])
    # The resumed process sampled only generation 2 (1 came from the checkpoint).
    assert resumed["rewards"].tolist() == [r for _, r, _ in straight.feed.history[2:]]
    assert int(resumed["generation"]) == 3


def test_rewards_and_feed_state():
    prompts, word = ["Reverse abcd"] * 4, ["abcd"] * 4
    completions = ["dcba", "dcbb", "dcb", "dc b!"]
    assert grpo.reversal_reward(prompts, completions, None, word=word) == [1.0, 0.0, 0.0, 0.0]
    assert grpo.format_reward(prompts, completions, None, word=word) == [0.5, 0.5, 0.0, 0.0]
    batch = {"tokens": np.arange(6, dtype=np.int32).reshape(2, 3),
             "old_logps": np.array([[-0.5, -1.25]], np.float32)}
    back = grpo._decode_batch(json.loads(json.dumps(grpo._encode_batch(batch))))
    for k, v in batch.items():
        np.testing.assert_array_equal(back[k], v)
        assert back[k].dtype == v.dtype


@pytest.mark.slow
def test_recipe_step_loss_is_the_same_under_fsdp_and_fsdp_tp():
    """One generation batch through the recipe's compiled step under FSDP() (a step per
    replica, one row each: advantages and normalizers come from the host) and fsdp x tp: the
    loss, KL and clip fraction equal `posttrain.grpo_loss` (Tunix's, by tests/posttrain) on one
    device, to 1e-5."""
    from jaxlight import strategies

    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.beta = 4, 0.5
    module, data = grpo.build(config)
    model = module.configure_model(nnx.Rngs(0))
    # The old log-probabilities of a slightly different policy: ratios off 1, clipping active.
    # The random fixture earns no task reward: a reward that varies with the text instead.
    batch = posttrain.rollout(module.policy(model), data.train.prompt_rows(0)[0], group_size=4,
                              max_new_tokens=4,
                              reward_funcs=[lambda prompts, completions, completion_ids, **_:
                                            [sum(map(ord, c)) % 7 for c in completions]],
                              decode=data.train.tokenizer.decode, temperature=1.0, seed=3)
    batch = {k: batch[k] for k in grpo._BATCH_KEYS}
    batch["old_logps"] = batch["old_logps"] + 0.3 * batch["mask"] * np.cos(
        np.arange(batch["mask"].size).reshape(batch["mask"].shape)).astype(np.float32)
    assert batch["advantages"].std() > 0
    # The reference figure: the loss on the host's device, without any strategy (at the start
    # the policy is the reference, one forward pass gives both).
    logps = np.asarray(_old_log_probs(*nnx.split(module.policy(model)),
                                      {k: jax.numpy.asarray(v) for k, v in batch.items()},
                                      temperature=1.0))
    weights = {k: batch[k] for k in ("token_weight", "row_weight")}
    loss, m = posttrain.grpo_loss(logps, batch["old_logps"], logps, batch["advantages"],
                                  batch["mask"], beta=0.5, weights=weights)
    want = {"loss": float(loss), "kl": float(m["kl"]), "pg_clipfrac": float(m["pg_clipfrac"])}
    assert want["pg_clipfrac"] > 0
    for name, make in {"fsdp": lambda: strategies.FSDP(min_shard_size=1),
                       "fsdp_tp": lambda: strategies.Hybrid({"fsdp": 4, "tp": 2},
                                                            min_shard_size=1)}.items():
        fit = jl.Fit(make(), max_steps=1, log_every_n_steps=1, enable_progress_bar=False,
                     enable_model_summary=False, logger=False, enable_checkpointing=False)
        fit.fit(module, [batch])
        for key, value in want.items():
            assert abs(fit.callback_metrics[key] - value) <= 1e-5, (name, key, value,
                                                                    fit.callback_metrics)


@pytest.mark.slow
def test_lora_policy_samples_and_trains_only_its_adapters():
    """--lora.rank: the policy is the pretrained model with adapters, the reference the same
    model with them off (no second copy); only the adapters train and the base stays loaded."""
    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.lora.rank = 2
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.updates = 4, 1
    config.optim.lr = 1e-2
    module, data = grpo.build(config)
    fit = jl.Fit("single", max_steps=2, enable_progress_bar=False, enable_model_summary=False,
                 logger=False, enable_checkpointing=False)
    fit.fit(module, data.train)
    assert data.train.generation == 2
    leaves = jax.tree_util.tree_leaves_with_path(fit.state.params)
    assert leaves and all("lora_" in jax.tree_util.keystr(k) for k, _ in leaves)
    assert any(np.abs(np.asarray(v)).max() > 0 for k, v in leaves if "lora_b" in str(k))
    base = nnx.to_pure_dict(nnx.state(module.model, nnx.Param))
    np.testing.assert_array_equal(np.asarray(base["lm_head"]["kernel"]),
                                  module.base_params["lm_head"]["kernel"])
