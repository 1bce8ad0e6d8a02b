"""jaxlight's GRPO and DPO losses equal Tunix's (google-tunix 0.1.7, versions in the fixture's
JSON) on the same inputs: loss, metrics and the gradient with respect to the model, ≤ 1e-5.

The fixtures come from `make posttrain-oracle` (`make_tunix_fixtures.py`, which runs
`tunix.rl.algo_core.grpo_loss_fn`, its advantage estimators and
`tunix.sft.dpo.dpo_trainer.dpo_loss_fn` on a stand-in model returning `hidden @ kernel`); this
file never imports tunix. `test_strategies.py` repeats the comparison inside a compiled fit
step under single, fsdp and fsdp x tp.
"""

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight import posttrain
from tests.posttrain._oracle import (
    ARRAYS,
    RESULTS,
    TOL,
    completion_logits,
    dpo_batch,
    dpo_objective,
    grpo_batch,
    grpo_objective,
)


def test_fixture_is_tunix_0_1_7():
    assert RESULTS["versions"]["google-tunix"] == "0.1.7"


@pytest.mark.parametrize("estimator", posttrain.ADVANTAGES)
def test_group_advantages(estimator):
    ours = posttrain.group_advantages(ARRAYS["adv_rewards"], 4, estimator)
    np.testing.assert_allclose(ours, ARRAYS[f"adv_{estimator}"], atol=TOL, rtol=0)
    if estimator == "grpo":  # the all-equal group of rewards gets no advantage
        assert np.all(np.asarray(ours[4:8]) != 0) and np.all(np.asarray(ours[8:]) == 0)


@pytest.mark.parametrize("i", range(len(RESULTS["grpo"])))
def test_grpo_loss_metrics_and_gradient(i):
    cfg, expected = RESULTS["grpo"][i]["config"], RESULTS["grpo"][i]
    batch = grpo_batch(i)

    def loss(kernel):
        logits = completion_logits(batch["hidden"], kernel)
        return grpo_objective(kernel, logits, batch["ref_logps"], batch, cfg)

    (value, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(ARRAYS["kernel"])
    assert abs(float(value) - expected["loss"]) <= TOL, (float(value), expected["loss"])
    for name, want in expected["aux"].items():
        assert abs(float(metrics[name]) - want) <= TOL, (name, float(metrics[name]), want)
    np.testing.assert_allclose(grad, ARRAYS[f"grpo{i}_grad"], atol=TOL, rtol=0)
    assert np.abs(ARRAYS[f"grpo{i}_grad"]).max() > 1e-3  # the gradient compared is not ~0
    if cfg["old"]:  # the old policy differs enough that the clip is active somewhere
        assert 0 < expected["aux"]["pg_clipfrac"] < 1


@pytest.mark.parametrize("i", range(len(RESULTS["dpo"])))
def test_dpo_loss_metrics_and_gradient(i):
    cfg, expected = RESULTS["dpo"][i]["config"], RESULTS["dpo"][i]
    batch = dpo_batch()

    def loss(kernel):
        return dpo_objective(completion_logits(batch["chosen_hidden"], kernel),
                             completion_logits(batch["rejected_hidden"], kernel), batch, cfg)

    (value, metrics), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(ARRAYS["kernel"])
    assert abs(float(value) - expected["loss"]) <= TOL, (float(value), expected["loss"])
    for name, want in expected["aux"].items():
        assert abs(float(metrics[name]) - want) <= TOL, (name, float(metrics[name]), want)
    assert 0 < expected["aux"]["rewards/accuracy"] < 1
    np.testing.assert_allclose(grad, ARRAYS[f"dpo{i}_grad"], atol=TOL, rtol=0)


def test_ipo_loss_is_the_squared_margin_error():
    chosen, rejected = np.array([-2.0, -4.0]), np.array([-3.0, -1.0])
    ref = np.array([-2.5, -2.5])
    loss, _ = posttrain.dpo_loss(chosen, rejected, ref, ref, beta=0.25, loss_type="ipo")
    h = (chosen - ref) - (rejected - ref)
    np.testing.assert_allclose(float(loss), np.mean((h - 2.0) ** 2), rtol=1e-6)


def test_unknown_modes_are_refused_with_the_choices():
    lp = np.zeros((2, 3), np.float32)
    with pytest.raises(jl.ConfigurationError, match=r"kl_mode=.low_var.*Did you mean .low_var_kl."):
        posttrain.grpo_loss(lp, None, lp, np.ones(2), np.ones((2, 3)), kl_mode="low_var")
    with pytest.raises(jl.ConfigurationError, match=r"shape \(6,\) do not split into groups of 4"):
        posttrain.group_advantages(np.zeros(6), 4)
    with pytest.raises(jl.ConfigurationError, match=r"label_smoothing=0.1 has no meaning"):
        posttrain.dpo_loss(lp[0], lp[0], None, None, label_smoothing=0.1, loss_type="ipo")

