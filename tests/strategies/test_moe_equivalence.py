"""A mixture-of-experts LM trains the same under expert parallelism as on one device.

The tiny MoE LM (8 experts, top-2, aux loss in the loss) trains 10 AdamW steps under
SingleDevice and under meshes with an `expert` axis; losses (aux loss included) agree step by
step to 1e-5 relative and every final parameter to 1e-5 relative.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from tests.strategies.lm import token_batches
from tests.strategies.moe_lm import TinyMoELM
from tests.strategies.test_equivalence import LossRecorder, assert_params_close, train

RTOL = 1e-5
STEPS = 10

LAYOUTS = {
    "expert4": ({"expert": 4}, 4),
    "data2_expert4": ({"data": 2, "expert": 4}, 8),
    "fsdp2_expert2_tp2": ({"fsdp": 2, "expert": 2, "tp": 2}, 8),
}


def _run(strategy, cbs=(), **kw):
    return train(strategy, TinyMoELM(**kw), token_batches(STEPS, batch=16), steps=STEPS, cbs=cbs)


@pytest.fixture(scope="module")
def reference():
    return _run(strategies.SingleDevice(), bias_update_rate=1e-3)


#: The layout whose run also saves its step 4 (`test_moe_checkpoint_moves_between_layouts`
#: resumes it on one device): one fit for both tests.
SAVED = "data2_expert4"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """(the `SAVED` layout's run, its checkpoint folder): 10 steps saving every 4th."""
    ckpt = str(tmp_path_factory.mktemp("moe_layouts"))
    shape, n = LAYOUTS[SAVED]
    run = _run(strategies.Hybrid(shape, devices=jax.devices()[:n]), bias_update_rate=1e-3,
               cbs=[callbacks.ModelCheckpoint(ckpt, every_n_steps=4, save_top_k=-1)])
    return run, ckpt


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_expert_parallel_matches_single_device(name, reference, request):
    shape, n = LAYOUTS[name]
    fit, losses, params = (request.getfixturevalue("saved_run")[0] if name == SAVED else
                           _run(strategies.Hybrid(shape, devices=jax.devices()[:n]),
                                bias_update_rate=1e-3))
    _, ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(name, params, ref_params, RTOL)
    # the experts really are split: each device holds 1/expert of every expert weight
    gate = fit.state.params["blocks"]["layers"]["moe"]["gate"]
    shard = gate.addressable_shards[0].data.shape
    assert shard[1] == gate.shape[1] // shape["expert"], (shard, gate.shape)
    assert fit.compile_counts["train"] == 1  # one compiled step for the 10 steps


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "tp2", "auto"])
def test_moe_under_other_strategies_matches_single_device(name, reference):
    """Without an expert axis the experts run per data-parallel shard (FSDP gathers them at
    the layer, tp splits their width); "auto" is whatever Fit() picks for the MoE LM."""
    strategy = {"fsdp": strategies.FSDP, "tp2": lambda: strategies.TensorParallel(2),
                "auto": lambda: "auto"}[name]()
    _, losses, params = _run(strategy, bias_update_rate=1e-3)
    _, ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_params_close(name, params, ref_params, RTOL)


@pytest.mark.slow
def test_moe_checkpoint_moves_between_layouts(saved_run, reference):
    """4 steps under data 2 x expert 4, saved (the `saved_run` fit's step 4); resumed on one
    device for the last 6 (the experts and the auxiliary-loss-free bias come back whole): the
    single device's run."""
    batches = token_batches(STEPS, batch=16)
    _, ckpt = saved_run
    recorder = LossRecorder()
    module = TinyMoELM(bias_update_rate=1e-3)
    second = jl.Fit(strategy=strategies.SingleDevice(), max_steps=STEPS, log_every_n_steps=1,
                    enable_progress_bar=False, enable_model_summary=False, logger=False,
                    enable_checkpointing=False, callbacks=[recorder])
    second.fit(module, batches, ckpt_path=os.path.join(ckpt, "4"))
    assert min(recorder.losses) == 5 and second.global_step == STEPS  # resumed at step 4
    _, ref_losses, ref_params = reference
    np.testing.assert_allclose([recorder.losses[s] for s in range(5, STEPS + 1)],
                               ref_losses[4:], rtol=RTOL)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    assert_params_close("resumed", params, ref_params, RTOL)
    bias = np.asarray(module.model.blocks.layers.moe.router_bias[...])
    assert np.abs(bias).max() > 0  # the bias moved and came back


