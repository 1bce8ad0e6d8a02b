"""Small modules for the optimizer tests: a partitioned optax transformation on an annotated,
stacked model (so every strategy, GPipe and tensor parallelism included, really shards it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from jaxlight import nn
from tests.models import Classifier


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.dense = nn.Dense(8, 8, axes=("embed", "mlp"), use_bias=True, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x))


class StackNet(nnx.Module):
    def __init__(self, rngs):
        self.inp = nn.Dense(4, 8, axes=("norm", "embed"), use_bias=True, rngs=rngs)
        self.blocks = nn.Stacked(_Block, 4, rngs=rngs)
        self.out = nn.Dense(8, 2, axes=("embed", "norm"), rngs=rngs)

    def __call__(self, x):
        return self.out(self.blocks(self.inp(x)))


def partitioned_tx(lr: float = 0.05) -> optax.GradientTransformation:
    """optax.partition over the top-level sub-modules; the edges' optimizer holds Adam moments
    for 1-d parameters only (optax.masked with a stateful inner transform) and a momentum
    trace for every edge parameter."""
    def labels(params):
        return {k: jax.tree.map(lambda _, k=k: "blocks" if k == "blocks" else "edges", v)
                for k, v in params.items()}

    def vectors(params):
        return jax.tree.map(lambda p: p.ndim == 1, params)

    return optax.partition(
        {"blocks": optax.adamw(lr, weight_decay=0.01),
         "edges": optax.chain(optax.masked(optax.scale_by_adam(), vectors),
                              optax.trace(0.5), optax.scale(-lr))},
        labels)


class PartitionedRegression(jl.TrainModule):
    def configure_model(self, rngs):
        return StackNet(rngs)

    def configure_optimizers(self):
        return partitioned_tx()

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def regression_batches(steps: int, batch: int = 16, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(4, 2)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(batch, 4)).astype(np.float32)
        out.append({"x": x, "y": np.tanh(x @ w)})
    return out


class PartitionedClassifier(Classifier):
    """tests.models.Classifier with optax.multi_transform: Adam on l1, masked momentum on l2."""

    def configure_optimizers(self):
        def labels(params):
            return {"l1": jax.tree.map(lambda _: "adam", params["l1"]),
                    "l2": jax.tree.map(lambda _: "sgd", params["l2"])}

        kernels = lambda p: jax.tree.map(lambda x: x.ndim == 2, p)  # noqa: E731
        return optax.multi_transform(
            {"adam": optax.adam(self.lr),
             "sgd": optax.chain(optax.masked(optax.trace(0.9), kernels), optax.scale(-0.1))},
            labels)
