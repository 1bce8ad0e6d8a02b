"""Bad post-training inputs are refused before the first step, with the numbers and the fix:
negative β / ε, mismatched DPO pairs, prompts past the model's positions, reward functions that
return the wrong length, NaN, or raise; and the inputs that must work: a strategy name in
`generate`, `from_pretrained` inside `configure_model`, a non-negative logged KL."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import posttrain
from jaxlight.nn.pretrained import DecoderLM, from_hf_config, from_pretrained, generate
from jaxlight.recipes import dpo, grpo

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                       "pretrained", "fixtures", "qwen3")


def tiny(positions=16):
    cfg = from_hf_config({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
                          "intermediate_size": 32, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "max_position_embeddings": positions})
    return DecoderLM(cfg, rngs=nnx.Rngs(0))


# -- the losses ----------------------------------------------------------------------------------


def test_dpo_loss_refuses_negative_beta_and_mismatched_pairs():
    lp = jnp.array([-3.0, -4.0])
    with pytest.raises(jl.ConfigurationError, match=r"beta=-0.1 must be > 0.*rejected"):
        posttrain.dpo_loss(lp, lp, lp, lp, beta=-0.1)
    with pytest.raises(jl.ConfigurationError, match=r"beta=0 must be > 0"):
        posttrain.dpo_loss(lp, lp, lp, lp, beta=0)
    with pytest.raises(jl.ConfigurationError, match=r"\[\(2,\), \(1,\), \(2,\), \(1,\)\]"):
        posttrain.dpo_loss(lp, lp[:1], lp, lp[:1])


def test_grpo_loss_refuses_negative_beta_and_epsilon():
    lp, mask = jnp.zeros((2, 3)), jnp.ones((2, 3))
    adv = jnp.array([1.0, -1.0])
    with pytest.raises(jl.ConfigurationError, match=r"beta=-0.04 must be >= 0"):
        posttrain.grpo_loss(lp, None, lp, adv, mask, beta=-0.04)
    with pytest.raises(jl.ConfigurationError, match=r"epsilon=-0.2 must be >= 0.*every token"):
        posttrain.grpo_loss(lp, None, lp, adv, mask, epsilon=-0.2)
    with pytest.raises(jl.ConfigurationError, match=r"epsilon_high=-0.1"):
        posttrain.grpo_loss(lp, None, lp, adv, mask, epsilon_high=-0.1)


def test_logged_kl_is_never_negative_with_the_default_kl_mode():
    # The policy more likely than the reference on the sampled tokens: Tunix's "kl" estimate
    # (logp - ref) is then negative where logp < ref, k3 never is.
    rng = np.random.default_rng(0)
    logps = jnp.asarray(-rng.uniform(0.1, 2.0, (4, 5)), jnp.float32)
    ref = logps + jnp.asarray(rng.uniform(0.0, 0.5, (4, 5)), jnp.float32)
    _, m = posttrain.grpo_loss(logps, None, ref, jnp.zeros(4), jnp.ones((4, 5)))
    assert float(m["kl"]) < 0 <= float(m["kl_k3"])
    d = ref - logps
    np.testing.assert_allclose(float(m["kl_k3"]), float((jnp.exp(d) - d - 1).mean()), rtol=1e-6)


# -- reward functions ----------------------------------------------------------------------------


def count_a(prompts, completions, completion_ids, **_):
    return [float(c.count("a")) for c in completions]


def test_reward_function_errors_name_the_function_row_and_fix():
    prompts, comps, ids = ["p0", "p1", "p2"], ["aa", "b", "ca"], [[1], [2], [3]]

    def one_short(prompts, completions, completion_ids, **_):
        return [1.0] * (len(completions) - 1)

    with pytest.raises(jl.DataError, match=r"one_short returned 2 rewards for 3 completions.*"
                                           r"exactly 3"):
        posttrain.score([count_a, one_short], prompts, comps, ids)

    def not_a_list(prompts, completions, completion_ids, **_):
        return 1.0

    with pytest.raises(jl.DataError, match=r"not_a_list returned float for a batch of 3"):
        posttrain.score([not_a_list], prompts, comps, ids)

    def nan_on_b(prompts, completions, completion_ids, **_):
        return [math.nan if c == "b" else 1.0 for c in completions]

    with pytest.raises(jl.DataError, match=r"nan_on_b returned nan for row 1 \(prompt 'p1', "
                                           r"completion 'b'\).*None"):
        posttrain.score([nan_on_b], prompts, comps, ids)

    def divides(prompts, completions, completion_ids, *, denominator, **_):
        return [1 / d for d in denominator]

    with pytest.raises(jl.DataError, match=r"divides raised ZeroDivisionError: division by zero "
                                           r"on row 2: prompt 'p2', completion 'ca'"):
        posttrain.score([divides], prompts, comps, ids, {"denominator": [1, 2, 0]})


def test_none_means_not_applicable_and_weights_sum_the_rest():
    def only_short(prompts, completions, completion_ids, **_):
        return [1.0 if len(c) < 2 else None for c in completions]

    by_fn = posttrain.score([count_a, only_short], ["p"] * 3, ["aa", "b", "ca"], [[1]] * 3)
    np.testing.assert_array_equal(by_fn, [[2, np.nan], [0, 1], [1, np.nan]])
    np.testing.assert_allclose(posttrain.combine(by_fn, [1.0, 0.5]), [2.0, 0.5, 1.0])
    with pytest.warns(UserWarning, match=r"1 completions got None from every reward function "
                                         r"\(first: row 0, prompt 'p'\)"):
        np.testing.assert_array_equal(posttrain.combine(np.array([[np.nan], [1.0]]),
                                                        prompts=["p", "q"]), [0.0, 1.0])
    with pytest.raises(jl.ConfigurationError, match=r"reward_weights has 1 values for 2 reward"):
        posttrain.combine(by_fn, [1.0])
    metrics = posttrain.reward_metrics(by_fn, ["count_a", "only_short"])
    assert metrics["rewards/count_a/mean"] == 1.0 and metrics["rewards/only_short/mean"] == 1.0
    assert metrics["rewards/count_a/std"] == 1.0


# -- positions -----------------------------------------------------------------------------------


def test_prompts_past_the_models_positions_are_refused():
    model = tiny(positions=16)
    with pytest.raises(jl.DataError, match=r"forward pass got 20 tokens but the model has 16 "
                                           r"positions"):
        model(jnp.zeros((1, 20), jnp.int32))
    with pytest.raises(jl.DataError, match=r"longest prompt \(14 tokens\) plus max_new_tokens "
                                           r"\(4\) make 18 tokens but the model has 16"):
        generate(model, [[1] * 14], 4)
    with pytest.raises(jl.DataError, match=r"rollout: prompts padded to 12 tokens plus "
                                           r"max_new_tokens \(6\) make 18 tokens.*16 positions"):
        posttrain.rollout(model, [[1] * 12], group_size=2, max_new_tokens=6,
                          reward_funcs=[count_a], decode=str)


@pytest.mark.slow  # a generation compiled under fsdp
def test_generate_takes_a_strategy_name():
    model = tiny()
    assert generate(model, [[1, 2, 3], [4]], 3, strategy="fsdp") == generate(
        model, [[1, 2, 3], [4]], 3)


# -- the recipes' options ------------------------------------------------------------------------


@pytest.mark.parametrize("option,value,match", [
    ("beta", -0.1, r"--grpo.beta=-0.1 must be >= 0"),
    ("epsilon", -0.2, r"--grpo.epsilon=-0.2 must be >= 0"),
])
def test_grpo_recipe_refuses_negative_options(option, value, match):
    config = grpo.Config()
    config.model.pretrained = FIXTURE
    setattr(config.grpo, option, value)
    with pytest.raises(jl.ConfigurationError, match=match):
        grpo.build(config)


def test_dpo_recipe_refuses_negative_beta():
    config = dpo.Config()
    config.model.pretrained = FIXTURE
    config.dpo.beta = -0.1
    with pytest.raises(jl.ConfigurationError, match=r"--dpo.beta=-0.1 must be > 0"):
        dpo.build(config)


# -- from_pretrained inside configure_model ------------------------------------------------------


class Loaded(jl.TrainModule):
    def configure_model(self, rngs):
        return from_pretrained(FIXTURE, param_dtype=jnp.float32)

    def configure_optimizers(self):
        return optax.sgd(0.0)

    def training_step(self, model, batch):
        return model(batch["tokens"]).mean() * 0.0, {}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_from_pretrained_inside_configure_model(strategy):
    fit = jl.Fit(strategy, max_steps=1, enable_progress_bar=False, enable_model_summary=False,
                 logger=False, enable_checkpointing=False)
    tokens = np.arange(32, dtype=np.int32).reshape(8, 4)
    fit.fit(Loaded(), jl.data.ArrayLoader({"tokens": tokens}, batch_size=8))
    want = nnx.to_pure_dict(nnx.state(from_pretrained(FIXTURE, param_dtype=jnp.float32),
                                      nnx.Param))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(fit.state.params),
                            jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


@pytest.mark.parametrize("estimator", posttrain.ADVANTAGES)
def test_completions_no_function_applies_to_leave_the_baseline(estimator):
    from jaxlight.posttrain._rollout import scorable_advantages

    # Group 0: rows 1 and 3 unscored; group 1: all scored (the plain estimator's figures).
    rewards = np.array([1.0, 0.0, 0.5, 0.0, 2.0, 0.0, 1.0, 3.0], np.float32)
    unscorable = np.array([0, 1, 0, 1, 0, 0, 0, 0], bool)
    got = scorable_advantages(rewards, unscorable, 4, estimator)
    assert got[1] == got[3] == 0
    kept = np.asarray(posttrain.group_advantages(jnp.asarray(rewards[[0, 2]]), 2, estimator))
    np.testing.assert_allclose(got[[0, 2]], kept, rtol=1e-6)
    whole = np.asarray(posttrain.group_advantages(jnp.asarray(rewards[4:]), 4, estimator))
    np.testing.assert_allclose(got[4:], whole, rtol=1e-6)
