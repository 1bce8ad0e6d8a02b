"""Conformance group `tuner`: the learning-rate finder (`jl.Tuner(fit).lr_find`,
`callbacks.LearningRateFinder`) and the batch-size finder (`Tuner.scale_batch_size`,
`callbacks.BatchSizeFinder`) beside Lightning's (fixture: tests/conformance/fixtures/tuner.json,
from lightning_side/tuner.py).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.callbacks._batch_size_finder import search_batch_size
from jaxlight.callbacks._lr_finder import LRFinder
from tests.conformance import _data2_problem as _problem
from tests.conformance._cases import assert_sequence, claim, covers, departure

HERE = pathlib.Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixtures" / "tuner.json").read_text())


class Reg(jl.TrainModule):
    def __init__(self, kernel, bias, lr, optimizer="sgd"):
        super().__init__()
        self.kernel, self.bias, self.lr, self.optimizer = kernel, bias, lr, optimizer

    def configure_model(self, rngs):
        layer = nnx.Linear(4, 2, rngs=rngs)
        layer.kernel[...] = self.kernel
        layer.bias[...] = self.bias
        return layer

    def configure_optimizers(self):
        return {"sgd": optax.sgd, "adam": optax.adam}[self.optimizer](self.lr)

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _problem_of(case):
    prob = _problem.make_problem(case["n"], seed=case["seed"])
    np.testing.assert_allclose(_problem.checksum(prob), case["checksum"], rtol=1e-12)
    return prob


def _fit(strategy="single", **kw):
    return jl.Fit(strategy, enable_progress_bar=False, logger=False, enable_model_summary=False,
                  enable_checkpointing=False, **kw)


# -- the learning-rate finder ------------------------------------------------------------------


def _check_lr_find(case_id, strategy="single"):
    case = FIXTURE["lr_find"][case_id]
    prob = _problem_of(case)
    module = Reg(prob["kernel"], prob["bias"], 0.01, case["optimizer"])
    found = jl.Tuner(_fit(strategy, max_epochs=50)).lr_find(
        module, jl.data.DataLoader({"x": prob["x"], "y": prob["y"]}, case["batch_size"]),
        **case["kwargs"])
    # The same sweep: the same rates, the same smoothed losses, stopped at the same step.
    assert len(found.results["lr"]) == len(case["lrs"])
    np.testing.assert_allclose(found.results["lr"], case["lrs"], rtol=1e-5)
    np.testing.assert_allclose(found.results["loss"], case["losses"], rtol=1e-5)
    np.testing.assert_allclose(found.suggestion(), case["suggestion"], rtol=1e-5)
    np.testing.assert_allclose(module.lr, case["module_lr"], rtol=1e-5)
    assert module.hparams["lr"] == module.lr  # as Lightning's lightning_setattr: hparams too
    assert found.compile_counts["train"] == 1  # the rate is computed in the one compiled step
    # The model is as before: a later fit starts from the initial weights.
    with pytest.raises(jl.JaxlightError, match="not built yet"):
        _ = module.model


@claim("Tuner.lr_find (exponential mode) sweeps the same rates, records the same smoothed "
       "losses, stops at the same step when the loss diverges (early_stop_threshold), suggests "
       "the same rate and sets module.lr to it")
@pytest.mark.parametrize("strategy", ["single", "dp"])
@covers("Tuner.lr_find",
        "Tuner.lr_find(model)",
        "Tuner.lr_find(train_dataloaders)",
        "Tuner.lr_find(min_lr)",
        "Tuner.lr_find(max_lr)",
        "Tuner.lr_find(num_training)",
        "Tuner.lr_find(early_stop_threshold)")
def test_tuner_lr_find_exponential_sgd(strategy):
    _check_lr_find("lr_find_exponential_sgd", strategy)  # dp: the batch of 8 over 8 devices


@claim("Tuner.lr_find(mode='linear') sweeps Lightning's linear rates and suggests the same rate")
@covers("Tuner.lr_find(mode)")
def test_tuner_lr_find_linear_sgd():
    _check_lr_find("lr_find_linear_sgd")


@claim("Tuner.lr_find(update_attr=False) leaves module.lr as it was")
@covers("Tuner.lr_find(update_attr)")
def test_tuner_lr_find_update_attr_false():
    _check_lr_find("lr_find_update_attr_false")


@claim("LearningRateFinder in a fit sweeps at the fit's start, sets module.lr to the suggestion "
       "and trains from the initial weights with it: the same final weights and steps")
@covers("LearningRateFinder(min_lr)",
        "LearningRateFinder(max_lr)",
        "LearningRateFinder(num_training_steps)")
def test_tuner_lr_finder_callback_trains_with_the_suggestion():
    case = FIXTURE["lr_callback"]["lr_finder_callback_trains_with_the_suggestion"]
    prob = _problem_of(case)
    module = Reg(prob["kernel"], prob["bias"], 0.01)
    finder = callbacks.LearningRateFinder(**case["kwargs"])
    fit = _fit(max_epochs=case["epochs"], callbacks=[finder])
    fit.fit(module, jl.data.DataLoader({"x": prob["x"], "y": prob["y"]}, case["batch_size"]))
    np.testing.assert_allclose(module.lr, case["module_lr"], rtol=1e-5)
    np.testing.assert_allclose(finder.optimal_lr.suggestion(), case["suggestion"], rtol=1e-5)
    assert fit.global_step == case["global_step"]
    assert fit.session.compile_counts["train"] == 1
    np.testing.assert_allclose(np.asarray(module.model.kernel[...]), case["final"]["kernel"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(module.model.bias[...]), case["final"]["bias"],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case_id", sorted(FIXTURE["suggestion"]))
@claim("LRFinder.suggestion(skip_begin, skip_end) picks the same point of the same loss curve "
       "(steepest gradient with respect to the rate, non-finite losses dropped; None with "
       "fewer than two points)")
def test_tuner_suggestion(case_id):
    case = FIXTURE["suggestion"][case_id]
    finder = LRFinder("exponential", 1e-5, 1.0, len(case["losses"]))
    finder.results = {"lr": case["lrs"], "loss": case["losses"]}
    if case["suggestion"] is None:
        with pytest.warns(jl.JaxlightWarning, match="fewer than 2 finite losses"):
            assert finder.suggestion(case["skip_begin"], case["skip_end"]) is None
        return
    assert finder.suggestion(case["skip_begin"], case["skip_end"]) == case["suggestion"]
    assert finder._optimal_idx == case["optimal_idx"]


# -- the batch-size finder ---------------------------------------------------------------------

#: Cases where Lightning's first trial runs with the loader's old batch size (its
#: `_adjust_batch_size(value=init_val)` does not rebuild the loader), not `init_val`.
STALE_FIRST_TRIAL = ("power_max_trials", "power_fails_at_init")


def _search(case):
    """jaxlight's search with Lightning's oracle: a size fits when it is at most `limit`; a
    trial's batch holds at most the dataset's examples."""
    tried = []

    def fits(size):
        tried.append(min(size, case["n"]))
        return min(size, case["n"]) <= case["limit"]

    kwargs = {k: v for k, v in case["kwargs"].items()}
    found = search_batch_size(fits, dataset_length=case["n"], **kwargs)
    return tried, found


@pytest.mark.parametrize("case_id", sorted(set(FIXTURE["batch_size"]) - set(STALE_FIRST_TRIAL)))
@claim("scale_batch_size / BatchSizeFinder ('power', 'binsearch', margin, max_trials, max_val, "
       "the dataset's length) try the same sizes in the same order and find the same size, "
       "given the same fits/does-not-fit answers")
@covers("Tuner.scale_batch_size(mode)",
        "Tuner.scale_batch_size(margin)",
        "Tuner.scale_batch_size(max_val)",
        "BatchSizeFinder(mode)",
        "BatchSizeFinder(margin)",
        "BatchSizeFinder(max_val)")
def test_tuner_batch_size_search(case_id):
    case = FIXTURE["batch_size"][case_id]
    tried, found = _search(case)
    assert_sequence(tried, case["tried"], "tried batch sizes")
    assert found == case["found"]


@pytest.mark.parametrize("case_id", STALE_FIRST_TRIAL)
@departure("init_val is the first size tried; Lightning 2.6 runs its first trial with the "
           "loader's previous batch size (and can return a size that never fit)",
           section="The tuner: learning rate and batch size")
@covers("Tuner.scale_batch_size(init_val)",
        "Tuner.scale_batch_size(max_trials)",
        "BatchSizeFinder(init_val)",
        "BatchSizeFinder(max_trials)")
def test_tuner_batch_size_first_trial_is_init_val(case_id):
    case = FIXTURE["batch_size"][case_id]
    tried, found = _search(case)
    init = case["kwargs"]["init_val"]
    assert case["tried"][0] == 2 != init  # Lightning: the loader's old size
    assert tried[0] == init
    assert found <= case["limit"]  # what jaxlight returns fits
    expected = {"power_max_trials": ([3, 6, 12], 12), "power_fails_at_init": ([8, 4, 2, 4], 2)}
    assert (tried, found) == expected[case_id]


# -- what a logger receives: MLFlowLogger read back with MLflow's client ------------------------


class LoggedReg(Reg):
    def training_step(self, model, batch):
        loss = super().training_step(model, batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, model, batch):
        return {"loss": super().training_step(model, batch)}


@pytest.fixture(scope="module")
def mlflow_run(tmp_path_factory):
    """jaxlight's MLFlowLogger on the fixture's fit, read back: {name: [(step, value)]}, params."""
    tracking = pytest.importorskip("mlflow.tracking")
    case = FIXTURE["logger"]["mlflow_receives_lightnings_metrics"]
    prob = _problem_of(case)
    uri = f"file:{tmp_path_factory.mktemp('mlflow') / 'mlruns'}"
    logger = callbacks.MLFlowLogger("conformance", tracking_uri=uri)
    fit = jl.Fit("single", max_steps=case["max_steps"],
                 log_every_n_steps=case["log_every_n_steps"],
                 val_check_interval=case["val_check_interval"], callbacks=[logger],
                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                 enable_checkpointing=False)
    loader = jl.data.DataLoader({"x": prob["x"], "y": prob["y"]}, case["batch_size"])
    fit.fit(LoggedReg(prob["kernel"], prob["bias"], 0.05), loader, loader)
    client = tracking.MlflowClient(uri)
    run = client.get_run(logger.run_id)
    history = {name: sorted((m.step, m.value) for m in client.get_metric_history(
        run.info.run_id, name)) for name in run.data.metrics}
    return case, history, run.data.params


def _lightning_history(case):
    out: dict[str, list] = {}
    for call in case["calls"]:
        for name, value in call["metrics"].items():
            if name != "epoch":
                out.setdefault(name, []).append((call["step"], value))
    return out


@claim("MLFlowLogger receives Lightning's metric names (self.log's, validation's) with the "
       "same values, as many times, and the module's hyperparameters as params")
def test_tuner_mlflow_receives_lightnings_metrics(mlflow_run):
    case, history, params = mlflow_run
    lightning = _lightning_history(case)
    for name, points in lightning.items():
        assert name in history, (name, sorted(history))
        assert len(history[name]) == len(points), name
        np.testing.assert_allclose([v for _, v in history[name]], [v for _, v in points],
                                   rtol=1e-5, err_msg=name)
    assert {k: str(v) for k, v in case["hparams"].items()}.items() <= params.items()


@departure("a metric reaches every logger at the number of optimizer steps taken (2, 4, ...: "
           "the step the checkpoint of those weights is named by); Lightning logs it at that "
           "number minus one (the 0-based index of the last batch trained)",
           "Deliberate departures")
@claim("MLFlowLogger records each metric, training and validation, one step after Lightning's")
@covers("Fit(log_every_n_steps)")
def test_tuner_mlflow_logged_steps(mlflow_run):
    case, history, _ = mlflow_run
    for name, points in _lightning_history(case).items():
        assert [s for s, _ in history[name]] == [s + 1 for s, _ in points], name


# -- the names' arguments ----------------------------------------------------------------------


def _ours(name):
    import dataclasses
    import inspect

    if name == "RichProgressBarTheme":
        return dataclasses.asdict(callbacks.RichProgressBarTheme())
    owner, _, method = name.partition(".")
    fn = getattr(jl.Tuner, method) if owner == "Tuner" else getattr(callbacks, owner).__init__
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            continue  # jaxlight's own additions (memory_limit) come after Lightning's
        d = "<required>" if p.default is inspect.Parameter.empty else p.default
        out.append([p.name, d])
    return out


@pytest.mark.parametrize("name", sorted(FIXTURE["signatures"]))
@claim("LearningRateFinder, BatchSizeFinder, Tuner.lr_find / scale_batch_size, "
       "RichProgressBar (and its theme) and MLFlowLogger take Lightning's arguments, in its "
       "order, with its defaults")
def test_tuner_signature(name):
    expected = FIXTURE["signatures"][name]
    got = _ours(name)
    if name == "RichProgressBar":  # theme=None is Lightning's default theme
        assert dict(got)["theme"] is None
        got = [[n, "<RichProgressBarTheme>" if n == "theme" else d] for n, d in got]
    assert got == expected
