"""Fit.plan: the compiled step's layout and costs, without running it."""

from __future__ import annotations

import pytest

import jaxlight as jl
from jaxlight import strategies
from tests.models import Classifier, classification_data


def quiet_fit(strategy):
    return jl.Fit(strategy=strategy, max_steps=2, enable_progress_bar=False,
                  enable_model_summary=False, logger=False, enable_checkpointing=False)


@pytest.fixture(scope="module")
def plans():
    batch = classification_data(32)
    out = {}
    for name, strategy in (("dp", strategies.DataParallel()),
                           ("fsdp", strategies.FSDP(min_shard_size=16)),
                           ("ddp", strategies.DDP())):
        fit = quiet_fit(strategy)
        out[name] = (fit, fit.plan(Classifier(din=16, hidden=32), batch, verbose=False))
    return out


def test_plan_compiles_without_running(plans):
    fit, plan = plans["dp"]
    assert fit.state is None and fit.compile_counts == {"train": 1}
    assert fit.compiled_train_step is None  # a later fit compiles for its own batches
    assert plan.param_bytes == (16 * 32 + 32 + 32 * 4 + 4) * 4
    assert plan.memory["argument"] > 0 and plan.memory["temp"] >= 0
    assert "all-reduce" in plan.table() and "per device" in plan.table()
    assert plan.to_dict()["collective_totals"]["all-reduce"]["count"] >= 1


def test_data_parallel_all_reduces_every_gradient(plans):
    for name in ("dp", "ddp"):
        plan = plans[name][1]
        assert plan.param_bytes_per_device == plan.param_bytes
        # gradients (all parameters) plus the two scalar metrics, in f32
        assert plan.collective_totals["all-reduce"]["buffer_bytes"] == plan.param_bytes + 8
        assert plan.collective_totals["all-gather"]["count"] == 0


def test_fsdp_plan_shards_parameters(plans):
    plan = plans["fsdp"][1]
    by_path = {p.path: p for p in plan.params}
    kernel = by_path["['l1']['kernel']"]
    assert kernel.spec == "P(None, 'fsdp')" and kernel.bytes_per_device == kernel.bytes // 8
    assert by_path["['l2']['bias']"].spec == "replicated"
    assert plan.param_bytes_per_device < plan.param_bytes / 4
    assert plan.collective_totals["all-gather"]["count"] >= 2


def test_plan_then_fit_trains(plans):
    fit, _ = plans["dp"]
    module = Classifier(din=16, hidden=32)
    fit.fit(module, [classification_data(32)] * 2)
    assert fit.global_step == 2
