"""jaxlight.data.DataLoader (torch's defaults) and training on a last partial batch."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl


class Lin(jl.TrainModule):
    def configure_model(self, rngs):
        return nnx.Linear(4, 2, rngs=rngs)

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _data(n):
    rng = np.random.default_rng(0)
    return {"x": rng.normal(size=(n, 4)).astype(np.float32),
            "y": rng.normal(size=(n, 2)).astype(np.float32)}


def _fit(strategy, **kw):
    return jl.Fit(strategy, enable_progress_bar=False, logger=False, enable_model_summary=False,
                  enable_checkpointing=False, **kw)


def test_defaults_are_torchs():
    loader = jl.data.DataLoader({"x": np.arange(5)}, batch_size=2)
    assert [b["x"].tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    assert len(loader) == 3 and not loader.shuffle and not loader.drop_last
    assert len(jl.data.DataLoader({"x": np.arange(5)}, 2, drop_last=True)) == 2
    # torch's worker arguments mean nothing here and are accepted; a collate_fn is refused.
    jl.data.DataLoader({"x": np.arange(5)}, 2, num_workers=4, pin_memory=True)
    with pytest.raises(jl.ConfigurationError, match="collate_fn"):
        jl.data.DataLoader({"x": np.arange(5)}, 2, collate_fn=lambda b: b)
    with pytest.raises(jl.ConfigurationError, match="unknown argument 'shufle'"):
        jl.data.DataLoader({"x": np.arange(5)}, 2, shufle=True)


@pytest.mark.slow
def test_partial_batch_trains_under_every_strategy_as_on_one_device():
    """104 examples in batches of 32: 3 full batches and one of 8 per epoch, 8 steps in 2
    epochs; the partial batch has one more compiled step, and every layout reproduces the
    single-device weights."""
    data = _data(104)
    weights = {}
    for strategy in ("single", "fsdp", "ddp"):
        fit = _fit(strategy, max_epochs=2)
        module = Lin()
        fit.fit(module, jl.data.DataLoader(data, batch_size=32))
        assert fit.global_step == 8
        assert fit.compile_counts["train"] == 1 and fit.compile_counts["train_partial"] == 1
        weights[strategy] = np.asarray(module.model.kernel[...])
    kernel = weights["single"]  # tests/conformance/test_data2.py checks it against Lightning
    for strategy in ("fsdp", "ddp"):
        np.testing.assert_allclose(weights[strategy], kernel, rtol=1e-5, atol=1e-6)
    dropped = _fit("single", max_epochs=2)
    module = Lin()
    dropped.fit(module, jl.data.DataLoader(data, batch_size=32, drop_last=True))
    assert dropped.global_step == 6 and "train_partial" not in dropped.compile_counts
    assert not np.allclose(np.asarray(module.model.kernel[...]), kernel)


def test_partial_batch_the_strategy_cannot_split_names_the_sizes():
    with pytest.raises(jl.DataError, match=r"training batch 3 of epoch 0 is a partial batch of "
                                           r"4 examples \(full batches have 32\).*data-parallel "
                                           r"degree 8.*drop_last=True"):
        _fit("dp", max_epochs=1).fit(Lin(), jl.data.DataLoader(_data(100), batch_size=32))
    # accumulate_grad_batches=k stacks k loader batches into one step: a partial one cannot join.
    with pytest.raises(jl.DataError, match=r"training batch 2 of epoch 0 is a partial batch of 8 "
                                           r"examples \(full batches have 48\).*"
                                           r"accumulate_grad_batches=3.*drop_last=True"):
        _fit("single", max_epochs=1, accumulate_grad_batches=3).fit(
            Lin(), jl.data.DataLoader(_data(104), batch_size=48))


def test_a_second_partial_size_is_refused():
    data = _data(48)
    batches = [{k: v[:32] for k, v in data.items()}, {k: v[32:40] for k, v in data.items()},
               {k: v[40:44] for k, v in data.items()}]
    with pytest.raises(jl.DataError, match=r"training batch 2 of epoch 0 has 4 examples, a "
                                           r"second partial batch size after 8"):
        _fit("single", max_epochs=1).fit(Lin(), batches)


class _Stream:
    """An iterable of examples with no length or indexing, as torch's IterableDataset."""

    def __iter__(self):
        for i in range(40):
            yield {"x": np.full(3, i, np.float32), "y": np.int32(i % 2)}


def test_an_iterable_dataset_is_refused_with_the_forms_that_work():
    """DataLoader(iterable_dataset, batch_size=16) raised a bare IndexError (issue 46 item 5)."""
    with pytest.raises(jl.DataError, match=r"DataLoader holds arrays in memory and got a "
                       r"_Stream, an iterable of examples.*np\.stack.*whole batches.*Grain"):
        jl.data.DataLoader(_Stream(), batch_size=16)
    with pytest.raises(jl.DataError, match=r"got a generator"):
        jl.data.DataLoader(iter(_Stream()), batch_size=16)
    # The form the message gives works.
    examples = list(_Stream())
    arrays = jax.tree.map(lambda *xs: np.stack(xs), *examples)
    batches = list(jl.data.DataLoader(arrays, batch_size=16))
    assert [len(b["y"]) for b in batches] == [16, 16, 8]
    np.testing.assert_array_equal(batches[0]["x"][:, 0], np.arange(16))


def test_a_scalar_leaf_is_refused_naming_it():
    with pytest.raises(jl.DataError, match=r"need a first dimension.*\['y'\] has none"):
        jl.data.DataLoader({"x": np.ones((4, 2)), "y": 3}, batch_size=2)
