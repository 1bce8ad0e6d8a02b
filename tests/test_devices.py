"""Fit(devices=N | list): a fit uses the chosen devices, the rest stay idle (issue 15 item 9)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxlight as jl
from jaxlight import strategies
from tests.callbacks.test_step_transforms import Net, _batches
from tests.strategies.test_gpipe import _Regression, _regression_data


def _devices_used(fit) -> set[int]:
    return {d.id for x in jax.tree.leaves(fit.state) for d in x.devices()}


def _train(strategy, devices, module=None, data=None, steps=2):
    fit = jl.Fit(strategy, devices=devices, max_steps=steps, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, enable_checkpointing=False)
    fit.fit(module or Net(), data or _batches(steps))
    return fit


CASES = {
    "single": (lambda: "single", [3], {3}),
    "ddp": (lambda: "ddp", 4, {0, 1, 2, 3}),
    "dp": (lambda: "dp", [4, 5, 6, 7], {4, 5, 6, 7}),
    "fsdp": (lambda: "fsdp", 2, {0, 1}),
    "tp": (lambda: strategies.TensorParallel(2), [2, 3, 6, 7], {2, 3, 6, 7}),
    "hybrid": (lambda: strategies.Hybrid({"data": 2, "fsdp": 2}), 4, {0, 1, 2, 3}),
    "auto": (lambda: "auto", [1, 2], {1, 2}),
}


#: Cases the whole suite runs and the fast tier leaves out: the fast tier keeps devices given as a
#: number and as a list under one-device, data-parallel and sharded strategies (the selection is
#: the same code for every strategy: `Strategy.setup(devices)` builds the mesh from them).
SLOW_CASES = {"tp", "hybrid", "auto"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES
                                  else c for c in CASES])
def test_every_strategy_runs_on_the_chosen_devices_only(case):
    make, devices, used = CASES[case]
    fit = _train(make(), devices)
    assert _devices_used(fit) == used
    assert {d.id for d in fit.strategy.mesh.devices.flat} == used


@pytest.mark.slow  # a pipeline's stages on a device subset; the fast tier: the cases above
def test_gpipe_on_four_of_eight_devices():
    fit = _train(strategies.GPipe(stages=2, microbatches=4), [4, 5, 6, 7], _Regression(layers=2),
                 _regression_data(2, 16))
    assert _devices_used(fit) == {4, 5, 6, 7}


def test_a_subset_matches_all_devices():
    everything = _train("dp", None, steps=3)
    subset = _train("dp", 2, steps=3)
    for a, b in zip(jax.tree.leaves(jax.device_get(subset.state.params)),
                    jax.tree.leaves(jax.device_get(everything.state.params)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("devices", "match"), [
    (9, r"Fit\(devices=9\) asks for 9 devices, but this process has 8 cpu devices \(ids "
        r"\[0, 1, 2, 3, 4, 5, 6, 7\]\). Pass devices <= 8"),
    (0, r"Fit\(devices=0\): give a positive number of devices \(1 to 8\)"),
    ([1, 8, 9], r"indices \[8, 9\] are out of range; this process has 8 cpu devices, indices 0 "
                r"to 7"),
    ([1, 1], r"names a device more than once"),
    ("gpu", r"Fit\(devices='gpu'\): give a number of devices \(1 to 8\)"),
])
def test_bad_devices_are_refused_with_numbers(devices, match):
    with pytest.raises(jl.ConfigurationError, match=match):
        jl.Fit("dp", devices=devices, max_steps=1)


def test_conflicting_choices_are_refused():
    with pytest.raises(jl.ConfigurationError, match=r"selects 2 devices, but the strategy is "
                                                     r"SingleDevice"):
        jl.Fit("single", devices=2, max_steps=1)
    with pytest.raises(jl.ConfigurationError, match=r"selects devices \[0, 1\], but the "
                                                     r"strategy DataParallel was built with "
                                                     r"devices \[2, 3\]"):
        jl.Fit(strategies.DataParallel(devices=jax.devices()[2:4]), devices=2, max_steps=1)
    for same in ("auto", -1, None):
        assert jl.Fit("dp", devices=same, max_steps=1).config["devices"] is None
