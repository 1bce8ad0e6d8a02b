"""Lightning side of the `tuner` group: the learning-rate finder (`Tuner.lr_find`,
`LearningRateFinder`), the batch-size finder (`Tuner.scale_batch_size`, `BatchSizeFinder`), and
what a logger receives (the calls Lightning makes on `MLFlowLogger`).

Run only under the reference environment (torch CPU + lightning 2.6):
    /work/venv-lightning/bin/python tests/conformance/lightning_side/tuner.py
writes tests/conformance/fixtures/tuner.json.

The batch-size cases give Lightning an out-of-memory oracle: the training step raises CUDA's
out-of-memory RuntimeError when the batch holds more than `limit` examples, so the sequence of
tried sizes is Lightning's search itself (jaxlight asks the compiled step's memory analysis the
same question).
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import sys
import tempfile
import warnings

import lightning
import lightning.pytorch as L
import numpy as np
import torch
from lightning.pytorch import callbacks
from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.tuner import Tuner
from lightning.pytorch.tuner.lr_finder import _LRFinder
from torch import nn
from torch.utils.data import DataLoader, Dataset

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _data2_problem import checksum, make_problem  # noqa: E402

FIXTURES = HERE.parent / "fixtures"
warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
torch.set_num_threads(1)


class Examples(Dataset):
    def __init__(self, x, y):
        self.x, self.y = torch.tensor(x), torch.tensor(y)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Reg(L.LightningModule):
    def __init__(self, prob, lr, optimizer="sgd"):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor(prob["kernel"].T))
            self.layer.bias.copy_(torch.tensor(prob["bias"]))
        self.lr, self.optimizer = lr, optimizer

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def configure_optimizers(self):
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[self.optimizer]
        return cls(self.parameters(), lr=self.lr)


def trainer(**kw):
    return L.Trainer(default_root_dir=tempfile.mkdtemp(prefix="conformance-"),
                     accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False,
                     num_sanity_val_steps=0, **kw)


def weights(module: Reg) -> dict:
    return {"kernel": module.layer.weight.detach().numpy().T.tolist(),
            "bias": module.layer.bias.detach().numpy().tolist()}


def lr_find_case(n, seed, batch_size, optimizer, kwargs):
    """Tuner(trainer).lr_find on the regression: the swept lrs, the smoothed losses, the
    suggestion, the module's lr afterwards and its weights (restored to the initial ones)."""
    prob = make_problem(n, seed=seed)
    module = Reg(prob, 0.01, optimizer)
    loader = DataLoader(Examples(prob["x"], prob["y"]), batch_size=batch_size)
    found = Tuner(trainer(max_epochs=50)).lr_find(module, train_dataloaders=loader, **kwargs)
    suggestion = found.suggestion()
    return {"n": n, "seed": seed, "checksum": checksum(prob), "batch_size": batch_size,
            "optimizer": optimizer, "kwargs": kwargs, "lrs": found.results["lr"],
            "losses": found.results["loss"], "suggestion": suggestion,
            "module_lr": module.lr, "weights_after": weights(module)}


def lr_callback_case(n, seed, batch_size, kwargs, epochs):
    """LearningRateFinder in a fit: it sweeps at fit start, sets module.lr, and the fit then
    trains from the initial weights with the suggested rate."""
    prob = make_problem(n, seed=seed)
    module = Reg(prob, 0.01)
    loader = DataLoader(Examples(prob["x"], prob["y"]), batch_size=batch_size)
    finder = callbacks.LearningRateFinder(**kwargs)
    t = trainer(max_epochs=epochs, callbacks=[finder])
    t.fit(module, loader)
    return {"n": n, "seed": seed, "checksum": checksum(prob), "batch_size": batch_size,
            "kwargs": kwargs, "epochs": epochs, "module_lr": module.lr,
            "suggestion": finder.optimal_lr.suggestion(), "global_step": t.global_step,
            "final": weights(module)}


