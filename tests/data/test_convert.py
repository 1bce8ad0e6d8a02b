"""Torch and Hugging Face data work unchanged: converted to NumPy without copies.

torch and datasets are not jaxlight dependencies: their tests skip when they are not installed.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import jaxlight as jl
from tests.checkpoint._common import BATCH, EXAMPLES, assert_bitwise, make_fit, params_of
from tests.models import Classifier, classification_data

STEPS = 10  # 8 batches per epoch: crosses an epoch


def _address(a) -> int:
    return a.__array_interface__["data"][0]


def _numpy_batches():
    data = classification_data(EXAMPLES)
    return [{k: v[i:i + BATCH] for k, v in data.items()} for i in range(0, EXAMPLES, BATCH)]


def _trained(data, **kw):
    module = Classifier()
    make_fit("dp", STEPS, **kw).fit(module, data)
    return params_of(module.model)


def test_numpy_batches_pass_through_untouched():
    batch = {"x": np.ones(3), "n": 2}
    assert jl.data.to_numpy(batch) is batch


def test_torch_tensors_become_numpy_views_of_the_same_memory():
    torch = pytest.importorskip("torch")
    import ml_dtypes

    t = torch.arange(12, dtype=torch.float32, requires_grad=True).reshape(3, 4)
    bf = torch.linspace(-2, 2, 6, dtype=torch.bfloat16)
    out = jl.data.to_numpy({"t": t, "bf": bf, "np": np.zeros(2)})
    assert out["t"].dtype == np.float32 and _address(out["t"]) == t.data_ptr()
    np.testing.assert_array_equal(out["t"], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert out["bf"].dtype == ml_dtypes.bfloat16 and _address(out["bf"]) == bf.data_ptr()
    np.testing.assert_array_equal(out["bf"].astype(np.float32), bf.float().numpy())


def test_a_torch_dataloader_trains_like_the_numpy_batches():
    torch = pytest.importorskip("torch")
    data = classification_data(EXAMPLES)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(data["x"]),
                                             torch.from_numpy(data["y"]))
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=False)
    as_dicts = ({"x": x, "y": y} for x, y in loader)
    assert_bitwise(_trained([b for b in as_dicts]), _trained(_numpy_batches()))

    class DictBatches(torch.utils.data.Dataset):  # what a torch user's Dataset returns
        def __len__(self):
            return EXAMPLES

        def __getitem__(self, i):
            return {"x": torch.from_numpy(data["x"][i]), "y": torch.tensor(data["y"][i])}

    dicts = torch.utils.data.DataLoader(DictBatches(), batch_size=BATCH)
    got = _trained(dicts, val_check_interval=4)
    assert_bitwise(got, _trained(_numpy_batches()))
    # Evaluation converts too.
    fit = make_fit("dp", 1)
    module = Classifier()
    fit.fit(module, _numpy_batches())
    assert fit.validate(module, dicts) == fit.validate(module, _numpy_batches())


@pytest.mark.slow  # imports `datasets` (seconds); the fast tier converts NumPy and torch batches
def test_a_hugging_face_dataset_in_numpy_format():
    datasets = pytest.importorskip("datasets")
    data = classification_data(EXAMPLES)
    ds = datasets.Dataset.from_dict(data).with_format("numpy")
    # ArrayLoader over the dataset's columns: shuffled, resumable, sharded per process.
    assert_bitwise(_trained(jl.data.ArrayLoader(ds, BATCH, seed=3)),
                   _trained(jl.data.ArrayLoader(data, BATCH, seed=3)))
    # The dataset's own batch iterator (numpy or torch format) as training data.
    batches = list(ds.iter(batch_size=BATCH, drop_last_batch=True))
    assert_bitwise(_trained(batches), _trained(_numpy_batches()))
    if importlib.util.find_spec("torch") is not None:
        torch_batches = list(ds.with_format("torch").iter(batch_size=BATCH))
        assert_bitwise(_trained(torch_batches), _trained(_numpy_batches()))
    with pytest.raises(jl.DataError, match=r"datasets.Dataset \(256 rows\): iterating it yields "
                                           r"one example at a time"):
        make_fit("dp", 1).fit(Classifier(), ds)
