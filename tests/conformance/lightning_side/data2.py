"""Lightning side of the `data2` group: a torch `DataLoader` with its defaults (no shuffle, the
last partial batch kept) trained by Lightning, the numbers jaxlight's `DataLoader` must match.

Run only under the reference environment (torch CPU + lightning 2.6):
    /work/venv-lightning/bin/python tests/conformance/lightning_side/data2.py
writes tests/conformance/fixtures/data2.json.
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
    def __init__(self, prob):
        self.x = torch.tensor(prob["x"])
        self.y = torch.tensor(prob["y"])

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Reg(L.LightningModule):
    def __init__(self, prob, lr):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor(prob["kernel"].T))
            self.layer.bias.copy_(torch.tensor(prob["bias"]))
        self.lr = lr
        self.seen = 0

    def training_step(self, batch, batch_idx):
        self.seen += len(batch["x"])
        loss = nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self):
        self.epoch_losses.append(float(self.trainer.callback_metrics["train_loss"]))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def run(n: int, batch_size: int, epochs: int, lr: float, drop_last: bool = False) -> dict:
    prob = make_problem(n)
    model = Reg(prob, lr)
    model.epoch_losses = []
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root)
        trainer.fit(model, DataLoader(Examples(prob), batch_size=batch_size,
                                      drop_last=drop_last))
    return {"n": n, "checksum": checksum(prob), "batch_size": batch_size, "epochs": epochs,
            "lr": lr,
            "drop_last": drop_last, "global_step": trainer.global_step,
            "examples_seen": model.seen, "epoch_losses": model.epoch_losses,
            "kernel": model.layer.weight.detach().numpy().T.tolist(),
            "bias": model.layer.bias.detach().numpy().tolist()}


def main() -> None:
    cases = {
        # 2000 examples, batches of 32: 62 full batches and one of 16 per epoch, 5 epochs.
        "dataloader_defaults_train_every_example": run(2000, 32, 5, 0.01),
        "dataloader_drop_last": run(100, 32, 3, 0.05, drop_last=True),
    }
    out = {"group": "data2", "torch": torch.__version__, "lightning": lightning.__version__,
           "cases": cases}
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / "data2.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