def suggestion_cases():
    """The same loss curves given to Lightning's `_LRFinder.suggestion` (no training)."""
    rng = np.random.default_rng(7)
    lrs = [float(v) for v in np.geomspace(1e-5, 1.0, 40)]
    base = np.concatenate([np.linspace(2.0, 0.4, 28), np.linspace(0.45, 3.0, 12)])
    noisy = [float(v) for v in base + 0.05 * rng.normal(size=40)]
    with_nan = list(noisy)
    with_nan[20] = float("nan")
    with_nan[31] = float("inf")
    out = {}
    for name, losses, skips in (
            ("default_skips", noisy, (10, 1)), ("no_skip_begin", noisy, (0, 1)),
            ("wide_skips", noisy, (5, 8)), ("non_finite_dropped", with_nan, (10, 1)),
            ("too_few_points", noisy[:12], (10, 1))):
        finder = _LRFinder("exponential", 1e-5, 1.0, len(losses))
        finder.results = {"lr": lrs[:len(losses)], "loss": losses}
        got = finder.suggestion(skip_begin=skips[0], skip_end=skips[1])
        out[name] = {"lrs": lrs[:len(losses)], "losses": losses, "skip_begin": skips[0],
                     "skip_end": skips[1], "suggestion": got,
                     "optimal_idx": finder._optimal_idx}
    return out


class SizedReg(L.LightningModule):
    """Builds its loader from `batch_size`; the training step 'runs out of memory' above
    `limit` examples per batch, and records each trial's size."""

    def __init__(self, n, limit, batch_size=2):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.n, self.limit, self.batch_size = n, limit, batch_size
        self.tried = []

    def train_dataloader(self):
        x = np.zeros((self.n, 4), np.float32)
        return DataLoader(Examples(x, np.zeros((self.n, 2), np.float32)),
                          batch_size=self.batch_size)

    def training_step(self, batch, batch_idx):
        size = len(batch["x"])
        if batch_idx == 0:
            self.tried.append(size)
        if size > self.limit:
            raise RuntimeError("CUDA out of memory. (the conformance oracle)")
        return nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def batch_size_case(n, limit, kwargs, callback=False):
    module = SizedReg(n, limit)
    if callback:
        t = trainer(max_steps=1, callbacks=[callbacks.BatchSizeFinder(**kwargs)])
        t.fit(module)
        found = module.batch_size
        tried = module.tried[:-1]  # the last entry is the fit's own first batch
    else:
        found = Tuner(trainer(max_epochs=1)).scale_batch_size(module, **kwargs)
        tried = module.tried
    return {"n": n, "limit": limit, "kwargs": kwargs, "callback": callback, "tried": tried,
            "found": found, "module_batch_size": module.batch_size}


class _Recording(Logger):
    """Records what Lightning hands a logger (MLFlowLogger.log_metrics/log_hyperparams receive
    exactly these calls)."""

    name, version = "recording", 0

    def __init__(self):
        super().__init__()
        self.calls, self.hparams = [], None

    def log_metrics(self, metrics, step=None):
        self.calls.append({"step": step, "metrics": {k: float(v) for k, v in metrics.items()}})

    def log_hyperparams(self, params, *args, **kwargs):
        self.hparams = {k: v for k, v in dict(params).items()}


class LoggedReg(Reg):
    def __init__(self, prob, lr=0.05):
        super().__init__(prob, lr)
        self.save_hyperparameters(ignore=["prob"])

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.layer(batch["x"]), batch["y"]))


def logger_case(n, seed, batch_size, max_steps, log_every, val_every):
    """The metrics (names, steps, values) and hyperparameters a logger receives."""
    prob = make_problem(n, seed=seed)
    recording = _Recording()
    t = L.Trainer(default_root_dir=tempfile.mkdtemp(prefix="conformance-"), accelerator="cpu",
                  devices=1, logger=recording, max_steps=max_steps, log_every_n_steps=log_every,
                  val_check_interval=val_every, enable_progress_bar=False,
                  enable_checkpointing=False, num_sanity_val_steps=0, enable_model_summary=False)
    loader = DataLoader(Examples(prob["x"], prob["y"]), batch_size=batch_size)
    t.fit(LoggedReg(prob), loader, loader)
    return {"n": n, "seed": seed, "checksum": checksum(prob), "batch_size": batch_size,
            "max_steps": max_steps, "log_every_n_steps": log_every,
            "val_check_interval": val_every, "calls": recording.calls,
            "hparams": recording.hparams}


