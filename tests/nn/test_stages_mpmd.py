"""GPipe(mpmd=True): a program per device, each holding exactly its own stages' parameters."""

from __future__ import annotations

import os

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, nn, strategies
from jaxlight.analysis._hlo import collectives
from tests.nn.stages_mlp import DIMS, StageMLP, stage_data
from tests.pipeline_runs import assert_runs_close, kill_at, logged_fit

STEPS, BATCH, M = 10, 24, 4


def _mpmd(**kwargs):
    return strategies.GPipe(3, M, mpmd=True, devices=jax.devices()[:3], **kwargs)


def _fit(strategy, packed=False, cbs=(), steps=STEPS, ckpt_path=None, stages=3):
    return logged_fit(strategy, StageMLP(stages, packed=packed),
                      jl.data.ArrayLoader(stage_data(192), BATCH, seed=1), steps, cbs,
                      ckpt_path)


def _bytes_by_device(tree, devices) -> list[int]:
    per = {d: 0 for d in devices}
    for leaf in jax.tree.leaves(tree):
        (device,) = leaf.sharding.device_set
        per[device] += leaf.nbytes
    return list(per.values())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("mpmd_ckpt"))
    return {
        "single": _fit("single"),
        "mpmd": _fit(_mpmd(), cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)]),
        "ckpt": ckpt,
    }


@pytest.mark.slow
def test_mpmd_matches_single_device(runs):
    assert len(runs["mpmd"]["losses"]) == STEPS
    assert_runs_close(runs["mpmd"], runs["single"])
    assert runs["mpmd"]["fit"].compile_counts["train"] == 1


@pytest.mark.slow
def test_unpacked_stages_match_under_spmd_gpipe_too(runs):
    assert_runs_close(_fit(strategies.GPipe(3, M, devices=jax.devices()[:6])), runs["single"])


@pytest.mark.slow
def test_each_device_holds_exactly_its_own_stage(runs):
    fit, model = runs["mpmd"]["fit"], runs["mpmd"]["module"].model
    devices = fit.strategy.pipeline_devices
    own = model.own_parameter_bytes()
    d = DIMS
    assert own == [4 * (d[0] * d[1] + d[1]), 4 * (d[1] * d[2] + d[2]), 4 * (d[2] * d[3] + d[3])]
    assert _bytes_by_device(fit.state.params, devices) == own
    adam = fit.state.opt_state[0]
    assert _bytes_by_device(adam.mu, devices) == own
    assert _bytes_by_device(adam.nu, devices) == own
    assert fit.state.step.sharding.device_set == {devices[0]}


@pytest.mark.slow
def test_copies_are_exactly_the_stage_boundaries(runs):
    """Per step: each boundary's activation forward and its gradient backward, once per
    microbatch, b·w·4 bytes each (no padding to the widest boundary), and the labels from the
    first device (where the batch arrives) to the loss beside the last stage; the other copies
    are scalars (Adam's bias corrections for the leaves beside the step counter)."""
    fit = runs["mpmd"]["fit"]
    copies = fit.compiled_train_step.transfers()
    b = BATCH // M
    big = sorted((c.source, c.target, c.nbytes) for c in copies if c.nbytes > 8)
    expected = sorted([(0, 1, b * DIMS[1] * 4), (1, 2, b * DIMS[2] * 4),
                       (1, 0, b * DIMS[1] * 4), (2, 1, b * DIMS[2] * 4)] * M
                      + [(0, 2, BATCH * 4)])
    assert big == expected
    assert all(c.nbytes <= 8 for c in copies if c.nbytes <= 8)
    assert not collectives(fit.compiled_train_step.as_text())


