"""An `ArrayLoader` left at training's defaults (shuffle, drop the last partial batch), given as
validation, test or prediction data, is read whole and in order: Lightning's validation loader
sees every row, and so must jaxlight's exact evaluation (it saw 64 of 90 rows, silently)."""

from __future__ import annotations

import numpy as np
import pytest

import jaxlight as jl
from jaxlight import callbacks
from tests.models import Linear

rng = np.random.default_rng(0)
TRAIN = {"x": rng.normal(size=(64, 4)).astype(np.float32)}
VAL = {"x": rng.normal(size=(90, 4)).astype(np.float32)}


def _expected(module):
    return float(((np.asarray(module.model(VAL["x"])) - 1.0) ** 2).mean())


def test_validation_test_and_predict_see_every_row():
    batches = []
    count = callbacks.LambdaCallback(
        on_validation_batch_end=lambda fit, module, batch, idx: batches.append(
            len(batch["x"])))
    fit = jl.Fit("single", max_epochs=1, enable_progress_bar=False, logger=False,
                 enable_model_summary=False, enable_checkpointing=False,
                 num_sanity_val_steps=0, callbacks=[count])
    module = Linear(lr=0.01)
    val = jl.data.ArrayLoader(VAL, 32)
    fit.fit(module, jl.data.ArrayLoader(TRAIN, 32), val)
    assert batches == [32, 32, 26]
    assert fit.callback_metrics["val_loss"] == pytest.approx(_expected(module), rel=1e-5)
    assert fit.test(module, val)["test_loss"] == pytest.approx(_expected(module), rel=1e-5)
    predicted = np.concatenate(fit.predict(module, val))
    np.testing.assert_allclose(predicted, np.asarray(module.model(VAL["x"])), rtol=1e-5)


def test_explicit_choices_are_kept():
    loader = jl.data.ArrayLoader(VAL, 32, drop_remainder=True, shuffle=False)
    assert len(loader.for_evaluation()) == 2
    assert len(jl.data.ArrayLoader(VAL, 32).for_evaluation()) == 3
    # The training loader's own settings and position are untouched.
    train = jl.data.ArrayLoader(VAL, 32)
    view = train.for_evaluation()
    list(view)
    assert train.drop_remainder and train.shuffle and train.state_dict()["epoch"] == 0
