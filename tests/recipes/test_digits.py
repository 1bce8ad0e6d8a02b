"""The digits recipe: the fixed split, and the accuracy `make demo` promises."""

from __future__ import annotations

import numpy as np
import pytest

from jaxlight.recipes import digits
from tests.recipes._small import quiet_fit


def test_split_is_fixed_and_disjoint():
    config = digits.DataConfig()
    a, b = digits.load_digits(config), digits.load_digits(config)
    for part in ("train", "val", "test"):
        np.testing.assert_array_equal(a[part]["x"], b[part]["x"])
    assert [len(a[p]["y"]) for p in ("train", "val", "test")] == [1297, 250, 250]
    rows = {p: {r.tobytes() for r in a[p]["x"]} for p in a}
    # sklearn's digits hold a few duplicate images; the split itself is by index, so overlap
    # between parts can only come from those, and is tiny.
    assert len(rows["train"] & rows["val"]) <= 2
    assert a["train"]["x"].min() >= 0.0 and a["train"]["x"].max() <= 1.0


@pytest.mark.slow
def test_reaches_95_percent_validation_accuracy_under_data_parallel():
    """`make demo`'s run: the recipe's defaults under DataParallel on 8 devices."""
    config = digits.Config()
    fit_defaults = digits.RECIPE.fit_defaults
    module, data = digits.build(config, fit_defaults["max_steps"])
    fit = quiet_fit("dp", **fit_defaults)
    fit.fit(module, data.train, data.val)
    assert fit.strategy.data_parallel_size == 8
    metrics = fit.validate(module, data.val)
    assert metrics["val_accuracy"] >= 0.95, metrics
    test = fit.test(module, data.test)
    assert test["test_accuracy"] >= 0.93, test
    predictions = np.concatenate(fit.predict(module, data.test))
    assert np.mean(predictions == np.asarray(data.test.arrays["y"])) == pytest.approx(
        test["test_accuracy"])


def test_bundled_digits_equal_scikit_learns():
    """The recipe reads its own copy (no sklearn import at start); it is sklearn's data."""
    datasets = pytest.importorskip("sklearn.datasets")
    ours = np.load(digits.DIGITS_FILE)
    theirs = datasets.load_digits()
    np.testing.assert_array_equal(ours["images"].astype(np.float64), theirs.data)
    np.testing.assert_array_equal(ours["labels"], theirs.target)
