"""Context parallelism: the sequence split over a `context` mesh axis (Hybrid).

The attention algorithms alone match single-device causal attention (forward and gradients,
so a wrong causal offset fails them); TinyLM (rotary positions) trains under `{"context": 8}`
(ring), `{"fsdp": 2, "context": 4}` (all-gather) and `{"data": 2, "context": 2, "tp": 2}`
with a remat policy to the single-device losses; a run killed by SIGKILL resumes bitwise, and its
checkpoints load under SingleDevice and FSDP.
"""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlight as jl
from jaxlight import callbacks, strategies
from jaxlight.analysis import _hlo
from jaxlight.nn import causal_attention
from jaxlight.nn._context_attention import context_parallel
from jaxlight.state._state import model_spec
from jaxlight.step._step import build_optimizer
from jaxlight.strategies._auto_candidates import enumerate_candidates
from tests.nn.stages_mlp import StageMLP, stage_data
from tests.pipeline_runs import kill_child_at
from tests.strategies.context_runs import context_data, context_module
from tests.strategies.lm import TinyLM

STEPS = 4
TOL = 1e-5
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_context_child.py")


def _mesh(**shape: int) -> Mesh:
    size = int(np.prod(list(shape.values())))
    devices = np.asarray(jax.devices()[:size], dtype=object).reshape(tuple(shape.values()))
    return Mesh(devices, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


@pytest.mark.slow
def test_ring_and_allgather_match_causal_attention_with_gradients():
    """Both algorithms on data=2 × context=4: outputs and dq, dk, dv equal the unsplit
    causal attention. Each device's queries see its own and earlier shards only, so an offset
    off by one shard (or a mask by local index) changes every block but the first."""
    mesh = _mesh(data=2, context=4)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, 2, 8)), jnp.float32) for _ in range(3))
    w = jnp.asarray(rng.normal(size=(2, 16, 2, 8)), jnp.float32)

    def loss(q, k, v, cp):
        out = causal_attention(q, k, v, scale=0.3) if cp is None else cp.attention(q, k, v, 0.3)
        return jnp.sum(out * w), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (_, ref_out), ref_grads = jax.jit(lambda *a: grad(*a, None))(q, k, v)
    sharded = [jax.device_put(x, NamedSharding(mesh, P("data", "context"))) for x in (q, k, v)]
    for algorithm in ("ring", "allgather"):
        with jax.set_mesh(mesh), context_parallel(mesh, algorithm) as cp:
            (_, out), grads = jax.jit(lambda *a: grad(*a, cp))(*sharded)
        np.testing.assert_allclose(out, ref_out, atol=1e-5, err_msg=algorithm)
        for got, want in zip(grads, ref_grads, strict=True):
            np.testing.assert_allclose(got, want, atol=1e-5, err_msg=algorithm)


@pytest.mark.parametrize("n", [2, 4])
def test_ring_keeps_two_score_blocks_per_device(n):
    """The ring's backward pass is flash-style: the compiled gradient holds two float32
    Lc × Lc blocks per head at a time (one device holds four L × L). A ring that let XLA keep
    the forward's blocks for the backward, or schedule two hops' blocks at once (n = 2 inlines
    the one-hop loop), or save a block-sized mask per hop holds 3.5 to 7 blocks."""
    mesh = _mesh(context=n)
    b, length, h, d = 1, 1024, 2, 4  # head_dim 4: the linear-size buffers stay small
    spec = jax.ShapeDtypeStruct((b, length, h, d), jnp.float32,
                                sharding=NamedSharding(mesh, P(None, "context")))

    def loss(q, k, v, w, cp):
        return jnp.sum((cp.attention(q, k, v, 0.5) - w) ** 2)  # the gradient needs the output

    with jax.set_mesh(mesh), context_parallel(mesh, "ring") as cp:
        compiled = jax.jit(jax.grad(lambda *a: loss(*a, cp), argnums=(0, 1, 2))).lower(
            spec, spec, spec, spec).compile()
    block = b * h * (length // n) ** 2 * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 2.3 * block, (temp / block, "blocks")


def _fit(strategy, module=None, ckpt=None):
    losses = []
    log = callbacks.LambdaCallback(on_log=lambda fit, m, metrics, step: losses.append(
        metrics["loss"]) if "loss" in metrics else None)
    # The last step's checkpoint is the one read (`_resumes_bitwise_and_checkpoints_move`).
    cbs = [log] + ([callbacks.ModelCheckpoint(ckpt, every_n_steps=STEPS)] if ckpt else [])
    fit = jl.Fit(strategy=strategy, max_steps=STEPS, log_every_n_steps=1, callbacks=cbs,
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=bool(ckpt))
    module = module or context_module()
    fit.fit(module, context_data(STEPS))
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return {"fit": fit, "losses": np.asarray(losses), "params": params}


@pytest.fixture(scope="module")
def reference():
    return _fit("single")


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("context") / "full")
    return _fit(strategies.Hybrid({"context": 8}), ckpt=ckpt) | {"ckpt": ckpt}


