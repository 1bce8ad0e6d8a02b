"""Errors in user steps name the step, the data and the batch (issue 17 item 5)."""

import pytest

import jaxlight as jl
from tests.models import Classifier, classification_data

BATCH = 32


def _fit(**kw):
    kw.setdefault("max_steps", 8)
    return jl.Fit("single", enable_progress_bar=False, enable_model_summary=False,
                  logger=False, enable_checkpointing=False, **kw)


@pytest.fixture(scope="module")
def data():
    return classification_data(256)


def test_validation_step_error_names_the_batch(data):
    fit = _fit(max_steps=50, val_check_interval=3, num_sanity_val_steps=0)
    val = {"x": data["x"][:64]}
    with pytest.raises(jl.UserStepError, match=(
            r"validation_step raised KeyError: 'y' .* on validation batch 0 \(validation at "
            r"step 3\) of val_data")):
        fit.fit(Classifier(), jl.data.ArrayLoader(data, BATCH),
                jl.data.ArrayLoader(val, BATCH, shuffle=False))
    assert fit.global_step == 3


def test_training_step_error_names_the_training_batch(data):
    class Wrong(Classifier):
        def training_step(self, model, batch):
            return super().training_step(model, {"x": batch["x"], "y": batch["label"]})

    with pytest.raises(jl.UserStepError, match=(
            r"Wrong\.training_step raised KeyError: 'label' while jaxlight traced it on "
            r"training batch 0 of epoch 0 of train_data, a batch \{\['x'\]: \(32, 16\) float32, "
            r"\['y'\]: \(32,\) int32\}")) as info:
        _fit().fit(Wrong(), jl.data.ArrayLoader(data, BATCH))
    assert isinstance(info.value.__cause__, KeyError)


def test_jaxlight_errors_in_steps_pass_through_unwrapped(data):
    class Bad(Classifier):
        def training_step(self, model, batch):
            loss, _ = super().training_step(model, batch)
            return loss, [loss]

    with pytest.raises(jl.StepOutputError):
        _fit().fit(Bad(), jl.data.ArrayLoader(data, BATCH))


def test_validate_and_predict_errors_name_the_entry_point(data):
    class NoPredict(Classifier):
        def predict_step(self, model, batch):
            return model(batch["image"])

    val = jl.data.ArrayLoader({"x": data["x"][:64]}, BATCH, shuffle=False)
    fit = _fit()
    with pytest.raises(jl.UserStepError, match=r"validation batch 0 \(Fit\.validate\) of the "
                                               r"data passed to Fit\.validate"):
        fit.validate(Classifier(), val)
    with pytest.raises(jl.UserStepError, match=r"NoPredict\.predict_step raised KeyError: "
                                               r"'image'.*predict batch 0 of the data passed to "
                                               r"Fit\.predict"):
        fit.predict(NoPredict(), val)
