"""Lightning side of the `callbacks3` group: `StochasticWeightAveraging` (and the other
Lightning 2.6 callbacks that change the training schedule mid-run).

Run only under the reference environment (torch CPU + lightning 2.6):
    /work/venv-lightning/bin/python tests/conformance/lightning_side/callbacks3.py
writes tests/conformance/fixtures/callbacks3.json.
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
import torch
from lightning.pytorch import callbacks
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
    """4 -> 2 linear regression, MSE; `gamma` adds an epoch StepLR(1, gamma) scheduler."""

    def __init__(self, prob, lr, optimizer="sgd", gamma=None):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor(prob["kernel"].T))
            self.layer.bias.copy_(torch.tensor(prob["bias"]))
        self.lr, self.optimizer, self.gamma = lr, optimizer, gamma
        self.val_losses = []

    def loss(self, batch):
        return nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self):
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[self.optimizer]
        opt = cls(self.parameters(), lr=self.lr)
        if self.gamma is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(
            opt, 1, self.gamma)}


class EpochLrs(callbacks.Callback):
    """The learning rate each epoch trained with (read at its first batch)."""

    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def weights(module) -> dict:
    return {"kernel": module.layer.weight.detach().numpy().T.tolist(),
            "bias": module.layer.bias.detach().numpy().tolist()}


def swa_case(kwargs: dict, n=48, n_val=16, batch_size=8, epochs=6, lr=0.05, optimizer="sgd",
             gamma=None) -> dict:
    prob = make_problem(n + n_val, seed=3)
    x, y = prob["x"], prob["y"]
    module = Reg(prob, lr, optimizer, gamma)
    lrs = EpochLrs()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            callbacks=[callbacks.StochasticWeightAveraging(**kwargs), lrs],
                            num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(Examples(x[:n], y[:n]), batch_size=batch_size),
                    DataLoader(Examples(x[n:], y[n:]), batch_size=batch_size))
    return {"kwargs": kwargs, "n": n + n_val, "seed": 3, "checksum": checksum(prob),
            "n_train": n, "batch_size": batch_size, "epochs": epochs, "lr": lr,
            "optimizer": optimizer, "gamma": gamma, "global_step": trainer.global_step,
            "epoch_lrs": lrs.lrs, "val_losses": module.val_losses, "final": weights(module)}


class EpochSteps(callbacks.Callback):
    def __init__(self):
        self.steps = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.steps.append(trainer.global_step)


def accumulation_case(scheduling: dict, n=48, n_val=16, batch_size=8, epochs=4, lr=0.05,
                      optimizer="sgd") -> dict:
    prob = make_problem(n + n_val, seed=4)
    x, y = prob["x"], prob["y"]
    module = Reg(prob, lr, optimizer)
    steps = EpochSteps()
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            callbacks=[callbacks.GradientAccumulationScheduler(dict(scheduling)),
                                       steps], num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(Examples(x[:n], y[:n]), batch_size=batch_size),
                    DataLoader(Examples(x[n:], y[n:]), batch_size=batch_size))
    return {"scheduling": {str(k): v for k, v in scheduling.items()}, "n": n + n_val, "seed": 4,
            "checksum": checksum(prob), "n_train": n, "batch_size": batch_size,
            "epochs": epochs, "lr": lr, "optimizer": optimizer,
            "global_step": trainer.global_step, "epoch_steps": steps.steps,
            "val_losses": module.val_losses, "final": weights(module)}


def main() -> None:
    swa = {
        "swa_sgd_cos_from_third_epoch": swa_case(
            {"swa_lrs": 0.01, "swa_epoch_start": 3, "annealing_epochs": 2}),
        "swa_adam_linear_fraction_start": swa_case(
            {"swa_lrs": 0.002, "swa_epoch_start": 0.5, "annealing_epochs": 3,
             "annealing_strategy": "linear"}, optimizer="adam", lr=0.01, epochs=5),
        "swa_from_the_first_epoch_averages_the_initial_weights": swa_case(
            {"swa_lrs": 0.02, "swa_epoch_start": 1, "annealing_epochs": 0}, epochs=3),
        "swa_replaces_an_epoch_scheduler": swa_case(
            {"swa_lrs": 0.005, "swa_epoch_start": 0.6, "annealing_epochs": 1}, gamma=0.5,
            epochs=5, n=44),
        "swa_default_start_and_annealing": swa_case({"swa_lrs": 0.01}, epochs=5),
    }
    accumulation = {
        "accumulation_scheduler_changes_k_by_epoch": accumulation_case({1: 2, 3: 3}),
        "accumulation_scheduler_short_last_group": accumulation_case({0: 4, 2: 1}, epochs=3),
        "accumulation_scheduler_adam": accumulation_case({2: 4}, optimizer="adam", lr=0.01,
                                                         epochs=3),
    }
    out = {"group": "callbacks3", "torch": torch.__version__, "lightning": lightning.__version__,
           "swa_cases": swa, "accumulation_cases": accumulation,
           "finetune_cases": finetune_cases()}
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / "callbacks3.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path} ({path.stat().st_size} bytes)")



class Net(Reg):
    """backbone Linear(4, 3) -> tanh -> head Linear(3, 2); the optimizer over the trainable
    parameters only, as Lightning's finetuning docs build it."""

    def __init__(self, prob, lr, optimizer):
        super().__init__(prob, lr, optimizer)
        del self.layer
        self.backbone = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)
        with torch.no_grad():
            for layer, name in ((self.backbone, "backbone"), (self.head, "head")):
                layer.weight.copy_(torch.tensor(prob[name]["kernel"].T))
                layer.bias.copy_(torch.tensor(prob[name]["bias"]))

    def loss(self, batch):
        out = self.head(torch.tanh(self.backbone(batch["x"])))
        return nn.functional.mse_loss(out, batch["y"])

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer == "sgd_momentum":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        return torch.optim.Adam(params, lr=self.lr)


