"""The interleaved (circular) pipeline schedule: GPipe and Hybrid with repeats=v."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from jaxlight.nn._circular import relayout_plan
from jaxlight.nn._pipeline import bubble_fraction, schedule_iterations
from jaxlight.state._state import model_spec
from jaxlight.step._step import build_optimizer
from jaxlight.strategies._auto_candidates import enumerate_candidates
from jaxlight.strategies._pipelined import schedule_stats
from tests.nn.stages_mlp import StageMLP, stage_data
from tests.pipeline_runs import kill_at, pipelined_run
from tests.strategies.interleaved_net import BATCH, WIDTH, Regression, regression_data

STEPS = 5


def _fit(strategy, val=None):
    losses = []
    log = callbacks.LambdaCallback(on_log=lambda fit, m, metrics, step: losses.append(
        metrics["loss"]) if "loss" in metrics else None)
    fit = jl.Fit(strategy=strategy, max_steps=STEPS, log_every_n_steps=1, callbacks=[log],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    module = Regression()
    fit.fit(module, regression_data(STEPS), val)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return {"fit": fit, "losses": np.asarray(losses), "params": params}


@pytest.fixture(scope="module")
def runs():
    val = regression_data(1, seed=1)
    return {
        "single": _fit("single", val),
        # 8 layers as 4 stages × 2 chunks: stage s runs layers {s, s + 4}.
        "gpipe": _fit(strategies.GPipe(4, 4, repeats=2, devices=jax.devices()[:4]), val),
        # data 2 × pipe 2, 4 chunks per stage.
        "hybrid": _fit(strategies.Hybrid({"data": 2, "pipe": 2}, microbatches=2, repeats=4,
                                         devices=jax.devices()[:4])),
    }


@pytest.mark.slow
def test_interleaved_matches_single_device(runs):
    ref = runs["single"]
    assert len(ref["losses"]) == STEPS
    for name in ("gpipe", "hybrid"):
        run = runs[name]
        np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(run["params"]), jax.tree.leaves(ref["params"]),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert run["fit"].compile_counts["train"] == 1
    # Evaluation runs single examples: one microbatch, padded to p slots of the ring.
    assert runs["gpipe"]["fit"].callback_metrics["val_loss"] == pytest.approx(
        runs["single"]["fit"].callback_metrics["val_loss"], rel=1e-5)


@pytest.mark.slow
def test_more_microbatches_than_stages_delays_results_in_the_ring(runs):
    """m > p: stage 0 keeps each result of the last stage m − p iterations (the ring) before
    its next repeat; m = p (the fixture's runs) never stores one. 2 stages × 2 chunks, 4 and 8
    microbatches (delays 2 and 6), against SingleDevice (the fixture's run: its validation
    after the last step changes neither the logged losses nor the parameters)."""
    ref = runs["single"]
    for m in (4, 8):
        run = _fit(strategies.GPipe(2, m, repeats=2, devices=jax.devices()[:2]))
        np.testing.assert_allclose(run["losses"], ref["losses"], rtol=1e-5)
        for a, b in zip(jax.tree.leaves(run["params"]), jax.tree.leaves(ref["params"]),
                        strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_schedule_iterations_bubble_and_permute_bytes(runs):
    p, m, v = 4, 4, 2
    info = runs["gpipe"]["fit"].strategy.describe()["pipeline"]
    assert info["schedule"] == "interleaved" and info["repeats"] == v
    assert info["iterations"] == v * m + p - 1 == 11
    assert info["bubble_fraction"] == pytest.approx(3 / 11)
    stats = schedule_stats(runs["gpipe"]["fit"].compiled_train_step.as_text())
    # The forward and backward schedule loops each run v·m + p − 1 permutes of one (b, h)
    # activation; the other permutes run once (the stack's relayout into chunks).
    assert sorted(stats["iterations"])[-2:] == [v * m + p - 1] * 2
    assert [n for n in stats["iterations"] if n > 1] == [v * m + p - 1] * 2
    b = BATCH // m
    assert stats["schedule_permute_bytes"] == 2 * (v * m + p - 1) * b * WIDTH * 4


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [1, 2, 3, 4, 8])
def test_relayout_plan_moves_each_chunk_once_in_as_few_permutes_as_any_stage_needs(p, v):
    """Stage d stores chunks [d·v, d·v + v) and runs chunks s + r·p; each round is a partial
    permutation, every stage ends with the chunks it runs, and the rounds are as many as the
    most chunks any one stage must send or receive (none for v = 1)."""
    plan = relayout_plan(p, v)
    runs_chunk = {}
    for s in range(p):
        for r in range(v):
            if plan.own[r][s] >= 0:
                runs_chunk[s, r] = s * v + plan.own[r][s]
    for pairs, sent, slot in plan.rounds:
        assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs) > 0
        for a, b in pairs:
            assert a != b and (b, slot[b]) not in runs_chunk
            runs_chunk[b, slot[b]] = a * v + sent[a]
    assert runs_chunk == {(s, r): r * p + s for s in range(p) for r in range(v)}
    moving = [c for c in range(p * v) if c // v != c % p]
    most = max([sum(c // v == d for c in moving) for d in range(p)]
               + [sum(c % p == d for c in moving) for d in range(p)], default=0)
    assert len(plan.rounds) == most


@pytest.mark.slow
@pytest.mark.parametrize("name, p, v", [("gpipe", 4, 2), ("hybrid", 2, 4)])
def test_the_stack_relayout_sends_each_stage_its_chunks_and_nothing_more(runs, name, p, v):
    """One ppermute per round of `relayout_plan` and leaf (kernel, bias), forward and backward,
    of one chunk (one layer here) each; no all-to-all (XLA's own relayout of the reshaped stack
    took collective-permutes and all-to-alls of twice this at p = 4, v = 2)."""
    stats = schedule_stats(runs[name]["fit"].compiled_train_step.as_text())
    chunk_bytes = (WIDTH * WIDTH + WIDTH) * 4
    rounds = len(relayout_plan(p, v).rounds)
    assert stats["collective_permute_bytes"] - stats["schedule_permute_bytes"] == (
        2 * rounds * chunk_bytes)
    assert "all-to-all" not in stats["other_collectives"]


@pytest.mark.slow
def test_backward_pass_stores_no_copy_of_the_chunks_parameters(runs):
    """Each iteration slices its chunk from the stage's v chunks; the backward pass slices it
    again instead of storing the slice per iteration (v·m + p − 1 of them: (v·m + p − 1)/v of
    a stage's parameters, 5.5× here)."""
    p, m, v, chunk = 4, 4, 2, 1
    steps = v * m + p - 1
    hlo = runs["gpipe"]["fit"].compiled_train_step.as_text()
    assert f"f32[{chunk * v},{WIDTH},{WIDTH}]" in hlo  # the stage's chunks: stored once
    assert f"f32[{steps},{chunk},{WIDTH},{WIDTH}]" not in hlo
    assert f"f32[{steps},{chunk},{WIDTH}]" not in hlo  # the biases


def test_bubble_formula():
    assert [bubble_fraction(4, 8, v) for v in (1, 2, 4)] == pytest.approx(
        [3 / 11, 3 / 19, 3 / 35])
    assert [schedule_iterations(4, 8, v) for v in (1, 2, 4)] == [11, 19, 35]
    # Fewer microbatches than stages: the ring still runs p slots.
    assert schedule_iterations(4, 2, 2) == 11
    assert bubble_fraction(4, 2, 2) == pytest.approx(1 - 4 / 11)


def test_layers_not_divisible_by_stages_times_repeats():
    strategy = strategies.GPipe(4, 4, repeats=4, devices=jax.devices()[:4])
    fit = jl.Fit(strategy=strategy, max_steps=1, enable_progress_bar=False, logger=False)
    with pytest.raises(jl.ConfigurationError, match=r"8 layers .* do not split into 4 stages "
                                                    r"× 4 repeats = 16 chunks.*\[1, 2, 4, 8\]"):
        fit.fit(Regression(), regression_data(1))


def test_bad_repeats_and_stages_with_repeats():
    with pytest.raises(jl.ConfigurationError, match=r"repeats .* must be a positive int, got 0"):
        strategies.GPipe(4, 4, repeats=0)
    with pytest.raises(jl.ConfigurationError, match=r"repeats .* must be a positive int"):
        strategies.Hybrid({"pipe": 4}, repeats=1.5)
    fit = jl.Fit(strategies.GPipe(2, 2, repeats=2, devices=jax.devices()[:2]), max_steps=1,
                 enable_progress_bar=False, logger=False)
    with pytest.raises(jl.ConfigurationError, match=r"Stages runs the GPipe schedule only "
                                                    r"\(repeats=1\), got repeats=2"):
        fit.fit(StageMLP(stages=4), jl.data.ArrayLoader(stage_data(8), 8))


def _resumable(max_steps, ckpt, ckpt_path=None):
    strategy, module, data = pipelined_run("interleaved", jax.devices())
    fit = jl.Fit(strategy, max_steps=max_steps,
                 callbacks=[callbacks.ModelCheckpoint(ckpt, every_n_steps=max_steps)],
                 enable_progress_bar=False, enable_model_summary=False, logger=False)
    fit.fit(module, data, ckpt_path=ckpt_path)
    return fit, jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))