@pytest.mark.slow
def test_moe_with_gradient_accumulation_under_expert_axis():
    """GradientAccumulation(2) scans per data-parallel replica (manual over data and expert):
    there each replica gathers every expert and routes its own tokens, with the global load
    (no all-to-all); the run equals one device's with the same accumulation."""
    batches = token_batches(STEPS, batch=16)

    def run(strategy):
        recorder = LossRecorder()
        fit = jl.Fit(strategy=strategy, max_steps=4, log_every_n_steps=1,
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     enable_checkpointing=False,
                     callbacks=[recorder, callbacks.GradientAccumulation(2)])
        fit.fit(TinyMoELM(bias_update_rate=1e-3), batches)
        return np.array([recorder.losses[s] for s in range(1, 5)])

    np.testing.assert_allclose(run(strategies.Hybrid({"data": 2, "expert": 4})),
                               run(strategies.SingleDevice()), rtol=RTOL)


@pytest.mark.slow
def test_moe_resume_after_sigkill_is_bitwise_exact(tmp_path):
    """Real processes, real orbax checkpoints, under data 2 x expert 4: killed after step 3's
    save committed, resumed and killed in the middle of saving step 6, resumed again to the
    end: every weight, the routing bias and the optimizer state equal an uninterrupted run's
    bit for bit."""
    import os
    import signal

    from jaxlight.checkpoint._restore import complete_steps
    from tests.checkpoint._common import make_fit
    from tests.checkpoint._proc import Child, kill_leftovers
    from tests.strategies import moe_resume

    ckpt = str(tmp_path / "ckpt")
    run = {"strategy": moe_resume.STRATEGY, "module": "moe", "dir": ckpt,
           "max_steps": moe_resume.STEPS}
    try:
        first = Child({**run, "pause_at": 3}, str(tmp_path))
        first.wait_for("PAUSED", timeout=600)
        os.kill(first.proc.pid, signal.SIGKILL)
        assert first.finish() == -signal.SIGKILL
        assert complete_steps(ckpt) in ([3], [2, 3])
        second = Child({**run, "selfkill_at": 6, "ckpt_path": "last"}, str(tmp_path))
        assert second.finish(timeout=600) == -signal.SIGKILL, second.stderr()[-3000:]
        steps = [line for line in second.lines if line.startswith("STEP")]
        assert steps == ["STEP 4", "STEP 5"], second.lines  # resumed after step 3
        assert os.path.isdir(os.path.join(ckpt, "6.orbax-checkpoint-tmp"))
    finally:
        kill_leftovers()

    resumed = moe_resume.module()
    fit = make_fit(moe_resume.STRATEGY, moe_resume.STEPS,
                   [callbacks.ModelCheckpoint(ckpt, every_n_steps=1)])
    fit.fit(resumed, moe_resume.batches(), ckpt_path="last")
    assert fit.global_step == moe_resume.STEPS and complete_steps(ckpt) == [moe_resume.STEPS]
    reference = moe_resume.module()
    again = make_fit(moe_resume.STRATEGY, moe_resume.STEPS)
    again.fit(reference, moe_resume.batches())
    got, want = (jax.device_get((nnx.to_pure_dict(nnx.state(m.model)), f.state.opt_state))
                 for m, f in ((resumed, fit), (reference, again)))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.abs(np.asarray(resumed.model.blocks.layers.moe.router_bias[...])).max() > 0


def test_auto_proposes_expert_layouts_for_a_moe_model():
    from jaxlight._fit import abstract_global_batch
    from jaxlight.state._state import model_spec
    from jaxlight.step._step import build_optimizer
    from jaxlight.strategies._auto_candidates import enumerate_candidates
    from tests.strategies.lm import TinyLM

    def layouts(module):
        spec = model_spec(module, build_optimizer(module, [])[0], 0)
        batch = abstract_global_batch(token_batches(1, batch=16)[0])
        return [c.layout for c in enumerate_candidates(
            (), None, spec.abstract_state, spec.logical_axes, 8, batch)]

    moe = layouts(TinyMoELM())  # 8 experts
    assert {"expert=8", "data=2,expert=4", "data=4,expert=2", "fsdp=2,expert=4",
            "data=2,fsdp=2,expert=2", "fsdp=4,expert=2"} <= set(moe)
    assert "data=8" in moe and moe.index("data=8") < moe.index("data=2,expert=4")
    six = [lay for lay in layouts(TinyMoELM(experts=6)) if "expert" in lay]
    assert six and all("expert=2" in lay for lay in six)  # 4 and 8 do not divide 6 experts
    assert not [lay for lay in layouts(TinyLM()) if "expert" in lay]  # a dense model: none


@pytest.mark.slow
def test_auto_compiles_an_expert_layout():
    auto = strategies.Auto(layouts=["data+expert"], shortcut=0)
    fit = jl.Fit(strategy=auto, max_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False)
    fit.plan(TinyMoELM(), token_batches(1, batch=16)[0], verbose=False)
    assert dict(fit.strategy.mesh.shape).get("expert", 1) > 1, auto.choice
    chosen = {c.layout: c for c in auto.choice.candidates}[auto.choice.chosen]
    assert chosen.bytes_per_device and chosen.collective_bytes > 0  # the tokens' all-to-alls
