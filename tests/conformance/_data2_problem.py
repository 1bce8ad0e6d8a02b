"""The `data2` group's problem, NumPy only (imported by both sides): a 4 -> 2 linear regression
over n examples, regenerated from a seed on each side (2,000 examples would make the fixture
~100 KB); the fixture records a checksum of the numbers Lightning trained on."""

from __future__ import annotations

import numpy as np


def make_problem(n: int, seed: int = 0) -> dict:
    """Initial weights (flax layout: kernel is inputs x outputs) and n examples, as float32."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.normal(size=(n, 4)), 4)
    y = np.round(x @ rng.normal(size=(4, 2)) + 0.3 * rng.normal(size=(n, 2)), 4)
    kernel = np.round(rng.normal(size=(4, 2)) * 0.5, 4)
    bias = np.round(rng.normal(size=2) * 0.1, 4)
    return {k: np.asarray(v, np.float32) for k, v in
            {"kernel": kernel, "bias": bias, "x": x, "y": y}.items()}


def checksum(prob: dict) -> list[float]:
    """Sums of each array (float64), to prove both sides regenerated the same numbers."""
    return [float(np.asarray(prob[k], np.float64).sum()) for k in ("kernel", "bias", "x", "y")]
