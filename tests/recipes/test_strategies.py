"""Every recipe trains under every strategy on 8 simulated devices, unchanged.

Each run takes 2 steps of a small variant; the logged losses must agree with SingleDevice's to
1e-4 relative (the tolerance of the strategy-equivalence tests), which shows the recipe's model
is laid out and reduced correctly, not merely that it runs.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxlight.callbacks import Callback
from tests.recipes._small import STRATEGIES, quiet_fit, small

STEPS = 2
RTOL = 1e-4


class _Losses(Callback):
    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_log(self, fit, module, metrics, step):
        if "loss" in metrics:
            self.losses[step] = metrics["loss"]


def _run(recipe: str, strategy: str) -> np.ndarray:
    mod, config = small(recipe)
    module, data = mod.build(config, STEPS)
    recorder = _Losses()
    fit = quiet_fit(STRATEGIES[strategy](), max_steps=STEPS, log_every_n_steps=1,
                    callbacks=[recorder])
    fit.fit(module, data.train)
    assert fit.global_step == STEPS
    assert fit.compile_counts["train"] == 1
    return np.array([recorder.losses[s] for s in range(1, STEPS + 1)])


_reference: dict[str, np.ndarray] = {}


def _single(recipe: str) -> np.ndarray:
    if recipe not in _reference:
        _reference[recipe] = _run(recipe, "single")
    return _reference[recipe]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("recipe", ["digits", "gpt", "sft"])
def test_recipe_trains_under_strategy(recipe, strategy):
    losses = _run(recipe, strategy) if strategy != "single" else _single(recipe)
    assert np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, _single(recipe), rtol=RTOL)
