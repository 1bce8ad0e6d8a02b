"""A stack of 8 residual dense blocks for the interleaved-schedule tests (and their child)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from jaxlight import nn

WIDTH, LAYERS, BATCH = 8, 8, 16


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.dense = nn.Dense(WIDTH, WIDTH, axes=("embed", "mlp"), use_bias=True, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x))


class _Net(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(4, WIDTH, rngs=rngs)
        self.blocks = nn.Stacked(_Block, LAYERS, rngs=rngs)
        self.out = nnx.Linear(WIDTH, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.blocks(self.inp(x)))


class Regression(jl.TrainModule):
    def configure_model(self, rngs):
        return _Net(rngs)

    def configure_optimizers(self):
        return optax.adam(1e-2)

    def training_step(self, model, batch):
        return ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean()

    def validation_step(self, model, batch):
        return {"loss": ((model(batch["x"])[:, 0] - batch["y"]) ** 2).mean()}


def regression_data(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(BATCH, 4)).astype(np.float32),
             "y": rng.normal(size=(BATCH,)).astype(np.float32)} for _ in range(steps)]
