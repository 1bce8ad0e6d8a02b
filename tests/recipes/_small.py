"""Small configs of every recipe, for tests that only need a few steps to run."""

from __future__ import annotations

import jaxlight as jl
from jaxlight import strategies
from jaxlight.recipes import digits, gpt, sft
from jaxlight.recipes._base import apply_overrides

#: A transformer small enough to compile in seconds; 2 layers split into GPipe(2) stages.
TINY_LM = {"model.num_layers": 2, "model.embed_dim": 32, "model.num_heads": 2,
           "model.mlp_dim": 64}

SMALL = {
    "digits": (digits, {"model.width": 32, "model.hidden": 32}),
    "gpt": (gpt, {**TINY_LM, "data.max_train_bytes": 100_000, "data.val_windows": 16,
                  "data.batch_size": 16, "data.seq_len": 16}),
    # Equal-length words: every example has the same number of answer tokens, so DDP's mean of
    # per-replica masked means equals the global masked mean.
    "sft": (sft, {**TINY_LM, "base.pretrain_steps": 0, "task.min_len": 3, "task.max_len": 3,
                  "task.train_examples": 64, "task.val_examples": 16, "data.batch_size": 16}),
}

#: Every strategy, by the name the command line uses, with a configuration for 8 devices.
STRATEGIES = {
    "single": strategies.SingleDevice,
    "ddp": strategies.DDP,
    "dp": strategies.DataParallel,
    "fsdp": strategies.FSDP,
    "tp": lambda: strategies.TensorParallel(2),
    "gpipe": lambda: strategies.GPipe(stages=2, microbatches=2),
    "hybrid": lambda: strategies.Hybrid({"data": 2, "fsdp": 2, "tp": 2}),
}


def small(recipe: str, **overrides):
    """(recipe module, config) of a small variant of `recipe`."""
    module, base = SMALL[recipe]
    return module, apply_overrides(module.Config(), {**base, **overrides}, "test")


def quiet_fit(strategy="single", **kwargs) -> jl.Fit:
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_model_summary", False)
    kwargs.setdefault("logger", False)
    if not any(isinstance(cb, jl.callbacks.ModelCheckpoint)
               for cb in kwargs.get("callbacks", ())):
        kwargs.setdefault("enable_checkpointing", False)  # no default saves where none is read
    return jl.Fit(strategy, **kwargs)

