"""jaxlight's GRPO advantages and loss, and its DPO loss, equal TRL 1.16's (versions in the
fixture) on the same completions, rewards and log-probabilities, ≤ 1e-5.

The fixture comes from `make trl-oracle` (`trl_side.py`, which runs TRL's own
`GRPOTrainer._generate_and_score_completions` for the advantages, `GRPOTrainer._compute_loss`
per loss type and `DPOTrainer._compute_loss`, in real trainers on a tiny Llama); this file
never imports torch or trl. The loss types map onto jaxlight's `loss_agg_mode` as
docs/posttrain.md's table says; TRL's KL term is always k3 (`kl_mode="low_var_kl"`) and its
advantages divide by `std + 1e-4` (jaxlight's default: 1e-6).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlight import posttrain
from jaxlight.posttrain._rollout import scorable_advantages

with open(os.path.join(os.path.dirname(__file__), "fixtures", "trl_oracle.json")) as _f:
    TRL = json.load(_f)
GRPO, SETUP = TRL["grpo"], TRL["setup"]
G = SETUP["G"]
TOL = 1e-5
# TRL's loss_type -> jaxlight's loss_agg_mode, and the constant TRL's loss is further divided
# by (dr_grpo: max_completion_length, a fixed learning-rate scale).
AGGREGATION = {"dapo": ("token-mean", 1), "bnpo": ("token-mean", 1),
               "grpo": ("sequence-mean-token-mean", 1),
               "dr_grpo": ("sequence-mean-token-sum-norm", SETUP["max_completion_length"])}


def test_fixture_is_trl_1_16():
    assert TRL["versions"]["trl"] == "1.16.0"
    lengths = np.asarray(GRPO["mask"]).sum(1)
    assert lengths.min() >= 1 and len(set(lengths)) > 2  # completions of several lengths


def given_reward(column):
    def reward(prompts, completions, completion_ids, **columns):
        return list(columns[column])
    reward.__name__ = {"r_answer": "answer", "r_format": "fmt"}[column]
    return reward


def scored():
    """TRL's given rewards through jaxlight's reward-function path (score, combine)."""
    n = len(SETUP["rewards"]["answer"])
    prompts = [SETUP["prompts"][i // G] for i in range(n)]
    columns = {"r_answer": SETUP["rewards"]["answer"], "r_format": SETUP["rewards"]["fmt"]}
    funcs = [given_reward("r_answer"), given_reward("r_format")]
    by_fn = posttrain.score(funcs, prompts, ["c"] * n, GRPO["completion_ids"], columns)
    with pytest.warns(UserWarning, match="1 completions got None from every reward function"):
        total = posttrain.combine(by_fn, SETUP["reward_weights"], prompts)
    return by_fn, total


def test_advantages_with_none_rewards_and_weights():
    by_fn, total = scored()
    unscorable = np.isnan(by_fn).all(axis=1)
    assert unscorable.sum() == 1  # the fixture has a completion no function applies to
    ours = scorable_advantages(total, unscorable, G, "grpo", eps=1e-4)
    want = np.asarray(GRPO["advantages"])
    np.testing.assert_allclose(ours, want, atol=TOL, rtol=0)
    assert np.all(want[8:] == 0) and np.all(want[:8][~unscorable[:8]] != 0)
    # jaxlight's default (std + 1e-6) is not TRL's: documented in docs/posttrain.md.
    assert np.abs(scorable_advantages(total, unscorable, G, "grpo") - want).max() > TOL


def test_reward_function_metrics():
    by_fn, _ = scored()
    ours = posttrain.reward_metrics(by_fn, ["answer", "fmt"])
    for name, value in ours.items():
        assert abs(value - GRPO["reward_metrics"][name]) <= TOL, (name, value)


@pytest.mark.parametrize("i", range(len(GRPO["cases"])))
def test_grpo_loss_gradient_and_metrics(i):
    case = GRPO["cases"][i]
    cfg = case["config"]
    weighted = cfg.get("use_bias_correction_kl", True)  # TRL 1.16's default
    mode, scale = AGGREGATION[cfg["loss_type"]]
    mask = jnp.asarray(GRPO["mask"], jnp.float32)
    old = jnp.asarray(GRPO["old_logps"], jnp.float32) if cfg["old"] else None
    ref = jnp.asarray(GRPO["ref_logps"], jnp.float32) if cfg["beta"] else None

    def loss(logps):
        value, metrics = posttrain.grpo_loss(
            logps, old, ref, jnp.asarray(GRPO["advantages"]), mask, epsilon=cfg["epsilon"],
            epsilon_high=cfg["epsilon_high"], beta=cfg["beta"], kl_mode="low_var_kl",
            loss_agg_mode=mode, kl_ratio_weighted=weighted)
        return value / scale, metrics

    logps = jnp.asarray(GRPO["logps"], jnp.float32)
    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(logps)
    assert abs(float(value) - case["loss"]) <= TOL, (float(value), case["loss"])
    np.testing.assert_allclose(np.asarray(grad) * np.asarray(mask), case["grad_logps"],
                               atol=TOL, rtol=0)
    assert np.abs(case["grad_logps"]).max() > 1e-3
    logged = case["metrics"]
    assert abs(float(metrics["pg_clipfrac"]) - logged["clip_ratio/region_mean"]) <= TOL
    if cfg["old"]:
        assert logged["clip_ratio/region_mean"] > 0  # the clip is active somewhere
    if cfg["beta"]:
        assert abs(float(metrics["kl"]) - logged["kl"]) <= TOL  # TRL logs the loss's KL term
        if not (weighted and cfg["old"]):  # k3 itself where no ratio weighs it
            assert abs(float(metrics["kl_k3"]) - logged["kl"]) <= TOL


def test_on_policy_the_ratio_weighted_kl_changes_the_gradient_only():
    """TRL's default KL weighting, on-policy (ratio 1): the same loss, another gradient."""
    (case,) = [c for c in GRPO["cases"] if not c["config"]["old"] and c["config"]["beta"]]
    mask = jnp.asarray(GRPO["mask"], jnp.float32)

    def loss(logps):
        return posttrain.grpo_loss(logps, None, jnp.asarray(GRPO["ref_logps"], jnp.float32),
                                   jnp.asarray(GRPO["advantages"]), mask, beta=0.04,
                                   kl_mode="low_var_kl", loss_agg_mode="token-mean")[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(GRPO["logps"], jnp.float32))
    assert abs(float(value) - case["loss"]) <= TOL
    assert np.abs(np.asarray(grad) * np.asarray(mask) - case["grad_logps"]).max() > 1e-4


