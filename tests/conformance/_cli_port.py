"""Group `cli`'s jaxlight side of Lightning's backbone example
(`examples/pytorch/basics/backbone_image_classifier.py`), as docs/cli.md ports it, at the scale of
`_cli_problem`: the command line builds these classes from the config Lightning wrote, and
`configure_model` starts from the problem's initial weights (Lightning's copy starts from the
same)."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from _cli_problem import problem
from flax import nnx

import jaxlight as jl

PROB = problem()


class Net(nnx.Module):
    def __init__(self, hidden_dim: int, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(64, hidden_dim, rngs=rngs)
        self.l2 = nnx.Linear(hidden_dim, 10, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return nnx.relu(self.l2(nnx.relu(self.l1(x))))


class Backbone:
    """The backbone's settings; `build` makes the module inside `configure_model`."""

    def __init__(self, hidden_dim: int = 128):
        self.hidden_dim = hidden_dim

    def build(self, rngs: nnx.Rngs) -> nnx.Module:
        return Net(self.hidden_dim, rngs)


class LitClassifier(jl.TrainModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 0.0001):
        super().__init__()
        self.backbone = backbone or Backbone()
        self.learning_rate = learning_rate

    def configure_model(self, rngs):
        net = self.backbone.build(rngs)
        for name in ("l1", "l2"):
            layer = getattr(net, name)
            layer.kernel.value = jnp.asarray(PROB["init"][name]["kernel"])
            layer.bias.value = jnp.asarray(PROB["init"][name]["bias"])
        return net

    def training_step(self, model, batch):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]),
                                                               batch["y"]).mean()
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, model, batch):
        loss = optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]),
                                                               batch["y"]).mean()
        self.log("valid_loss", loss)

    def configure_optimizers(self):
        return optax.adam(self.learning_rate)


class MyDataModule(jl.DataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return jl.data.ArrayLoader(PROB["train"], self.batch_size, shuffle=False)

    def val_dataloader(self):
        return jl.data.ArrayLoader(PROB["val"], self.batch_size, shuffle=False)
