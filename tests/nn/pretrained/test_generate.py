"""KV-cache sampling: sampling rules, per-row randomness, stop tokens, one compile per bucket."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlight._errors import ConfigurationError
from jaxlight.nn.pretrained import Sampling, choose, compiled_programs, from_pretrained, generate

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def draws(logits, sampling, n=2000):
    keys = jax.random.split(jax.random.key(0), n)
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, len(logits)))
    return np.asarray(jax.jit(lambda k, r: choose(r, k, sampling))(keys, rows))


def test_top_k_top_p_and_temperature_keep_the_right_tokens():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert set(draws(logits, Sampling(1.0, top_k=2))) == {0, 1}
    # top_p=0.7: 0.5 alone does not reach it, 0.5 + 0.3 does: tokens 0 and 1 stay.
    assert set(draws(logits, Sampling(1.0, top_p=0.7))) == {0, 1}
    counts = np.bincount(draws(logits, Sampling(1.0)), minlength=4) / 2000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.15, 0.05], atol=0.04)
    with pytest.raises(ConfigurationError, match="top_p"):
        Sampling(1.0, top_p=0.0)


@pytest.fixture(scope="module")
def llama():
    path = os.path.join(FIXTURES, "llama")
    ref = dict(np.load(os.path.join(path, "reference.npz")))
    prompts = [[int(t) for t, m in zip(row, mask, strict=True) if m]
               for row, mask in zip(ref["prompt_ids"], ref["prompt_mask"], strict=True)]
    return from_pretrained(path, "single", param_dtype=jnp.float32), prompts, ref["generated"]


def test_stop_tokens_end_rows_and_one_compile_per_bucket(llama):
    model, prompts, greedy = llama
    row0, row1 = greedy.tolist()
    k = next(i for i, t in enumerate(row1) if t not in row0 and t not in row1[:i])
    before = compiled_programs()
    out = generate(model, prompts, 32, stop_tokens=[row1[k]])
    assert out == [row0, row1[:k + 1]]
    # Other prompts of the same bucket (lengths up to 16, two rows) reuse the program.
    generate(model, [prompts[1][:3], prompts[0] + [5, 6]], 32, stop_tokens=[row1[k]])
    assert compiled_programs() - before <= 1


def test_each_row_draws_from_its_own_key(llama):
    model, prompts, _ = llama
    pair = generate(model, [prompts[0], prompts[1]], 12, temperature=1.0, top_k=50, seed=3,
                    stop_tokens=[])
    again = generate(model, [prompts[0], prompts[1]], 12, temperature=1.0, top_k=50, seed=3,
                     stop_tokens=[])
    other = generate(model, [prompts[0], prompts[1]], 12, temperature=1.0, top_k=50, seed=4,
                     stop_tokens=[])
    assert pair == again and pair != other
    # Row 0's draws do not depend on the row beside it.
    swapped = generate(model, [prompts[0], prompts[0]], 12, temperature=1.0, top_k=50, seed=3,
                       stop_tokens=[])
    assert swapped[0] == pair[0]


def test_generate_command_prints_the_greedy_continuations(llama, capsys):
    from jaxlight._cli._main import main
    from jaxlight.nn.pretrained import Tokenizer

    _, _, greedy = llama
    path = os.path.join(FIXTURES, "llama")
    prompts = ["The capital of France", "Rotary position embeddings rotate pairs of"]
    argv = ["generate", path, "--max-new-tokens", "32", "--dtype", "float32"]
    for p in prompts:
        argv += ["--prompt", p]
    assert main(argv) == 0
    tok = Tokenizer(path)
    expected = []
    for prompt, row in zip(prompts, greedy.tolist(), strict=True):
        row = row[:row.index(tok.eos_id) + 1] if tok.eos_id in row else row
        expected.append(prompt + tok.decode(row))
    assert capsys.readouterr().out.splitlines() == "\n".join(expected).splitlines()