@pytest.mark.slow
def test_interleaved_resumes_bitwise_after_sigkill_and_checkpoints_move(tmp_path):
    full, expected = _resumable(8, str(tmp_path / "full"))
    killed = str(tmp_path / "killed")
    saved = kill_at("interleaved", killed, 8, 5)
    assert saved and saved[-1] < 8, saved
    resumed, params = _resumable(8, killed, ckpt_path="last")
    assert resumed.global_step == 8
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    # The stored stack keeps the canonical layout: it restores under SingleDevice and FSDP.
    for strategy in ("single", strategies.FSDP(min_shard_size=1)):
        model = jl.load_checkpoint(str(tmp_path / "full" / "8"), Regression(), strategy=strategy)
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


def test_plan_and_auto_show_the_interleaved_layout():
    fit = jl.Fit(strategies.GPipe(4, 4, repeats=2, devices=jax.devices()[:4]), max_steps=1,
                 enable_progress_bar=False, logger=False)
    plan = fit.plan(Regression(), regression_data(1)[0], verbose=False)
    assert ("pipeline: interleaved schedule, 4 stages × 2 chunks, 4 microbatches, "
            "11 iterations, bubble 27.3%") in plan.table()
    # Auto's candidates: each pipe mesh whose stages × 2 divide the 8 layers also runs
    # interleaved (pipe 2 and 4; pipe 8 would need 16 layers).
    module = Regression()
    spec = model_spec(module, build_optimizer(module, [])[0], 0)
    layouts = [c.layout for c in enumerate_candidates((), None, spec.abstract_state,
                                                      spec.logical_axes, 8)]
    assert "pipe=4,fsdp=2 repeats=2" in layouts and "data=4,pipe=2 repeats=2" in layouts
    assert not any(lay.startswith("pipe=8") and "repeats" in lay for lay in layouts)
    assert all(lay.replace(" repeats=2", "") in layouts for lay in layouts)
