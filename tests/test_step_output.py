"""What a user step may return, and the message for what it may not (issue 17 item 7)."""

import jax.numpy as jnp
import pytest

import jaxlight as jl
from tests.models import Classifier, classification_data


def _fit():
    return jl.Fit("single", max_steps=2, enable_progress_bar=False, enable_model_summary=False,
                  logger=False, enable_checkpointing=False)


@pytest.mark.parametrize("bad, match", [
    (lambda loss, acc: (loss, [acc]),
     r"training_step returned \(loss, list\): the second element must be a dict of scalar "
     r"metrics.*got a list of 1 element.*\{'accuracy': acc\}"),
    (lambda loss, acc: (loss, 3.0),
     r"training_step returned \(loss, float\): the second element must be a dict of scalar "
     r"metrics.*got the float 3\.0"),
    (lambda loss, acc: (loss, acc),
     r"training_step returned \(loss, array\).*got an array of shape \(\) and dtype float32"),
    (lambda loss, acc: (loss, ("acc", acc)),
     r"training_step returned \(loss, tuple\).*got a tuple of 2 elements"),
])
def test_training_step_output_names_the_metrics_type(bad, match):
    class Bad(Classifier):
        def training_step(self, model, batch):
            loss, metrics = super().training_step(model, batch)
            return bad(loss, metrics["accuracy"])

    data = classification_data(64)
    with pytest.raises(jl.StepOutputError, match=match):
        _fit().fit(Bad(), jl.data.ArrayLoader(data, 32))


def test_training_step_pair_as_list_is_accepted_as_before():
    """(loss, metrics) as a list keeps working: only its content is checked."""
    class AsList(Classifier):
        def training_step(self, model, batch):
            loss, metrics = super().training_step(model, batch)
            return [loss, metrics]

    data = classification_data(64)
    fit = _fit()
    fit.fit(AsList(), jl.data.ArrayLoader(data, 32))
    assert jnp.isfinite(fit.callback_metrics["loss"])