def test_loss_types_differ_on_this_batch():
    """The fixture tells the aggregations apart (completions of several lengths)."""
    losses = {c["config"]["loss_type"]: c["loss"] for c in GRPO["cases"][1:]}
    assert len({round(v, 4) for v in losses.values()}) == len(losses)


@pytest.mark.parametrize("i", range(len(TRL["dpo"])))
def test_dpo_sigmoid_loss_gradient_and_metrics(i):
    case = TRL["dpo"][i]
    assert case["loss_type"] == ["sigmoid"]  # TRL's default
    token_logps = np.asarray(case["token_logps"], np.float32)
    mask = np.asarray(case["completion_mask"], np.float32)[:, 1:]  # position t predicts t + 1
    pairs = len(token_logps) // 2
    ref = np.asarray(case["ref_logps"], np.float32)

    def loss(chosen, rejected):
        return posttrain.dpo_loss(chosen, rejected, jnp.asarray(ref[:pairs]),
                                  jnp.asarray(ref[pairs:]), beta=case["beta"])

    sums = jnp.asarray((token_logps * mask).sum(1))
    (value, metrics), (d_chosen, d_rejected) = jax.value_and_grad(
        loss, argnums=(0, 1), has_aux=True)(sums[:pairs], sums[pairs:])
    assert abs(float(value) - case["loss"]) <= TOL, (float(value), case["loss"])
    per_token = np.concatenate([np.asarray(d_chosen), np.asarray(d_rejected)])[:, None] * mask
    np.testing.assert_allclose(per_token, case["grad_token_logps"], atol=TOL, rtol=0)
    names = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
             "rewards/margin": "rewards/margins", "rewards/accuracy": "rewards/accuracies",
             "log_probs/chosen": "logps/chosen", "log_probs/rejected": "logps/rejected"}
    for ours, theirs in names.items():  # log-probabilities: sums of ~4 tokens, float32
        want = case["metrics"][theirs]
        assert abs(float(metrics[ours]) - want) <= TOL * max(1.0, abs(want)), (ours, want)
    assert 0 < case["metrics"]["rewards/accuracies"] < 1