@pytest.mark.slow
def test_checkpoints_move_between_mpmd_and_other_layouts(runs, tmp_path):
    expected = runs["mpmd"]["params"]
    path = os.path.join(runs["ckpt"], str(STEPS))
    for strategy in ("single", strategies.FSDP(min_shard_size=1)):
        model = jl.load_checkpoint(path, StageMLP(packed=False), strategy=strategy)
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
    ref = _fit("single", steps=2, cbs=[callbacks.ModelCheckpoint(str(tmp_path), every_n_steps=2)])
    model = jl.load_checkpoint(os.path.join(str(tmp_path), "2"), StageMLP(packed=False),
                               strategy=_mpmd())
    devices = jax.devices()[:3]
    for s in range(3):
        kernel = model.stage(s).layers[0].kernel if s < 2 else model.stage(s).kernel
        assert kernel[...].sharding.device_set == {devices[s]}
    got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_exact(runs, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = kill_at("stages_mpmd", ckpt, STEPS, 6)
    assert saved and saved[-1] < STEPS, saved
    resumed = _fit(_mpmd(), cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)],
                   ckpt_path="last")
    assert resumed["fit"].global_step == STEPS
    for a, b in zip(jax.tree.leaves(resumed["params"]), jax.tree.leaves(runs["mpmd"]["params"]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_evaluation_prediction_and_eager_use_after_fit(runs):
    fit, module = runs["mpmd"]["fit"], runs["mpmd"]["module"]
    data = stage_data(10, seed=3)  # 10 examples: not a multiple of the 4 microbatches
    ref = runs["single"]["module"].model(data["x"])
    np.testing.assert_allclose(module.model(data["x"]), ref, rtol=1e-5, atol=1e-5)
    preds = fit.predict(module, [{"x": data["x"]}])
    np.testing.assert_allclose(np.asarray(preds[0]), ref, rtol=1e-5, atol=1e-5)


class _Validated(StageMLP):
    def validation_step(self, model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return {"val_loss": loss, "val_logit_sum": logits.sum()}


@pytest.mark.slow
def test_validation_over_any_batch_size_equals_single_device(tmp_path):
    """Validation during fit and Fit.validate: batches of 24 (4 microbatches) and a short last
    one of 10 (one microbatch) give the single device's exact metrics."""
    val = jl.data.ArrayLoader(stage_data(58, seed=5), 24)
    metrics = {}
    for name, strategy in (("single", "single"), ("mpmd", _mpmd())):
        fit = jl.Fit(strategy=strategy, max_steps=2, enable_progress_bar=False, logger=False,
                     enable_checkpointing=False)
        module = _Validated(packed=False)
        fit.fit(module, jl.data.ArrayLoader(stage_data(48), BATCH), val)
        metrics[name] = fit.validate(module, val)
    assert set(metrics["mpmd"]) == set(metrics["single"]) and metrics["single"]
    for key, value in metrics["single"].items():
        np.testing.assert_allclose(metrics["mpmd"][key], value, rtol=1e-5)


@pytest.mark.slow
def test_pipeline_remat_trains_the_same():
    assert_runs_close(_fit(_mpmd(remat=True), steps=3), _fit("single", steps=3))


@pytest.mark.slow
def test_plan_shows_each_device_its_own_bytes():
    fit = jl.Fit(strategy=_mpmd(), max_steps=1, enable_progress_bar=False, logger=False)
    plan = fit.plan(StageMLP(packed=False), stage_data(BATCH), verbose=False)
    pipe = plan.strategy["pipeline"]
    assert pipe["mpmd"] and pipe["param_bytes_by_device"] == \
        StageMLP(packed=False).configure_model(nnx.Rngs(0)).own_parameter_bytes()
    assert plan.param_bytes_per_device == max(pipe["param_bytes_by_device"])
    assert pipe["copies"] > 0 and "a program per device" in plan.table()
    assert "whole on pipe device 2" in plan.table()


def test_refusals_say_what_to_do():
    with pytest.raises(jl.ConfigurationError, match=r"packed=False"):
        _fit(_mpmd(), packed=True, steps=1)
    with pytest.raises(jl.ConfigurationError, match=r"does not take \['repeats'\]"):
        strategies.GPipe(4, 8, repeats=2, mpmd=True)
    with pytest.raises(jl.ConfigurationError,
                       match=r"4 stages, which do not split into 3 pipeline devices"):
        _fit(_mpmd(), stages=4, steps=1)
    with pytest.raises(jl.ConfigurationError, match=r"inside a `scan`.*GradientAccumulation"):
        _fit(_mpmd(), cbs=[callbacks.GradientAccumulation(2)], steps=1)
    with pytest.raises(jl.ConfigurationError, match=r"needs 9 devices, but only 8"):
        _fit(strategies.GPipe(9, 9, mpmd=True), steps=1)
    with pytest.raises(jl.ConfigurationError, match=r"no jaxlight.nn.Stages\(\.\.\., packed"):
        jl.Fit(strategy=_mpmd(), max_steps=1, logger=False).plan(
            _Plain(), stage_data(BATCH), verbose=False)


class _Plain(StageMLP):
    def configure_model(self, rngs):
        return nn.Stages([nnx.Linear(DIMS[0], DIMS[-1], rngs=rngs)], packed=True)


@pytest.mark.slow
def test_auto_weighs_the_program_per_device_and_can_pick_it(runs):
    """Auto lists `pipe=p mpmd` for a Stages(packed=False) model, compiles it (bytes of the
    busiest device, the pipeline's makespan at roofline costs), and trains it when chosen."""
    auto = strategies.Auto(layouts=["pipe"], shortcut=0, max_compiles=4, explore=4,
                           verbose=False)
    run = _fit(auto)
    choice = auto.choice
    layouts = {c.layout: c for c in choice.candidates}
    assert "pipe=3 mpmd" in layouts, sorted(layouts)
    mpmd = layouts["pipe=3 mpmd"]
    assert mpmd.status in ("chosen", "fits") and mpmd.predicted_s > 0
    assert mpmd.flops > 0 and mpmd.collective_bytes > 0
    if choice.chosen == "pipe=3 mpmd":
        assert_runs_close(run, runs["single"])
    assert "pipe=3 mpmd" in choice.table()
    # The schedules too, each priced by the makespan of its own order: ZB-H1's W passes fill
    # GPipe's bubble, 1F1B's order is as long as GPipe's.
    for schedule in ("1f1b", "zb-h1"):
        assert layouts[f"pipe=3 mpmd {schedule}"].predicted_s > 0, sorted(layouts)
    assert layouts["pipe=3 mpmd zb-h1"].predicted_s <= mpmd.predicted_s * 1.01


class _FirstStageFrozen(StageMLP):
    """Stage 0 frozen (not trained, not saved: rebuilt from configure_model on restore)."""

    @staticmethod
    def trainable(path, value):
        return isinstance(value, nnx.Param) and path[1] != 0


@pytest.mark.slow
def test_frozen_stage_is_rebuilt_on_its_device_when_resuming(tmp_path):
    loader = jl.data.ArrayLoader(stage_data(96), BATCH, seed=1)
    ckpt = callbacks.ModelCheckpoint(str(tmp_path), every_n_steps=2)
    first = logged_fit(_mpmd(), _FirstStageFrozen(packed=False), loader, 2, [ckpt])
    resumed = logged_fit(_mpmd(), _FirstStageFrozen(packed=False), loader, 4,
                         [callbacks.ModelCheckpoint(str(tmp_path), every_n_steps=2)],
                         ckpt_path="last")
    assert resumed["fit"].global_step == 4
    fresh = _FirstStageFrozen(packed=False).configure_model(nnx.Rngs(0))
    kernel = resumed["module"].model.stage(0).layers[0].kernel[...]
    assert kernel.sharding.device_set == {jax.devices()[0]}
    np.testing.assert_array_equal(np.asarray(kernel), fresh.stage(0).layers[0].kernel[...])
    assert not np.array_equal(resumed["params"]["stage_modules"][2]["kernel"],
                              first["params"]["stage_modules"][2]["kernel"])


@pytest.mark.parametrize("options", [
    {"gradient_clip_val": 0.05},  # a global norm: every device's squares summed on one
    {"precision": "bf16-mixed"},
    {"callbacks": [callbacks.EMAWeightAveraging(decay=0.9)]},
], ids=["clip", "bf16", "ema"])
@pytest.mark.slow
def test_step_transforms_match_single_device(options):
    """Callbacks that transform the step run inside the per-device programs unchanged."""
    losses = {}
    for name, strategy in (("single", "single"), ("mpmd", _mpmd())):
        got = []
        log = callbacks.LambdaCallback(on_log=lambda f, m, metrics, step: got.append(
            metrics["loss"]))
        cbs = [log, *options.get("callbacks", [])]
        fit = jl.Fit(strategy=strategy, max_steps=4, log_every_n_steps=1, callbacks=cbs,
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     enable_checkpointing=False,  # the losses are compared, nothing is saved
                     **{k: v for k, v in options.items() if k != "callbacks"})
        fit.fit(StageMLP(packed=False), jl.data.ArrayLoader(stage_data(96), BATCH, seed=1))
        losses[name] = np.asarray(got)
    # bf16-mixed: the logged loss is a bf16 value, and a microbatch's partial gradient is
    # rounded to bf16 before the float32 sum: one bf16 rounding (2^-8) of room.
    tol = 2.0 ** -8 if "precision" in options else 1e-5
    np.testing.assert_allclose(losses["mpmd"], losses["single"], rtol=tol)
