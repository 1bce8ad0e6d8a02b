"""What every Lightning-side script shares: the problem, the torch module, the hook recorder.

Runs only under the reference environment (torch CPU + lightning), never in the regular suite.
The problem (initial weights and batches) comes from `tests/conformance/_problem.py` (NumPy only)
and is written into each fixture, so the jaxlight side reads the very numbers Lightning used.
"""

from __future__ import annotations

import json
import logging
import pathlib
import sys
import tempfile
import warnings

import lightning
import lightning.pytorch as L
import numpy as np
import torch
from torch import nn

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _problem import COMPARED_HOOKS, problem  # noqa: E402

FIXTURES = HERE.parent / "fixtures"

warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
torch.set_num_threads(1)


class Batches:
    """A loader: each `iter()` is a fresh pass over fixed dict batches, in order (a list would
    be several loaders to Lightning)."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def batches(prob: dict, key: str = "train", batch_size: int = 4) -> Batches:
    """The problem's examples as a loader of dict batches (what both sides iterate, in order)."""
    x = torch.tensor(np.asarray(prob[key]["x"], np.float32))
    y = torch.tensor(np.asarray(prob[key]["y"], np.float32))
    return Batches([{"x": x[i:i + batch_size], "y": y[i:i + batch_size]}
                    for i in range(0, len(x), batch_size)])


class Passes:
    """An iterable whose k-th pass yields one batch carrying `values[k]` as "score" (a metric
    both sides log, so callbacks that watch it see the same sequence on both sides)."""

    def __init__(self, values, x):
        self.values, self.x, self.passes = list(values), x, 0

    def __len__(self):
        return 1

    def __iter__(self):
        value = self.values[min(self.passes, len(self.values) - 1)]
        self.passes += 1
        yield {"x": self.x, "y": self.x[:, :2] * 0,
               "score": torch.full((len(self.x),), float(value))}


class Reg(L.LightningModule):
    """Linear regression, 4 inputs -> 2 outputs, MSE; weights from the problem."""

    def __init__(self, prob, optimizer="sgd", lr=0.1, scheduler=None, log_train=True,
                 calls=None):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor(np.asarray(prob["kernel"], np.float32).T))
            self.layer.bias.copy_(torch.tensor(np.asarray(prob["bias"], np.float32)))
        self.opt_name, self.lr, self.scheduler = optimizer, lr, scheduler
        self.log_train = log_train
        self.calls = calls

    def loss(self, batch):
        return torch.nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.log_train:
            self.log("train_loss", loss)
        if "score" in batch:
            self.log("train_score", batch["score"].mean(), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))
        if "score" in batch:
            self.log("val_score", batch["score"].mean())

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch))

    def predict_step(self, batch, batch_idx):
        return self.layer(batch["x"])

    def configure_optimizers(self):
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[self.opt_name]
        opt = cls(self.parameters(), lr=self.lr)
        if self.scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": self.scheduler(opt)}

    def weights(self) -> dict:
        """Weights in flax's layout (kernel is in x out)."""
        return {"kernel": self.layer.weight.detach().numpy().T.tolist(),
                "bias": self.layer.bias.detach().numpy().tolist()}


def _entry(name, args, kind):
    if name in ("setup", "teardown"):
        stage = args[-1] if args else None
        return f"{kind}{name}:{getattr(stage, 'value', stage)}"
    if name in ("on_train_batch_start", "on_train_batch_end", "on_validation_batch_end"):
        # (..., batch, batch_idx[, dataloader_idx]): the batch index is the one int after the batch
        idx = [a for a in args if isinstance(a, int) and not isinstance(a, bool)]
        return f"{kind}{name}:{idx[0]}"
    return f"{kind}{name}"


class Recorder(L.Callback):
    """Appends "Callback.<hook>" for every compared hook (":batch_idx" / ":stage" appended)."""

    def __init__(self, calls):
        self.calls = calls


def _callback_hook(name):
    def hook(self, trainer, module, *args, **kwargs):
        args = args + tuple(kwargs.values())
        if name == "on_train_batch_start":
            args = args[-2:]
        self.calls.append(_entry(name, args, "Callback."))

    return hook


def _module_hook(name):
    def hook(self, *args, **kwargs):
        if self.calls is not None:
            self.calls.append(_entry(name, args + tuple(kwargs.values()), ""))

    return hook


for _name in COMPARED_HOOKS:
    setattr(Recorder, _name, _callback_hook(_name))


class HookedReg(Reg):
    """Reg recording its own hooks too (Lightning calls the module's hook after the callbacks')."""


for _name in COMPARED_HOOKS:
    setattr(HookedReg, _name, _module_hook(_name))


def trainer(tmp, **kw) -> L.Trainer:
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("enable_model_summary", False)
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, L.callbacks.ModelCheckpoint) for cb in kw.get("callbacks", [])))
    kw.setdefault("num_sanity_val_steps", 0)
    kw.setdefault("accelerator", "cpu")
    kw.setdefault("devices", 1)
    return L.Trainer(default_root_dir=tmp, **kw)


def tmpdir() -> str:
    return tempfile.mkdtemp(prefix="conformance-")


def floats(metrics: dict) -> dict:
    return {k: float(v) for k, v in sorted(metrics.items())}


def write(group: str, cases: dict, prob: dict | None = None) -> None:
    """Writes fixtures/<group>.json: versions, the problem, then case id -> observed values."""
    FIXTURES.mkdir(exist_ok=True)
    out = {"group": group, "torch": torch.__version__, "lightning": lightning.__version__,
           "problem": prob, "cases": cases}
    path = FIXTURES / f"{group}.json"
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{path.name}: {len(cases)} cases")


__all__ = ["COMPARED_HOOKS", "Batches", "HookedReg", "L", "Passes", "Recorder", "Reg", "batches",
           "floats",
           "np", "problem", "tmpdir", "torch", "trainer", "write"]
