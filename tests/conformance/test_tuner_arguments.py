"""The learning-rate finder's and the batch-size search's remaining arguments (Tuner.lr_find,
Tuner.scale_batch_size, BatchSizeFinder, LearningRateFinder), beside the `tuner` part of
lightning_side/arguments2.py (fixture arguments2.json)."""

from __future__ import annotations

import numpy as np
import optax

import jaxlight as jl
from jaxlight import callbacks
from tests.conformance._cases import case, claim, covers, departure
from tests.conformance._jaxlight import RTOL, Reg, batches, make_fit

G = "arguments2"
SECTION = "Differences the coverage cases pin"


# -- the learning-rate finder's and the batch-size search's remaining arguments -------------------


class Named(Reg):
    """lightning_side's: the rate as `learning_rate` (attr_name), a `bs` batch size."""

    def __init__(self, learning_rate=0.01, bs=2):
        super().__init__(G, lr=learning_rate)
        self.learning_rate, self.bs = learning_rate, bs

    def configure_optimizers(self):
        return optax.sgd(self.learning_rate)


class DM(jl.DataModule):
    def __init__(self, bs=2):
        super().__init__()
        self.bs = bs

    def train_dataloader(self):
        return batches(G, "train", self.bs)

    def val_dataloader(self):
        return batches(G, "val", 6)


def _tuner(**kw):
    return jl.Tuner(make_fit(**kw))


@claim("Tuner.lr_find(model, datamodule=..., attr_name='learning_rate', method='fit') sweeps the "
       "same rates with the same smoothed losses and sets module.learning_rate to the same "
       "suggestion; with train_dataloaders and val_dataloaders it suggests the same rate")
@covers("Tuner.lr_find(datamodule)", "Tuner.lr_find(attr_name)", "Tuner.lr_find(method)",
        "Tuner.lr_find(val_dataloaders)")
def test_lr_find_arguments():
    want = case(G, "tuner_arguments")
    module = Named()
    sweep = want["lr_find_datamodule"]["kwargs"]
    found = _tuner(max_epochs=5).lr_find(module, datamodule=DM(4), attr_name="learning_rate",
                                         method="fit", **sweep)
    got = want["lr_find_datamodule"]
    np.testing.assert_allclose(found.results["lr"], got["lrs"], rtol=RTOL)
    np.testing.assert_allclose(found.results["loss"], got["losses"], rtol=RTOL)
    np.testing.assert_allclose([found.suggestion(), module.learning_rate],
                               [got["suggestion"], got["module_lr"]], rtol=RTOL)
    found = _tuner(max_epochs=5).lr_find(Named(), train_dataloaders=batches(G, "train", 4),
                                         val_dataloaders=batches(G, "val"),
                                         attr_name="learning_rate", **sweep)
    np.testing.assert_allclose(found.suggestion(),
                               want["lr_find_val_dataloaders"]["suggestion"], rtol=RTOL)


def _refused(fn) -> bool:
    try:
        fn()
    except jl.JaxlightError:
        return True
    return False


def _refusals():
    tune = _tuner(max_epochs=1)
    return {
        "lr_find_method_validate": _refused(lambda: tune.lr_find(
            Named(), datamodule=DM(4), method="validate", attr_name="learning_rate",
            num_training=3)),
        "lr_find_dataloaders_in_fit": _refused(lambda: tune.lr_find(
            Named(), dataloaders=batches(G, "train", 4), attr_name="learning_rate",
            num_training=3)),
        "scale_batch_size_dataloaders_in_fit": _refused(lambda: tune.scale_batch_size(
            Named(), dataloaders=batches(G, "train", 4), batch_arg_name="bs", max_trials=1)),
        "scale_batch_size_train_dataloaders": _refused(lambda: tune.scale_batch_size(
            Named(), train_dataloaders=batches(G, "train", 4), batch_arg_name="bs",
            max_trials=1)),
        "scale_batch_size_val_dataloaders": _refused(lambda: tune.scale_batch_size(
            Named(), datamodule=DM(), val_dataloaders=batches(G, "val"), batch_arg_name="bs",
            max_trials=1)),
    }


@departure("the Tuner takes loaders where Lightning's refuses them: lr_find(dataloaders=...) "
           "with method='fit' (Lightning: MisconfigurationException, use train_dataloaders) and "
           "scale_batch_size with dataloaders / train_dataloaders / val_dataloaders given "
           "directly (Lightning: MisconfigurationException / ValueError: the size must reach a "
           "module's or DataModule's loader); method='validate' is refused by both",
           section=SECTION)
