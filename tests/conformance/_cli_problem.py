"""Group `cli`'s problem (NumPy only, read by both sides): Lightning's backbone example at the
scale of the 8x8 digits bundled with jaxlight, its initial weights, and the command lines."""

from __future__ import annotations

import pathlib

import numpy as np

DIGITS = pathlib.Path(__file__).resolve().parents[2] / "jaxlight" / "recipes" / "digits.npz"
HIDDEN = 16

#: LightningCLI flags whose `--print_config` output is the config both sides run.
FLAGS = ["--seed_everything", "42", "--trainer.max_epochs", "2",
         "--trainer.limit_val_batches", "2",
         "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor", "valid_loss",
         "--trainer.callbacks.patience", "5",
         "--model.backbone", "Backbone", "--model.backbone.hidden_dim", str(HIDDEN),
         "--model.learning_rate", "0.01", "--data.batch_size", "16"]

#: LightningCLI's generated configure_optimizers: Adam with L2 decay, the rate halved per epoch.
OPTIMIZER_FLAGS = ["--optimizer", "Adam", "--optimizer.lr", "0.005",
                   "--optimizer.weight_decay", "0.01", "--lr_scheduler", "StepLR",
                   "--lr_scheduler.step_size", "1", "--lr_scheduler.gamma", "0.5"]


def problem() -> dict:
    """96 training and 32 validation images (x in [0, 1], float32) and the initial weights of
    the backbone's two layers (`kernel` as (in, out))."""
    digits = np.load(DIGITS)
    x = digits["images"].astype(np.float32) / 16.0
    y = digits["labels"].astype(np.int64)
    rng = np.random.default_rng(0)

    def layer(n_in, n_out):
        bound = 1 / np.sqrt(n_in)
        return {"kernel": rng.uniform(-bound, bound, (n_in, n_out)).astype(np.float32),
                "bias": rng.uniform(-bound, bound, (n_out,)).astype(np.float32)}

    return {"train": {"x": x[:96], "y": y[:96]}, "val": {"x": x[96:128], "y": y[96:128]},
            "init": {"l1": layer(64, HIDDEN), "l2": layer(HIDDEN, 10)}}