def signatures() -> dict:
    """Parameter names and defaults of the Lightning names this group carries."""
    import dataclasses
    import inspect

    from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBarTheme
    from lightning.pytorch.loggers import MLFlowLogger

    def params(fn):
        out = []
        for p in list(inspect.signature(fn).parameters.values())[1:]:
            d = p.default
            if d is inspect.Parameter.empty:
                d = "<required>"
            elif not isinstance(d, (int, float, str, bool, type(None))):
                d = f"<{type(d).__name__}>"
            out.append([p.name, d])
        return out

    return {"LearningRateFinder": params(callbacks.LearningRateFinder.__init__),
            "BatchSizeFinder": params(callbacks.BatchSizeFinder.__init__),
            "RichProgressBar": params(callbacks.RichProgressBar.__init__),
            "MLFlowLogger": params(MLFlowLogger.__init__),
            "Tuner.lr_find": params(Tuner.lr_find),
            "Tuner.scale_batch_size": params(Tuner.scale_batch_size),
            "RichProgressBarTheme": dataclasses.asdict(RichProgressBarTheme())}


def main() -> None:
    lr_cases = {
        "lr_find_exponential_sgd": lr_find_case(
            64, 3, 8, "sgd", {"min_lr": 1e-4, "max_lr": 30.0, "num_training": 30}),
        "lr_find_linear_sgd": lr_find_case(
            64, 3, 8, "sgd", {"min_lr": 1e-3, "max_lr": 0.5, "num_training": 25,
                              "mode": "linear"}),
        "lr_find_no_early_stop_adam": lr_find_case(
            48, 5, 16, "adam", {"min_lr": 1e-5, "max_lr": 0.3, "num_training": 20,
                                "early_stop_threshold": None}),
        "lr_find_update_attr_false": lr_find_case(
            64, 3, 8, "sgd", {"min_lr": 1e-4, "max_lr": 0.5, "num_training": 20,
                              "update_attr": False}),
    }
    diverged = lr_cases["lr_find_exponential_sgd"]
    assert len(diverged["lrs"]) < 30, "the exponential case should stop early (diverging)"
    callback_cases = {
        "lr_finder_callback_trains_with_the_suggestion": lr_callback_case(
            64, 3, 8, {"min_lr": 1e-4, "max_lr": 0.5, "num_training_steps": 20}, 2),
    }
    bs_cases = {
        "power_stops_at_first_failure": batch_size_case(1000, 50, {"mode": "power"}),
        "binsearch_refines_then_margin": batch_size_case(1000, 50, {"mode": "binsearch"}),
        "binsearch_no_margin": batch_size_case(1000, 37, {"mode": "binsearch", "margin": 0.0}),
        "power_capped_by_dataset_length": batch_size_case(100, 10_000, {"mode": "power"}),
        "power_max_trials": batch_size_case(1000, 10_000, {"mode": "power", "max_trials": 3,
                                                           "init_val": 3}),
        "binsearch_max_val": batch_size_case(100_000, 10_000, {"mode": "binsearch",
                                                               "max_val": 100}),
        "power_fails_at_init": batch_size_case(1000, 3, {"mode": "power", "init_val": 8}),
        "callback_binsearch": batch_size_case(1000, 50, {"mode": "binsearch"}, callback=True),
    }
    for name, c in bs_cases.items():
        assert all(isinstance(s, int) for s in c["tried"]), name
    out = {"group": "tuner", "torch": torch.__version__, "lightning": lightning.__version__,
           "lr_find": lr_cases, "lr_callback": callback_cases,
           "suggestion": suggestion_cases(), "batch_size": bs_cases,
           "signatures": signatures(),
           "logger": {"mlflow_receives_lightnings_metrics": logger_case(64, 3, 8, 8, 2, 4)}}
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / "tuner.json"
    text = json.dumps(out, indent=1, allow_nan=True)
    assert "NaN" in text or not any(math.isnan(v) for c in lr_cases.values()
                                    for v in c["losses"])
    path.write_text(text)
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
