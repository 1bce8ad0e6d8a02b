"""Gemma 3 1B's one key/value head under tensor parallelism: when tp does not divide the
key/value heads, `from_pretrained` keeps their projections whole on every device and repeats
each head's keys and values over tp (as MaxText does), so a 1-KV-head Gemma 3 runs under the
Tunix guide's mesh `[[1, 4], ["fsdp", "tp"]]` with the logits of one device (<= 1e-5) and the
same greedy tokens, saves as the checkpoint it came from, and trains as one device does (the
recipes' policy and reference, built in configure_model)."""

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import strategies
from jaxlight.nn.pretrained import (
    DecoderLM,
    from_hf_config,
    from_pretrained,
    generate,
    read_config,
    save_pretrained,
)

GEMMA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                     "pretrained", "fixtures", "gemma3")


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    """The tiny Gemma 3 fixture's shape with one key/value head (4 query heads), random."""
    hf = read_config(GEMMA)
    hf["num_key_value_heads"] = 1
    path = str(tmp_path_factory.mktemp("gemma3_1kv"))
    save_pretrained(DecoderLM(from_hf_config(hf, param_dtype=jnp.float32), rngs=nnx.Rngs(3)),
                    path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(GEMMA, name), path)
    return path


def _tp4():
    strategy = strategies.Hybrid({"fsdp": 1, "tp": 4})
    strategy.setup(jax.devices()[:4])
    return strategy


@pytest.mark.slow
def test_one_kv_head_under_tp4_equals_transformers():
    """The committed 1-KV-head fixture (made by transformers: make_fixtures.py gemma3_1kv) under
    the Tunix guide's tp = 4: logits = transformers' to 1e-4 relative, the same greedy tokens."""
    from tests.nn.pretrained.test_parity import fixture, logits_of, relative_error

    path, ref = fixture("gemma3_1kv")
    assert read_config(path)["num_key_value_heads"] == 1
    strategy = _tp4()
    model = from_pretrained(path, strategy, param_dtype=jnp.float32)
    assert (model.config.num_kv_heads, model.config.kv_repeat) == (1, 4)
    tokens = np.tile(ref["tokens"].astype(np.int32), (2, 1))
    got = logits_of(model, strategy, tokens)
    assert relative_error(got, np.tile(ref["logits"], (2, 1, 1))) <= 1e-4
    prompts = [[int(t) for t, m in zip(row, mask, strict=True) if m]
               for row, mask in zip(ref["prompt_ids"], ref["prompt_mask"], strict=True)]
    out = generate(model, prompts, 32, strategy=strategy, stop_tokens=[])
    np.testing.assert_array_equal(np.asarray(out), ref["generated"])


@pytest.mark.slow
def test_one_kv_head_under_tp4_equals_one_device(one_kv_head, tmp_path):
    single = from_pretrained(one_kv_head, "single")
    strategy = _tp4()
    model = from_pretrained(one_kv_head, strategy)
    assert (model.config.num_kv_heads, model.config.kv_repeat) == (1, 4)
    kernel = model.layers.layers.self_attn.k_proj.kernel[...]
    assert kernel.shape == (4, 64, 1, 16) and kernel.sharding.is_fully_replicated
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 12)), jnp.int32)
    want = np.asarray(single(tokens))
    with strategy.trace_context():
        got = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    assert generate(model, prompts, 8, strategy=strategy) == generate(single, prompts, 8)
    # Written back as the checkpoint it came from.
    save_pretrained(model, str(tmp_path))
    back = from_pretrained(str(tmp_path), "single")
    assert back.config.num_kv_heads == 1
    np.testing.assert_array_equal(np.asarray(back(tokens)), want)


def test_a_tp_degree_that_cannot_split_the_heads_is_refused():
    # The fixture has 4 query heads and 2 key/value heads: tp 8 splits neither.
    strategy = strategies.Hybrid({"fsdp": 1, "tp": 8})
    with pytest.raises(jl.ConfigurationError, match=r"degree 8 .* 2 key/value heads .* 4 query"):
        from_pretrained(GEMMA, strategy)


@pytest.mark.slow
def test_grpo_and_dpo_recipes_run_one_kv_head_under_tp4(one_kv_head):
    """The recipes build their policy and reference in configure_model from weights read once:
    under fsdp 2 x tp 4 the key/value head is repeated over tp, its one copy of weights gets
    the whole gradient, and the loss of the second step (after one update: the first is log 2
    for DPO and ~0 for GRPO whatever the layout) equals the single device's (<= 1e-5)."""
    from jaxlight import posttrain
    from jaxlight.recipes import dpo, grpo

    config = grpo.Config()
    config.model.pretrained = one_kv_head
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens = 4
    module, data = grpo.build(config)
    batch = posttrain.rollout(
        from_pretrained(one_kv_head), data.train.prompt_rows(0)[0], group_size=4,
        max_new_tokens=4, decode=data.train.tokenizer.decode, seed=3,
        reward_funcs=[lambda prompts, completions, completion_ids, **_:
                      [sum(map(ord, c)) % 7 for c in completions]])
    batch = {k: batch[k] for k in grpo._BATCH_KEYS}
    dpo_config = dpo.Config()
    dpo_config.model.pretrained = one_kv_head
    dpo_config.data.pairs, dpo_config.data.batch_size = 40, 8
    dpo_module, dpo_data = dpo.build(dpo_config)
    losses = {}
    for name, make in {"single": lambda: "single",
                       "tp4": lambda: strategies.Hybrid({"fsdp": 2, "tp": 4})}.items():
        for key, (mod, train) in {"grpo": (module, [batch, batch]),
                                  "dpo": (dpo_module, dpo_data.train)}.items():
            fit = jl.Fit(make(), max_steps=2, log_every_n_steps=1, enable_progress_bar=False,
                         enable_model_summary=False, logger=False, enable_checkpointing=False)
            fit.fit(mod, train)
            losses[name, key] = fit.callback_metrics["loss"]
            if name == "tp4":
                kernel = fit.state.params["policy"]["layers"]["layers"]["self_attn"]["k_proj"]
                assert kernel["kernel"].shape[2] == 1  # the checkpoint's one head
    print(losses)
    for key in ("grpo", "dpo"):
        assert abs(losses["tp4", key] - losses["single", key]) <= 1e-5, losses
