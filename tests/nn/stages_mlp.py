"""The seeds' pipeline MLP (784→512→256→10, here scaled down) as `jaxlight.nn.Stages`.

Shared by tests/nn/test_stages.py and its SIGKILL child process.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from jaxlight import nn

DIMS = (48, 32, 16, 10)  # the seeds' 784, 512, 256, 10, scaled down for the test machine


class StageMLP(jl.TrainModule):
    """Three Linear stages (ReLU between); `stages=4` adds a parameter-free log-softmax stage."""

    def __init__(self, stages: int = 3, dims: tuple = DIMS, lr: float = 1e-2,
                 balance: bool = False, packed: bool = True):
        super().__init__()
        self.stages, self.dims, self.lr, self.balance = stages, tuple(dims), lr, balance
        self.packed = packed

    def configure_model(self, rngs):
        d = self.dims
        parts = [nnx.Sequential(nnx.Linear(d[0], d[1], rngs=rngs), nnx.relu),
                 nnx.Sequential(nnx.Linear(d[1], d[2], rngs=rngs), nnx.relu),
                 nnx.Linear(d[2], d[3], rngs=rngs)]
        if self.stages == 4:
            parts.append(nnx.Sequential(jax.nn.log_softmax))
        return nn.Stages(parts, balance=self.balance, packed=self.packed)

    def configure_optimizers(self):
        return optax.adamw(self.lr)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def stage_data(examples: int, din: int = DIMS[0], seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(examples, din)).astype(np.float32),
            "y": rng.integers(0, DIMS[-1], size=(examples,)).astype(np.int32)}
