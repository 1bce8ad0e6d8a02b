"""The tuner's real parts: the batch-size search on compiled steps' memory analysis, the
finders inside a fit, the plot, and the errors a user can hit (the sweep under data
parallelism, Lightning's sequences and suggestions: tests/conformance/test_tuner.py)."""

from __future__ import annotations

import functools

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.callbacks._batch_size_finder import step_bytes
from jaxlight.callbacks._lr_finder import LRFinder


class MLP(jl.TrainModule):
    def __init__(self, lr=0.05, batch_size=2):
        super().__init__()
        self.lr, self.batch_size = lr, batch_size
        self.seen: list[int] = []

    def configure_model(self, rngs):
        return nnx.Sequential(nnx.Linear(16, 64, rngs=rngs), nnx.relu,
                              nnx.Linear(64, 4, rngs=rngs))

    def configure_optimizers(self):
        return optax.sgd(self.lr)

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


class Data(jl.DataModule):
    def __init__(self, n=512, batch_size=2):
        super().__init__()
        self.n, self.batch_size = n, batch_size

    def setup(self, stage):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(self.n, 16)).astype(np.float32)
        self.y = rng.normal(size=(self.n, 4)).astype(np.float32)

    def train_dataloader(self):
        return jl.data.DataLoader({"x": self.x, "y": self.y}, self.batch_size)


class Shapes(callbacks.Callback):
    def __init__(self):
        self.rows = []

    def on_train_batch_start(self, fit, module, batch, batch_idx):
        self.rows.append(batch["x"].shape[0])


def _fit(strategy="single", **kw):
    # The default checkpoint's saves only where a test gives a ModelCheckpoint.
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, callbacks.ModelCheckpoint) for cb in kw.get("callbacks", ())))
    return jl.Fit(strategy, enable_progress_bar=False, logger=False, enable_model_summary=False,
                  **kw)


@functools.cache
def _bytes_at(rows):
    dm = Data()
    dm.setup("fit")
    batch = {"x": dm.x[:rows], "y": dm.y[:rows]}
    return step_bytes(_fit(max_steps=1).plan(MLP(), batch, verbose=False).memory)


def test_scale_batch_size_reads_the_compiled_steps_memory():
    # The limit lies between the step's bytes at 8 and at 16 examples: power mode ends at 8.
    at8, at16 = _bytes_at(8), _bytes_at(16)
    assert at8 < at16
    dm, module = Data(), MLP()
    found = jl.Tuner(_fit(max_steps=1)).scale_batch_size(
        module, datamodule=dm, init_val=4, memory_limit=(at8 + at16) // 2,
        batch_arg_name="batch_size")
    assert found == 8
    # Lightning's lightning_setattr: every holder (module, datamodule, their hparams) is set
    assert module.batch_size == dm.batch_size == 8
    assert module.hparams["batch_size"] == dm.hparams["batch_size"] == 8
    with pytest.raises(jl.JaxlightError, match="not built yet"):
        _ = module.model  # nothing ran, no model kept


def test_batch_size_finder_callback_sizes_the_fits_loader():
    finder = callbacks.BatchSizeFinder(init_val=4, memory_limit=(_bytes_at(8) + _bytes_at(16))
                                       // 2)
    shapes = Shapes()
    dm = Data()
    fit = _fit(max_steps=2, callbacks=[finder, shapes])
    fit.fit(MLP(batch_size=None), datamodule=dm)  # the datamodule holds the attribute
    # power: 4 and 8 fit, 16 does not (each compiled, none run): 8
    assert finder.trials == [(4, finder.trials[0][1]), (8, _bytes_at(8)), (16, _bytes_at(16))]
    assert finder.optimal_batch_size == 8 and dm.batch_size == 8
    assert shapes.rows == [8, 8]


class NoRate(MLP):
    def __init__(self):
        super().__init__()
        del self.lr

    def configure_optimizers(self):
        return optax.sgd(0.1)


class IgnoresRate(MLP):
    def configure_optimizers(self):
        return optax.sgd(0.1)


@pytest.mark.parametrize("module, match", [
    (NoRate(), "has no numeric 'lr' or 'learning_rate'"),
    (IgnoresRate(), "does not read it"),
])
def test_lr_find_refuses_a_module_whose_rate_it_cannot_set(module, match):
    data = {"x": np.zeros((8, 16), np.float32), "y": np.zeros((8, 4), np.float32)}
    with pytest.raises(jl.ConfigurationError, match=match):
        jl.Tuner(_fit(max_steps=1)).lr_find(module, jl.data.DataLoader(data, 4))


def test_finder_errors():
    with pytest.raises(jl.ConfigurationError, match="batch_arg_name"):
        jl.Tuner(_fit(max_steps=1)).scale_batch_size(MLP(), datamodule=Data(),
                                                     batch_arg_name="bs")
    with pytest.raises(jl.DataError, match=r"cannot try a batch of 2 under dp: .*not divisible "
                       r"by the data-parallel degree 8.* give init_val a multiple"):
        jl.Tuner(_fit("dp", max_steps=1)).scale_batch_size(MLP(), datamodule=Data())
    with pytest.raises(jl.ConfigurationError, match="mode='lin'"):
        callbacks.LearningRateFinder(mode="lin")
    with pytest.raises(jl.ConfigurationError, match="'power' or 'binsearch'"):
        callbacks.BatchSizeFinder(mode="double")
    with pytest.raises(jl.ConfigurationError, match="method='fit'"):
        jl.Tuner(_fit(max_steps=1)).lr_find(MLP(), method="validate")


def test_lr_finder_plot_marks_the_suggestion():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    found = LRFinder("exponential", 1e-4, 1.0, 30)
    lrs = list(np.geomspace(1e-4, 1.0, 30))
    losses = list(np.concatenate([np.linspace(2.0, 0.5, 20), np.linspace(0.6, 3.0, 10)]))
    found.results = {"lr": lrs, "loss": losses}
    fig = found.plot(suggest=True)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    curve, marker = ax.lines
    assert list(curve.get_xdata()) == lrs
    assert list(marker.get_xdata()) == [found.suggestion()] and marker.get_color() == "red"
