"""Gemma 3 1B's one key/value head under tensor parallelism: `from_pretrained` replicates the
key/value heads over tp when tp does not divide them (as MaxText and Tunix do), so a 1-KV-head
Gemma 3 runs under the Tunix guide's mesh `[[1, 4], ["fsdp", "tp"]]` with the logits of one
device (<= 1e-5) and the same greedy tokens, and `save_pretrained` writes the checkpoint's one
head back."""

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
def test_one_kv_head_under_tp4_equals_one_device(one_kv_head, tmp_path):
    single = from_pretrained(one_kv_head, "single")
    strategy = _tp4()
    model = from_pretrained(one_kv_head, strategy)
    assert (model.config.num_kv_heads, model.config.kv_repeat) == (4, 4)
    kernel = model.layers.layers.self_attn.k_proj.kernel[...]
    assert kernel.shape == (4, 64, 4, 16) and tuple(kernel.sharding.spec)[2] == "tp"
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 12)), jnp.int32)
    want = np.asarray(single(tokens))
    with strategy.trace_context():
        got = np.asarray(jax.jit(lambda m, t: m(t))(model, tokens))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    assert generate(model, prompts, 8, strategy=strategy) == generate(single, prompts, 8)
    # Written back with the checkpoint's one head: the same model.
    save_pretrained(model, str(tmp_path))
    back = from_pretrained(str(tmp_path), "single")
    assert back.config.num_kv_heads == 1
    np.testing.assert_array_equal(np.asarray(back(tokens)), want)


def test_a_tp_degree_that_cannot_split_the_heads_is_refused():
    # The fixture has 4 query heads and 2 key/value heads: tp 8 splits neither.
    strategy = strategies.Hybrid({"fsdp": 1, "tp": 8})
    with pytest.raises(jl.ConfigurationError, match=r"degree 8 .* 2 key/value heads .* 4 query"):
        from_pretrained(GEMMA, strategy)
