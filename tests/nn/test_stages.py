"""jaxlight.nn.Stages: pipeline stages of any shape under GPipe, Hybrid and every other layout."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, strategies
from jaxlight.state._state import model_spec
from jaxlight.step._step import build_optimizer
from jaxlight.strategies._auto_candidates import enumerate_candidates
from jaxlight.strategies._pipelined import schedule_stats
from tests.nn.stages_mlp import DIMS, StageMLP, stage_data
from tests.pipeline_runs import assert_runs_close, kill_at, logged_fit

STEPS, BATCH = 10, 24


def _fit(strategy, stages=3, cbs=(), steps=STEPS, ckpt_path=None):
    return logged_fit(strategy, StageMLP(stages), jl.data.ArrayLoader(stage_data(192), BATCH,
                                                                      seed=1),
                      steps, cbs, ckpt_path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("stages_ckpt"))
    return {
        "single": _fit("single"),
        # data 2 × pipe 3: one stage per pipeline device.
        "gpipe": _fit(strategies.GPipe(3, 4, devices=jax.devices()[:6]),
                      cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)]),
        "single4": _fit("single", stages=4),
        "hybrid4": _fit(strategies.Hybrid({"data": 2, "pipe": 4}, microbatches=4), stages=4),
        "ckpt": ckpt,
    }


@pytest.mark.slow
def test_stages_run_in_order_like_the_plain_layers():
    rngs = nnx.Rngs(0)
    layers = [nnx.Linear(6, 5, rngs=rngs), nnx.Linear(5, 3, rngs=rngs)]
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    expected = layers[1](nnx.relu(layers[0](x)))
    stages = nn.Stages([nnx.Sequential(nnx.clone(layers[0]), nnx.relu), nnx.clone(layers[1])])
    np.testing.assert_array_equal(stages(x), expected)
    np.testing.assert_array_equal(stages.stage(1).kernel[...], layers[1].kernel[...])
    assert stages.packed_float32.shape == (2, 128)  # 6·5+5 = 35 and 5·3+3 = 18, padded


@pytest.mark.slow
def test_gpipe_and_hybrid_match_single_device(runs):
    assert len(runs["single"]["losses"]) == STEPS
    assert_runs_close(runs["gpipe"], runs["single"])
    assert_runs_close(runs["hybrid4"], runs["single4"])
    for name in ("gpipe", "hybrid4"):
        assert runs[name]["fit"].compile_counts["train"] == 1


@pytest.mark.slow
def test_each_device_holds_its_own_stage(runs):
    fit = runs["gpipe"]["fit"]
    packed = fit.state.params["packed_float32"]
    own = runs["gpipe"]["module"].model.own_parameter_bytes()
    d = DIMS
    assert own == [4 * (d[0] * d[1] + d[1]), 4 * (d[1] * d[2] + d[2]), 4 * (d[2] * d[3] + d[3])]
    width = packed.shape[1]
    assert width == 1664  # the largest stage (48·32 + 32 = 1568) rounded up to 128
    mesh = fit.strategy.mesh
    for shard in packed.addressable_shards:
        stage = int(np.argwhere(mesh.devices == shard.device)[0][mesh.axis_names.index("pipe")])
        row = np.asarray(shard.data)
        assert row.shape == (1, width) and shard.data.nbytes == 4 * width
        # Its own stage's values, then only the zero padding.
        np.testing.assert_array_equal(row[0], np.asarray(packed[stage]))
        assert not row[0, own[stage] // 4:].any()
    mu = fit.state.opt_state[0].mu["packed_float32"]
    assert mu.addressable_shards[0].data.shape == (1, width)


@pytest.mark.slow
def test_schedule_iterations_and_permute_bytes(runs):
    fit = runs["gpipe"]["fit"]
    p, m = 3, 4
    assert fit.strategy.describe()["pipeline"]["iterations"] == m + p - 1
    stats = schedule_stats(fit.compiled_train_step.as_text())
    assert stats["iterations"] == [m + p - 1] * 2
    b = BATCH // (m * 2)  # per data shard
    width = DIMS[1]  # the widest stage output (32, 16, 10) is the buffer's width
    assert stats["collective_permute_bytes"] == 2 * (m + p - 1) * b * width * 4


@pytest.mark.slow
def test_checkpoints_move_between_gpipe_and_other_layouts(runs, tmp_path):
    expected = runs["gpipe"]["params"]
    path = os.path.join(runs["ckpt"], str(STEPS))
    for strategy in ("single", strategies.FSDP(min_shard_size=1)):
        model = jl.load_checkpoint(path, StageMLP(), strategy=strategy)
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    # And the other way: a single-device checkpoint restored as a 3-stage pipeline.
    ref = _fit("single", steps=2, cbs=[callbacks.ModelCheckpoint(str(tmp_path), every_n_steps=2)])
    model = jl.load_checkpoint(os.path.join(str(tmp_path), "2"), StageMLP(),
                               strategy=strategies.GPipe(3, 4, devices=jax.devices()[:6]))
    assert model.packed_float32[...].sharding.spec[0] == "pipe"
    np.testing.assert_array_equal(np.asarray(model.packed_float32[...]),
                                  ref["params"]["packed_float32"])


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_exact(runs, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = kill_at("stages", ckpt, STEPS, 6)
    assert saved and saved[-1] < STEPS, saved
    resumed = _fit(strategies.GPipe(3, 4, devices=jax.devices()[:6]),
                   cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)], ckpt_path="last")
    assert resumed["fit"].global_step == STEPS
    for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(runs["gpipe"]["params"]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_stage_count_not_divisible_by_pipe():
    with pytest.raises(jl.ConfigurationError, match=r"Stages module's 3 stages .* do not split "
                                                    r"into 4 pipeline devices.*\[1, 3\]"):
        _fit(strategies.GPipe(4, 4), steps=1)


def test_stage_with_other_state_or_not_a_module():
    rngs = nnx.Rngs(0)
    with pytest.raises(jl.ConfigurationError, match=r"stage 1 holds variables that are not "
                                                    r"parameters: .*BatchStat"):
        nn.Stages([nnx.Linear(2, 2, rngs=rngs), nnx.BatchNorm(2, rngs=rngs)])
    with pytest.raises(jl.ConfigurationError, match=r"stage 0 \(.*\) is not an nnx.Module; "
                                                    r"wrap a plain function in nnx.Sequential"):
        nn.Stages([jax.nn.relu])


@pytest.mark.slow
@pytest.mark.parametrize("remat", [True, "dots"])
def test_stage_remat_gives_the_same_gradients(remat):
    x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)

    def build(remat):
        rngs = nnx.Rngs(0)
        return nn.Stages([nnx.Sequential(nnx.Linear(6, 5, rngs=rngs), nnx.tanh),
                          nnx.Linear(5, 3, rngs=rngs)], remat=remat)

    def grads(remat):  # compiled: eagerly, each op of the backward pass was a compile
        grad = nnx.jit(nnx.grad(lambda m: (m(x) ** 2).sum()))
        return grad(build(remat))["packed_float32"][...]

    np.testing.assert_allclose(grads(remat), grads(False), rtol=1e-6)
    # Each stage really is a checkpointed (rematerialized) call; without remat none is.
    jaxpr = lambda r: str(jax.make_jaxpr(lambda x: build(r)(x))(x))  # noqa: E731
    assert jaxpr(remat).count("prevent_cse") == 2 and "prevent_cse" not in jaxpr(False)
    with pytest.raises(jl.ConfigurationError, match=r"remat='most' is not a rematerialization"):
        nn.Stages([nnx.Linear(2, 2, rngs=nnx.Rngs(0))], remat="most")


@pytest.mark.slow
def test_pipeline_remat_stores_less_and_trains_the_same(runs):
    # GPipe(remat=True) recomputes each device's stages in the backward pass (it was ignored by
    # Stages before: the compiled step kept every stage's activations).
    rematted = _fit(strategies.GPipe(3, 4, remat=True, devices=jax.devices()[:6]))
    assert_runs_close(rematted, runs["single"])
    temp = {name: run["fit"].compiled_train_step.memory_analysis().temp_size_in_bytes
            for name, run in (("remat", rematted), ("plain", runs["gpipe"]))}
    assert temp["remat"] < 0.9 * temp["plain"], temp
    assert rematted["fit"].strategy.describe()["pipeline"]["remat"] is True


def test_auto_offers_a_stages_model_the_gpipe_schedule_only():
    # Stages run GPipe's schedule (repeats=1); Auto offered repeats=2 beside each pipe mesh
    # whose stage count split into pipe × 2 (a compile that could only fail).
    module = StageMLP(4)
    spec = model_spec(module, build_optimizer(module, [])[0], 0)
    layouts = [c.layout for c in enumerate_candidates((), None, spec.abstract_state,
                                                      spec.logical_axes, 8)]
    assert "data=2,pipe=4" in layouts and "data=4,pipe=2" in layouts
    assert not any("repeats" in lay for lay in layouts), layouts


@pytest.mark.slow
def test_balanced_packing_holds_total_over_p_per_device(runs):
    # Stages(balance=True): the stages' parameters back to back, each pipeline device holding
    # total/p of them (and of the Adam slots) instead of the largest stage's row.
    loader = jl.data.ArrayLoader(stage_data(192), BATCH, seed=1)
    run = logged_fit(strategies.GPipe(3, 4, devices=jax.devices()[:6]),
                     StageMLP(balance=True), loader, STEPS)
    np.testing.assert_allclose(run["losses"], runs["single"]["losses"], rtol=1e-5)
    model, ref = run["module"].model, runs["single"]["module"].model
    for i in range(3):
        for a, b in zip(jax.tree.leaves(nnx.state(model.stage(i))),
                        jax.tree.leaves(nnx.state(ref.stage(i))), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    own = model.own_parameter_bytes()
    total = -(-sum(own) // (4 * 128 * 3)) * 128 * 3 * 4  # rounded up to 128 per stage row
    packed = run["fit"].state.params["packed_float32"]
    assert {s.data.nbytes for s in packed.addressable_shards} == {total // 3}
    assert total // 3 < max(own)  # less than the largest stage, which every padded row holds
    mu = run["fit"].state.opt_state[0].mu["packed_float32"]
    assert {s.data.nbytes for s in mu.addressable_shards} == {total // 3}