@covers("Tuner.lr_find(dataloaders)", "Tuner.scale_batch_size(dataloaders)",
        "Tuner.scale_batch_size(train_dataloaders)", "Tuner.scale_batch_size(val_dataloaders)",
        "Tuner.lr_find(method)")
def test_tuner_takes_loaders_lightning_refuses():
    want = {k: v is not None for k, v in case(G, "tuner_arguments")["refusals"].items()}
    assert all(want.values())
    assert _refusals() == {**{k: False for k in want}, "lr_find_method_validate": True}


@claim("when both the module and its DataModule have the batch_arg_name attribute, "
       "scale_batch_size and BatchSizeFinder set both (and the hparams naming it), as "
       "Lightning's lightning_setattr: the same size (8; 4 in the fit), and the fit trains "
       "Lightning's 8 steps at batch 4")
@covers("Tuner.scale_batch_size", "Tuner.scale_batch_size(model)",
        "Tuner.scale_batch_size(datamodule)", "Tuner.scale_batch_size(method)",
        "Tuner.scale_batch_size(batch_arg_name)", "BatchSizeFinder(batch_arg_name)")
def test_scale_batch_size_sets_the_module_and_the_datamodule():
    cases = case(G, "tuner_arguments")
    want = cases["scale_batch_size_datamodule"]
    dm, module = DM(), Named()
    size = _tuner(max_epochs=1).scale_batch_size(
        module, datamodule=dm, method="fit", mode="power", steps_per_trial=1, init_val=2,
        max_trials=3, batch_arg_name="bs")
    assert [size, module.bs, dm.bs] == [want["size"], want["module_bs"], want["dm_bs"]]
    assert module.hparams["bs"] == dm.hparams["bs"] == want["size"]
    want = cases["batch_size_finder_bs"]
    dm, module = DM(), Named()
    finder = callbacks.BatchSizeFinder(mode="power", steps_per_trial=2, init_val=2, max_trials=2,
                                       batch_arg_name="bs")
    fit = make_fit(max_epochs=1, callbacks=[finder])
    fit.fit(module, datamodule=dm)
    assert [finder.optimal_batch_size, module.bs, dm.bs, fit.global_step] == \
        [want["size"], want["module_bs"], want["dm_bs"], want["global_step"]]


@departure("steps_per_trial runs no step: each size is answered by the compiled step's memory "
           "analysis (Lightning ran 1 training step per trial, 3 in all)",
           section="The tuner: learning rate and batch size")
@covers("Tuner.scale_batch_size(steps_per_trial)", "BatchSizeFinder(steps_per_trial)")
def test_steps_per_trial():
    assert case(G, "tuner_arguments")["scale_batch_size_datamodule"]["trial_steps"] == 3

    class Counting(Named):
        steps = 0

        def on_train_batch_start(self, batch, batch_idx):
            type(self).steps += 1

    _tuner(max_epochs=1).scale_batch_size(Counting(), datamodule=DM(), steps_per_trial=1,
                                          init_val=2, max_trials=3, batch_arg_name="bs")
    assert Counting.steps == 0


@claim("LearningRateFinder(mode='linear', early_stop_threshold=None, update_attr=False, "
       "attr_name='learning_rate') in a fit sweeps Lightning's rates, suggests its rate and "
       "leaves module.learning_rate as it was")
@covers("LearningRateFinder(mode)", "LearningRateFinder(early_stop_threshold)",
        "LearningRateFinder(update_attr)", "LearningRateFinder(attr_name)")
def test_lr_finder_callback_arguments():
    want = case(G, "tuner_arguments")["lr_finder_callback"]
    module = Named()
    finder = callbacks.LearningRateFinder(min_lr=1e-3, max_lr=0.5, num_training_steps=15,
                                          mode="linear", early_stop_threshold=None,
                                          update_attr=False, attr_name="learning_rate")
    make_fit(max_epochs=2, callbacks=[finder]).fit(module, batches(G, "train", 4))
    np.testing.assert_allclose(finder.optimal_lr.results["lr"], want["lrs"], rtol=RTOL)
    np.testing.assert_allclose(finder.optimal_lr.suggestion(), want["suggestion"], rtol=RTOL)
    assert module.learning_rate == want["module_lr"]
