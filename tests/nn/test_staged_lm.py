"""jaxlight.nn.StagedTransformerLM: the embedding and the head inside the pipeline."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, strategies
from jaxlight.strategies._pipelined import schedule_stats
from tests.nn.staged_lm import CONFIG, StagedLM, lm_data
from tests.pipeline_runs import kill_at, logged_fit

STEPS, BATCH, LENGTH = 10, 16, 8  # the same run as pipelined_run("staged_lm")


def _fit(strategy, cbs=(), ckpt_path=None):
    loader = jl.data.ArrayLoader(lm_data(10 * BATCH, LENGTH + 1), BATCH, seed=1)
    return logged_fit(strategy, StagedLM(), loader, STEPS, cbs, ckpt_path=ckpt_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("staged_lm_ckpt"))
    return {
        "single": _fit("single"),
        # data 2 × pipe 4: embedding, block, block, head on the four pipeline devices.
        "gpipe": _fit(strategies.GPipe(4, 4),
                      cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)]),
        "ckpt": ckpt,
    }


@pytest.mark.slow
def test_pipelined_lm_matches_single_device(runs):
    assert len(runs["single"]["losses"]) == STEPS
    np.testing.assert_allclose(runs["gpipe"]["losses"], runs["single"]["losses"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(runs["gpipe"]["params"]),
                    jax.tree.leaves(runs["single"]["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert runs["gpipe"]["fit"].compile_counts["train"] == 1


@pytest.mark.slow
def test_embedding_and_head_run_inside_the_schedule(runs):
    fit = runs["gpipe"]["fit"]
    p, m = 4, 4
    stats = schedule_stats(fit.compiled_train_step.as_text())
    assert stats["iterations"] == [m + p - 1] * 2
    # The widest boundary is the head's logits: length × vocab per example.
    b, width = BATCH // (m * 2), LENGTH * CONFIG["vocab_size"]
    assert stats["collective_permute_bytes"] == 2 * (m + p - 1) * b * width * 4
    # Every parameter, the embedding table and the head included, is split over pipe.
    for leaf in jax.tree.leaves(fit.state.params):
        assert leaf.sharding.spec[0] == "pipe"
    sizes = [s * 4 for s in runs["gpipe"]["module"].model.stage_sizes[0]]
    c = CONFIG
    assert sizes[0] == 4 * c["vocab_size"] * c["embed_dim"]  # the embedding stage
    assert sizes[-1] == 4 * (c["embed_dim"] + c["embed_dim"] * c["vocab_size"])  # norm + head


@pytest.mark.slow
def test_checkpoints_move_between_pipeline_and_other_layouts(runs):
    path = os.path.join(runs["ckpt"], str(STEPS))
    for strategy in ("single", strategies.FSDP(min_shard_size=1)):
        model = jl.load_checkpoint(path, StagedLM(), strategy=strategy)
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(runs["gpipe"]["params"]),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_exact(runs, tmp_path):
    # A child process trains the same run under GPipe(4, 4), saving every step, and is killed
    # by SIGKILL after step 6; resumed from its last checkpoint, the run ends on the
    # uninterrupted run's parameters bit for bit.
    ckpt = str(tmp_path / "ckpt")
    saved = kill_at("staged_lm", ckpt, STEPS, 6)
    assert saved and saved[-1] < STEPS, saved
    resumed = _fit(strategies.GPipe(4, 4),
                   cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)],
                   ckpt_path="last")
    assert resumed["fit"].global_step == STEPS
    assert len(resumed["losses"]) == STEPS - saved[-1]  # it did resume, not start over
    for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(runs["gpipe"]["params"]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_same_function_as_transformer_lm():
    # The stages hold TransformerLM's weights in its order: with the same weights copied in,
    # the logits agree.
    config = nn.TransformerConfig(**CONFIG)
    # Built, copied into and run in compiled programs (eagerly, each op of the initializers
    # and of the copy was an XLA compile of its own); the same arrays and steps.
    lm, staged = nnx.jit(lambda: (nn.TransformerLM(config, rngs=nnx.Rngs(0)),
                                  nn.StagedTransformerLM(config, rngs=nnx.Rngs(1))))()

    @nnx.jit
    def copy_in_and_run(staged, lm, tokens):
        stages = [staged.stage(i) for i in range(staged.num_stages)]
        stages[0].embed.embedding[...] = lm.embed.embedding[...]
        for i in range(config.num_layers):
            layer = jax.tree.map(lambda v, i=i: v[i], nnx.state(lm.blocks.layers, nnx.Param))
            nnx.update(stages[1 + i].blocks[0], layer)
        nnx.update(stages[-1].final_norm, nnx.state(lm.final_norm))
        nnx.update(stages[-1].head, nnx.state(lm.head))
        for i, stage in enumerate(stages):
            for d, row in zip(staged.dtypes, _rows(staged, stage), strict=True):
                packed = getattr(staged, f"packed_{d}")
                packed[...] = packed[...].at[i, :row.shape[0]].set(row)
        return staged(tokens), lm(tokens)

    tokens = jnp.asarray(lm_data(3, LENGTH)["tokens"])
    got, expected = copy_in_and_run(staged, lm, tokens)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _rows(staged, stage):
    leaves = jax.tree.leaves(nnx.state(stage, nnx.Param))
    return [jnp.concatenate([jnp.ravel(v) for v in leaves if v.dtype == jnp.dtype(d)])
            for d in staged.dtypes]


def test_refusals():
    with pytest.raises(jl.ConfigurationError, match="tie_embeddings=False"):
        nn.StagedTransformerLM(nn.TransformerConfig(vocab_size=8, embed_dim=8, num_heads=2),
                               rngs=nnx.Rngs(0))
    config = nn.TransformerConfig(**{**CONFIG, "num_layers": 3})
    with pytest.raises(jl.ConfigurationError, match=r"layers_per_stage=2 .* use one of \[1, 3\]"):
        nn.StagedTransformerLM(config, layers_per_stage=2, rngs=nnx.Rngs(0))