def _close(run, ref):
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0]
    np.testing.assert_allclose(run["losses"], ref["losses"], atol=TOL, rtol=0)


@pytest.mark.slow
def test_ring_matches_single_device_and_permutes_keys_and_values(ring, reference):
    _close(ring, reference)
    fit = ring["fit"]
    assert fit.strategy.describe()["context_attention"] == "ring"
    # Keys and values travel the 8-device ring: collective-permutes over the whole mesh, none
    # of the all-gathers the other algorithm would use.
    found = _hlo.collectives(fit.session.compiled_train_step.as_text())
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert permutes and not [c for c in found if c.kind == "all-gather"], found


@pytest.mark.slow
@pytest.mark.parametrize("mesh,kw", [
    ({"fsdp": 2, "context": 4}, {"context_attention": "allgather"}),
    ({"data": 2, "context": 2, "tp": 2}, {}),
])
def test_layouts_match_single_device(mesh, kw, reference):
    # The tp composition also recomputes each block in the backward pass (remat="dots").
    module = context_module()
    if "tp" in mesh:
        module = type(module)(heads=2, remat="dots")
    _close(_fit(strategies.Hybrid(mesh, **kw), module), reference)


def _kill_at(ckpt: str, step: int, **cfg) -> list[int]:
    return kill_child_at([CHILD, json.dumps({"dir": ckpt, "max_steps": STEPS, **cfg})], ckpt,
                         step)


def _resumes_bitwise_and_checkpoints_move(full, tmp_path, mesh=None, kw=None):
    """Kills a child training under Hybrid(mesh, **kw) after step 3, resumes it here from its
    last checkpoint and compares with the uninterrupted run `full`; the full run's checkpoint
    loads under SingleDevice and FSDP (parameters are not split over context)."""
    cfg = {"mesh": mesh, "kw": kw or {}} if mesh else {}
    killed = str(tmp_path / "killed")
    saved = _kill_at(killed, 3, **cfg)
    assert saved and saved[-1] < STEPS, saved
    fit = jl.Fit(strategies.Hybrid(mesh or {"context": 8}, **(kw or {})), max_steps=STEPS,
                 callbacks=[callbacks.ModelCheckpoint(killed, every_n_steps=1)],
                 enable_progress_bar=False, enable_model_summary=False, logger=False)
    module = context_module()
    fit.fit(module, context_data(STEPS), ckpt_path="last")
    assert fit.global_step == STEPS
    models = [module.model] + [
        jl.load_checkpoint(os.path.join(full["ckpt"], str(STEPS)), context_module(),
                           strategy=strategy)
        for strategy in ("single", strategies.FSDP(min_shard_size=1))]
    for model in models:
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(full["params"]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)


@pytest.mark.slow
def test_resumes_bitwise_after_sigkill_and_checkpoints_move(ring, tmp_path):
    _resumes_bitwise_and_checkpoints_move(ring, tmp_path)


def test_sequence_not_divisible_by_context_is_refused():
    fit = jl.Fit(strategies.Hybrid({"context": 8}), max_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False)
    data = [{"tokens": np.zeros((4, 13), np.int32)}]
    with pytest.raises(jl.ShardingError, match=r"size 12 \(logical axis 'length'\) is not "
                       r"divisible by mesh axes \('context',\) of total size 8"):
        fit.fit(context_module(), data)


def test_unknown_algorithm_is_refused():
    with pytest.raises(jl.ConfigurationError, match=r"context_attention='rign'.*'ring'"):
        strategies.Hybrid({"context": 8}, context_attention="rign")