def net_weights(module) -> dict:
    return {name: {"kernel": getattr(module, name).weight.detach().numpy().T.tolist(),
                   "bias": getattr(module, name).bias.detach().numpy().tolist()}
            for name in ("backbone", "head")}


class GroupLrs(callbacks.Callback):
    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.lrs.append([g["lr"] for g in trainer.optimizers[0].param_groups])


class UnfreezeAt(callbacks.BaseFinetuning):
    def __init__(self, epoch, lr=None):
        super().__init__()
        self.epoch, self.lr = epoch, lr

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == self.epoch:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=self.lr)


def finetune_case(spec: dict, n=48, n_val=16, batch_size=8, epochs=4, lr=0.05,
                  optimizer="adam") -> dict:
    import numpy as np

    prob = make_problem(n + n_val, seed=6)
    rng = np.random.default_rng(7)
    prob["backbone"] = {"kernel": np.round(rng.normal(size=(4, 3)) * 0.5, 4).astype(np.float32),
                        "bias": np.round(rng.normal(size=3) * 0.1, 4).astype(np.float32)}
    prob["head"] = {"kernel": np.round(rng.normal(size=(3, 2)) * 0.5, 4).astype(np.float32),
                    "bias": np.round(rng.normal(size=2) * 0.1, 4).astype(np.float32)}
    x, y = prob["x"], prob["y"]
    module = Net(prob, lr, optimizer)
    lrs = GroupLrs()
    kwargs = dict(spec["kwargs"])
    if spec["name"] == "BackboneFinetuning":
        if kwargs.pop("lambda", None) is not None:
            kwargs["lambda_func"] = lambda epoch: 1.5
        cb = callbacks.BackboneFinetuning(**kwargs)
    else:
        cb = UnfreezeAt(**kwargs)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            callbacks=[cb, lrs], num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(Examples(x[:n], y[:n]), batch_size=batch_size),
                    DataLoader(Examples(x[n:], y[n:]), batch_size=batch_size))
    return {"callback": spec, "n": n + n_val, "seed": 6, "checksum": checksum(prob),
            "n_train": n, "batch_size": batch_size, "epochs": epochs, "lr": lr,
            "optimizer": optimizer, "global_step": trainer.global_step,
            "initial": {k: {kk: vv.tolist() for kk, vv in prob[k].items()}
                        for k in ("backbone", "head")},
            "group_lrs": lrs.lrs, "val_losses": module.val_losses,
            "final": net_weights(module)}


def finetune_cases() -> dict:
    return {
        "backbone_finetuning_adam_unfreezes_with_zero_moments": finetune_case(
            {"name": "BackboneFinetuning",
             "kwargs": {"unfreeze_backbone_at_epoch": 2, "lambda": 1.5}}, epochs=5),
        "backbone_finetuning_defaults_align_to_the_rate": finetune_case(
            {"name": "BackboneFinetuning", "kwargs": {"unfreeze_backbone_at_epoch": 1}},
            epochs=6, lr=0.01),
        "base_finetuning_sgd_momentum_default_denominator": finetune_case(
            {"name": "UnfreezeAt", "kwargs": {"epoch": 1}}, optimizer="sgd_momentum",
            epochs=3),
    }



if __name__ == "__main__":
    main()
