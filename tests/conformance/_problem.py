"""The conformance problems, NumPy only (imported by both sides): a 4 -> 2 linear regression.

The Lightning side copies these numbers into torch and writes them into each fixture; the
jaxlight side reads them back from the fixture, so both start from the same weights and batches.
"""

from __future__ import annotations

import numpy as np

#: Hooks both Lightning's `Callback`/`LightningModule` and jaxlight's `HostHooks`/`ModuleHooks`
#: have; hook-order cases compare the sequences restricted to these names.
COMPARED_HOOKS = (
    "setup", "teardown", "on_fit_start", "on_fit_end",
    "on_sanity_check_start", "on_sanity_check_end",
    "on_train_start", "on_train_end", "on_train_epoch_start", "on_train_epoch_end",
    "on_train_batch_start", "on_train_batch_end",
    "on_validation_start", "on_validation_end", "on_validation_epoch_start",
    "on_validation_epoch_end", "on_validation_batch_end",
    "on_test_start", "on_test_end", "on_predict_start", "on_predict_end",
    "on_save_checkpoint", "on_load_checkpoint",
)


def problem(seed: int = 0, n_train: int = 32, n_val: int = 12) -> dict:
    """Initial weights (flax layout: kernel is inputs x outputs) and train/val examples."""
    rng = np.random.default_rng(seed)
    true_w = rng.normal(size=(4, 2))
    kernel = rng.normal(size=(4, 2)) * 0.5
    bias = rng.normal(size=2) * 0.1

    def split(n):
        x = rng.normal(size=(n, 4))
        y = x @ true_w + 0.3 * rng.normal(size=(n, 2))
        return {"x": np.round(x, 4).tolist(), "y": np.round(y, 4).tolist()}

    return {"kernel": np.round(kernel, 4).tolist(), "bias": np.round(bias, 4).tolist(),
            "train": split(n_train), "val": split(n_val)}
