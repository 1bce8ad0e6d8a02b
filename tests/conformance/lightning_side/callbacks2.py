"""Lightning side of the `callbacks2` group: weight averaging (`WeightAveraging`,
`EMAWeightAveraging`) and other Lightning 2.6 callbacks jaxlight carries under their names.

Run only under the reference environment (torch CPU + lightning 2.6):
    /work/venv-lightning/bin/python tests/conformance/lightning_side/callbacks2.py
writes tests/conformance/fixtures/callbacks2.json.
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
    def __init__(self, prob, lr, optimizer="sgd"):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor(prob["kernel"].T))
            self.layer.bias.copy_(torch.tensor(prob["bias"]))
        self.lr, self.optimizer = lr, optimizer
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
        return cls(self.parameters(), lr=self.lr)


def weights(module) -> dict:
    return {"kernel": module.layer.weight.detach().numpy().T.tolist(),
            "bias": module.layer.bias.detach().numpy().tolist()}


def averaging_case(make_callback, spec: dict, n=48, n_val=16, batch_size=8, epochs=3,
                   lr=0.05, optimizer="sgd") -> dict:
    prob = make_problem(n + n_val, seed=1)
    x, y = prob["x"], prob["y"]
    module = Reg(prob, lr, optimizer)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            callbacks=[make_callback()], num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(Examples(x[:n], y[:n]), batch_size=batch_size),
                    DataLoader(Examples(x[n:], y[n:]), batch_size=batch_size))
    return {"callback": spec, "n": n + n_val, "seed": 1, "checksum": checksum(prob),
            "n_train": n, "batch_size": batch_size, "epochs": epochs, "lr": lr,
            "optimizer": optimizer, "global_step": trainer.global_step,
            "val_losses": module.val_losses, "final": weights(module)}


def main() -> None:
    cases = {
        "weight_averaging_default_is_swa_mean": averaging_case(
            lambda: callbacks.WeightAveraging(), {"name": "WeightAveraging", "kwargs": {}}),
        "ema_decay_start_and_every": averaging_case(
            lambda: callbacks.EMAWeightAveraging(decay=0.8, update_starting_at_step=4,
                                                 update_every_n_steps=2),
            {"name": "EMAWeightAveraging",
             "kwargs": {"decay": 0.8, "update_starting_at_step": 4, "update_every_n_steps": 2}}),
        "ema_adam_default_decay": averaging_case(
            lambda: callbacks.EMAWeightAveraging(decay=0.9),
            {"name": "EMAWeightAveraging", "kwargs": {"decay": 0.9}}, optimizer="adam",
            lr=0.01),
        # Updates start after the first validation: that validation sees the initial weights.
        "ema_validation_before_first_update_uses_initial_weights": averaging_case(
            lambda: callbacks.EMAWeightAveraging(decay=0.5, update_starting_at_step=8),
            {"name": "EMAWeightAveraging",
             "kwargs": {"decay": 0.5, "update_starting_at_step": 8}}),
    }
    out = {"group": "callbacks2", "torch": torch.__version__, "lightning": lightning.__version__,
           "cases": cases}
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / "callbacks2.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
