"""A misspelt validation `monitor` is reported by the sanity check, before any training step.

Lightning 2.6.6 skips EarlyStopping's and ModelCheckpoint's checks while sanity checking and
raises after the first epoch's validation; jaxlight reported it there too, after a whole epoch,
though the sanity check had already computed every validation metric's name (validation's
names are those of the compiled validation step, the same in the sanity check).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxlight as jl
from jaxlight import callbacks
from tests.models import Linear


def _fit(monitor_cb):
    trained = []
    fit = jl.Fit("single", max_epochs=2, enable_progress_bar=False, logger=False,
                 enable_model_summary=False, callbacks=[monitor_cb, callbacks.LambdaCallback(
                     on_train_batch_end=lambda *a: trained.append(1))])
    data = jl.data.DataLoader({"x": np.ones((32, 4), np.float32)}, 16)
    with pytest.raises(jl.ConfigurationError) as info:
        fit.fit(Linear(), data, data)
    return str(info.value), trained


@pytest.mark.parametrize("make", [lambda: callbacks.EarlyStopping("val_los"),
                                  lambda: callbacks.ModelCheckpoint("ck", monitor="val_los")])
def test_a_misspelt_validation_monitor_stops_the_fit_before_training(make):
    message, trained = _fit(make())
    assert not trained
    assert "monitor='val_los'" in message and "sanity check before training" in message
    assert "['val_loss']" in message and "Did you mean 'val_loss'" in message


def test_a_correct_monitor_and_a_training_metric_pass_the_sanity_check():
    fit = jl.Fit("single", max_epochs=1, enable_progress_bar=False, logger=False,
                 enable_model_summary=False, enable_checkpointing=False,
                 callbacks=[callbacks.EarlyStopping("val_loss"), callbacks.EarlyStopping("loss")])
    data = jl.data.DataLoader({"x": np.ones((32, 4), np.float32)}, 16)
    fit.fit(Linear(), data, data)
    assert fit.global_step == 2
