"""Small modules shared by tests."""

import numpy as np
import optax
from flax import nnx

import jaxlight as jl


def saves_checkpoints(cbs) -> bool:
    """`Fit(enable_checkpointing=...)` for a test fit: only when the test gives a
    ModelCheckpoint among `cbs` (jaxlight, as Lightning, refuses False beside one); the default
    checkpoint's save and wait are not the subject of these tests."""
    return any(isinstance(cb, jl.callbacks.ModelCheckpoint) for cb in cbs)


class MLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(din, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class Classifier(jl.TrainModule):
    """An MLP classifier on synthetic data; deterministic (no dropout)."""

    def __init__(self, din: int = 16, hidden: int = 32, classes: int = 4, lr: float = 1e-2):
        super().__init__()
        self.din, self.hidden, self.classes, self.lr = din, hidden, classes, lr

    def configure_model(self, rngs):
        return MLP(self.din, self.hidden, self.classes, rngs=rngs)

    def configure_optimizers(self):
        return optax.adam(self.lr)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    def validation_step(self, model, batch):
        logits = model(batch["x"])
        return {
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(),
            "accuracy": (logits.argmax(-1) == batch["y"]).mean(),
        }


def classification_data(n: int = 512, din: int = 16, classes: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, din)).astype(np.float32)
    y = x[:, :classes].argmax(-1).astype(np.int32)
    return {"x": x, "y": y}


class Linear(jl.TrainModule):
    """The smallest module: `nnx.Linear(d_in, d_out)`, SGD, and in every step the squared
    error to `batch["y"]` (to 1.0 without it)."""

    def __init__(self, d_in: int = 4, d_out: int = 1, lr: float = 0.1):
        super().__init__()
        self.d_in, self.d_out, self.lr = d_in, d_out, lr

    def configure_model(self, rngs):
        return nnx.Linear(self.d_in, self.d_out, rngs=rngs)

    def configure_optimizers(self):
        return optax.sgd(self.lr)

    def squared_error(self, model, batch):
        return ((model(batch["x"]) - batch.get("y", 1.0)) ** 2).mean()

    def training_step(self, model, batch):
        return self.squared_error(model, batch)

    def validation_step(self, model, batch):
        return {"loss": self.squared_error(model, batch)}

    test_step = validation_step

    def predict_step(self, model, batch):
        return model(batch["x"])