@pytest.mark.slow
def test_plan_shows_the_context_collectives(ring):
    plan = ring["fit"].plan(context_module(), next(iter(context_data(1))), verbose=False)
    # 1 layer-scan of 2 layers × 7 hops × (K, V) forward, the same of dK, dV backward.
    assert ("context: ring attention, each sequence split over 8 devices (1/8 of its "
            "activations per device); attention collectives: 56 collective-permute per step"
            ) in plan.table()


def test_auto_considers_context_for_long_sequences():
    module = context_module()
    spec = model_spec(module, build_optimizer(module, [])[0], 0)

    def layouts(batch, length):
        tokens = jax.ShapeDtypeStruct((batch, length), np.int32)
        return [c.layout for c in enumerate_candidates(
            (), None, spec.abstract_state, spec.logical_axes, 8, {"tokens": tokens})]

    assert {"context=8", "data=2,context=4", "data=4,context=2"} <= set(layouts(4, 4097))
    assert "data=2,context=4" not in layouts(1, 4097)  # data 2 cannot split one sequence
    assert not [lay for lay in layouts(64, 65) if "context" in lay]  # short: not a candidate
    assert [lay for lay in layouts(2, 513) if "context" in lay]  # 256 tokens per sequence


# -- pipe × context: each stage runs on its device's shard of the sequence -------------------

PIPE_CONTEXT = {"mesh": {"pipe": 2, "context": 4}, "kw": {"microbatches": 2}}


@pytest.fixture(scope="module")
def pipe_context(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("pipe_context") / "full")
    strategy = strategies.Hybrid(PIPE_CONTEXT["mesh"], **PIPE_CONTEXT["kw"])
    return _fit(strategy, ckpt=ckpt) | {"ckpt": ckpt}


@pytest.mark.slow
def test_pipe_and_context_match_single_device(pipe_context, reference):
    """The GPipe schedule manual over pipe and context: attention inside a stage passes keys
    and values around the context ring of its own pipeline stage (collective-permutes over
    4 devices), the stage's parameter gradients are summed over the sequence shards."""
    _close(pipe_context, reference)
    fit = pipe_context["fit"]
    assert fit.compile_counts["train"] == 1
    text = fit.session.compiled_train_step.as_text()
    permutes = [{tuple(map(int, pair.split(","))) for pair in re.findall(r"\{(\d+,\d+)\}", g)}
                for g in re.findall(r"source_target_pairs=(\{.*?\}\})", text)]
    # Device pipe·4 + context: the context rings stay inside a stage (keys and values), the
    # pipeline's permutes join the two stages' devices of equal context index (activations).
    assert any(len(ps) == 8 and all(a // 4 == b // 4 for a, b in ps) for ps in permutes)
    assert any(ps and all(a % 4 == b % 4 and a != b for a, b in ps) for ps in permutes)
    assert "context: ring attention, each sequence split over 4 devices" in fit.plan(
        context_module(), next(iter(context_data(1))), verbose=False).table()


@pytest.mark.slow
@pytest.mark.parametrize("mesh,kw,layers", [
    ({"data": 2, "pipe": 2, "context": 2}, {"microbatches": 2, "context_attention": "allgather"},
     2),
    ({"pipe": 2, "context": 2, "tp": 2}, {"microbatches": 2, "remat": True}, 2),
    # The interleaved schedule: 4 layers as 2 stages × 2 chunks.
    ({"pipe": 2, "context": 4}, {"microbatches": 2, "repeats": 2}, 4),
])
def test_pipe_and_context_layouts_match_single_device(mesh, kw, layers, reference):
    ref = reference if layers == 2 else _fit("single", TinyLM(heads=2, layers=layers))
    _close(_fit(strategies.Hybrid(mesh, **kw), TinyLM(heads=2, layers=layers)), ref)


@pytest.mark.slow
def test_pipe_and_context_resume_bitwise_after_sigkill(pipe_context, tmp_path):
    _resumes_bitwise_and_checkpoints_move(pipe_context, tmp_path, **PIPE_CONTEXT)


def test_stages_under_a_context_axis_are_refused():
    fit = jl.Fit(strategies.Hybrid({"pipe": 2, "context": 4}, microbatches=2), max_steps=1,
                 enable_progress_bar=False, enable_model_summary=False, logger=False)
    with pytest.raises(jl.ConfigurationError, match=r"pipelined Stages cannot run under a "
                       r"context axis \(context=4\).*Stacked block"):
        fit.fit(StageMLP(stages=4), jl.data.ArrayLoader(stage_data(8), 8))
