"""The context-parallel runs the tests train, kill and resume (shared with `_context_child.py`)."""

from __future__ import annotations

import numpy as np

import jaxlight as jl
from tests.strategies.lm import TinyLM, token_batches

#: Tokens per example: the model sees LENGTH - 1 = 64 positions, 8 per device at context=8.
LENGTH = 65
BATCH = 4


def context_data(steps: int) -> jl.data.ArrayLoader:
    """A resumable loader of `steps` batches of learnable token sequences."""
    batches = token_batches(steps, batch=BATCH, length=LENGTH)
    return jl.data.ArrayLoader({"tokens": np.concatenate([b["tokens"] for b in batches])},
                               BATCH, seed=1)


def context_module() -> TinyLM:
    return TinyLM(heads=2)
