"""A float64 model's gradients are summed over microbatches in float64: gradient accumulation
(`callbacks.Microbatches`) and the per-device pipeline schedules equal one device to float64's
rounding. They had been summed in float32 (right for bf16, a truncation for float64): the
seeds' MLP under 1F1B and ZB-H1 ended 3.5e-6 from one device after 10 AdamW steps, GPipe 6e-14
(now all 2e-14: benchmarks/pipeline_schedules.py --sections equivalence_float64)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from tests.nn.stages_mlp import StageMLP, stage_data


class Float64MLP(StageMLP):
    """tests/nn/stages_mlp.py's 3-stage MLP, scaled down, with float64 parameters (its initial
    values widened; computing in float64 on float64 inputs)."""

    def __init__(self):
        super().__init__(dims=(12, 16, 8, 10), packed=False)

    def configure_model(self, rngs):
        model = super().configure_model(rngs)
        nnx.update(model, jax.tree.map(lambda v: v.astype(np.float64),
                                       nnx.state(model, nnx.Param)))
        return model


def _fit(strategy, cbs=()) -> dict:
    data = stage_data(24, 12)
    data = [{"x": data["x"][i:i + 8].astype(np.float64), "y": data["y"][i:i + 8]}
            for i in range(0, 24, 8)]
    module = Float64MLP()
    jl.Fit(strategy=strategy, max_steps=3, callbacks=list(cbs), enable_progress_bar=False,
           enable_model_summary=False, logger=False, enable_checkpointing=False).fit(module, data)
    params = nnx.to_pure_dict(nnx.state(module.model, nnx.Param))
    assert {str(v.dtype) for v in jax.tree.leaves(params)} == {"float64"}
    return jax.tree.map(np.asarray, params)


def _max_diff(a: dict, b: dict) -> float:
    return max(float(np.abs(x - y).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture
def one_device(x64):
    return _fit("single")


def test_gradient_accumulation_sums_float64_in_float64(one_device):
    # Summed in float32 (before the fix): 3.8e-9 apart; in float64: 6e-17.
    assert _max_diff(_fit("single", [callbacks.Microbatches(4)]), one_device) < 1e-12


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pipeline_schedules_sum_float64_in_float64(one_device, schedule):
    strategy = strategies.GPipe(3, 4, schedule=schedule, mpmd=True, devices=jax.devices()[:3])
    # Summed in float32 (before the fix): 7.7e-9 apart; in float64: 6e-17.
    assert _max_diff(_fit(strategy), one_device) < 1e-12


def test_gradient_norm_of_float64_gradients_is_float64(x64):
    """Gradient clipping's norm (`grad_norm`, and the clip factor) in the gradients' dtype where
    that is wider than float32, as torch's clip_grad_norm_: float32 sums leave it ~5e-8
    relative from the exact norm; narrower gradients are still summed in float32."""
    from jaxlight.callbacks._clipping import global_norm

    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(300,)) * 1e-3, "b": rng.normal(size=(7, 5))}
    exact = np.sqrt(sum(np.sum(np.square(g)) for g in grads.values()))
    norm = global_norm(jax.tree.map(jax.numpy.asarray, grads))
    assert norm.dtype == np.float64
    assert abs(float(norm) - exact) <= 1e-14 * exact
    narrow = global_norm({k: jax.numpy.asarray(v, jax.numpy.bfloat16) for k, v in grads.items()})
    assert narrow.dtype == np.float32
