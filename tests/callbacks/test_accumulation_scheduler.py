"""GradientAccumulationScheduler's arguments and refusals (tests/conformance/test_callbacks3.py
compares its schedule with Lightning's and resumes it)."""

from __future__ import annotations

import pytest

import jaxlight as jl
from jaxlight import callbacks


@pytest.mark.parametrize("scheduling, match", [
    ({}, "non-empty dict"),
    ({-1: 2}, "epochs should be integers >= 0"),
    ({"1": 2}, "epochs should be integers >= 0"),
    ({1: 0}, "integers > 0"),
    ({1: 1.5}, "integers > 0"),
])
def test_scheduling_is_checked(scheduling, match):
    with pytest.raises(jl.ConfigurationError, match=match):
        callbacks.GradientAccumulationScheduler(scheduling)


def test_epochs_before_the_first_key_accumulate_one_batch():
    acc = callbacks.GradientAccumulationScheduler({2: 4, 5: 2})
    assert [acc.batches_at(e) for e in range(7)] == [1, 1, 4, 4, 4, 2, 2]


def test_with_accumulate_grad_batches_is_refused():
    with pytest.raises(jl.ConfigurationError, match="both set the same thing"):
        jl.Fit(max_epochs=1, accumulate_grad_batches=2,
               callbacks=[callbacks.GradientAccumulationScheduler({1: 2})])
