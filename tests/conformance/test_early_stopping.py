"""EarlyStopping stops after the same epoch, with the same stopped_epoch, wait count and best
score, for patience / min_delta / mode / check_on_train_epoch_end / stopping_threshold /
divergence_threshold; the monitored values are given by the data (one value an epoch)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxlight import callbacks
from tests.conformance._cases import case, claim, covers, fixture
from tests.conformance._jaxlight import Passes, Reg, batches, make_fit

G = "early_stopping"
CASES = sorted(fixture(G)["cases"])


@pytest.mark.parametrize("name", CASES)
@claim("EarlyStopping(patience, min_delta, mode, check_on_train_epoch_end, stopping_threshold, "
       "divergence_threshold) stops after Lightning's epoch with its stopped_epoch, wait_count "
       "and best_score")
@covers("EarlyStopping(monitor)",
        "EarlyStopping(patience)",
        "EarlyStopping(min_delta)",
        "EarlyStopping(mode)",
        "EarlyStopping(stopping_threshold)",
        "EarlyStopping(divergence_threshold)",
        "EarlyStopping(check_on_train_epoch_end)")
def test_early_stopping(name):
    expected = case(G, name)
    values = expected["values"]
    x = fixture(G)["problem"]["val"]["x"][:4]
    stop = callbacks.EarlyStopping(monitor=expected["monitor"], **expected["kwargs"])
    if expected["monitor"] == "train_score":
        fit = make_fit(max_epochs=len(values), callbacks=[stop])
        fit.fit(Reg(G), Passes(values, x))
    else:
        fit = make_fit(max_epochs=len(values), callbacks=[stop], limit_train_batches=1)
        fit.fit(Reg(G), batches(G), Passes(values, x))
    assert fit.global_step == expected["global_step"]
    assert stop.wait_count == expected["wait_count"]
    assert stop.stopped_epoch == expected["stopped_epoch"]
    np.testing.assert_allclose(stop.best_score, expected["best_score"], rtol=1e-6)
