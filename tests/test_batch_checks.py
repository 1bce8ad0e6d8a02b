"""A batch that changes mid-run is refused with the leaf, both values and where it came from
(issue 17 item 6: a dtype change used to fail as JAX's 'different enable_x64 mode' TypeError)."""

import numpy as np
import pytest

import jaxlight as jl
from tests.models import Classifier, classification_data


def _fit(strategy="single", **kw):
    return jl.Fit(strategy, max_steps=3, enable_progress_bar=False, enable_model_summary=False,
                  logger=False, enable_checkpointing=False, **kw)


def _batches(key, dtype):
    data = classification_data(64)
    first = {"x": data["x"][:32], "y": data["y"][:32]}
    second = {"x": data["x"][32:], "y": data["y"][32:]}
    second[key] = second[key].astype(dtype)
    return [first, second, first]


@pytest.mark.parametrize("strategy, key, dtype, compiled", [
    ("single", "x", np.float16, "float32"),
    ("single", "y", np.float32, "int32"),
    ("fsdp", "y", np.uint8, "int32"),
])
def test_dtype_change_mid_run_is_a_data_error(strategy, key, dtype, compiled):
    got = np.dtype(dtype).name
    with pytest.raises(jl.DataError, match=(
            rf"training batch 1 of epoch 0 has leaf \['{key}'\] of dtype {got}, but the step was "
            rf"compiled for dtype {compiled} \(from training batch 0 of epoch 0\)\. .*"
            rf"astype\(np\.{compiled}\)")):
        _fit(strategy).fit(Classifier(), _batches(key, dtype))


def test_dtype_change_in_later_epoch_names_the_epoch():
    data = classification_data(64)
    first = {"x": data["x"][:32], "y": data["y"][:32]}

    class Epochs:
        def __init__(self):
            self.epoch = 0

        def __iter__(self):
            dtype = np.float32 if self.epoch == 0 else np.float16
            self.epoch += 1
            yield {"x": first["x"].astype(dtype), "y": first["y"]}
            yield dict(first)

    with pytest.raises(jl.DataError, match=r"training batch 0 of epoch 1 has leaf \['x'\] of "
                                           r"dtype float16.*from training batch 0 of epoch 0"):
        jl.Fit("single", max_epochs=3, enable_progress_bar=False, enable_model_summary=False,
               logger=False, enable_checkpointing=False).fit(Classifier(), Epochs())


def test_float64_after_float32_is_not_a_change():
    """Without x64, JAX runs float64 input as float32: the compiled step takes it as it is."""
    fit = _fit()
    fit.fit(Classifier(), _batches("x", np.float64))
    assert fit.compile_counts["train"] == 1


def test_shape_change_names_the_leaf():
    batches = _batches("x", np.float32)
    # Only x shrinks: not a partial batch (which trains, see tests/data/test_dataloader.py).
    batches[1] = dict(batches[1], x=batches[1]["x"][:16])
    with pytest.raises(jl.DataError, match=r"training batch 1 of epoch 0 has leaf \['x'\] of shape "
                                           r"\(16, 16\), but the step was compiled for shape "
                                           r"\(32, 16\) \(from training batch 0 of epoch 0\)"):
        _fit().fit(Classifier(), batches)
