"""Handwritten digits: an MLP on scikit-learn's bundled 8x8 images (offline, 1,797 examples).

The smallest complete job: it reaches about 98% validation accuracy in well under a minute on two
CPU cores, under any strategy.

    jaxlight fit digits                                   # every visible device, DataParallel
    jaxlight fit digits --strategy fsdp --devices 8      # 8 simulated CPU devices
    jaxlight fit digits --model.hidden 512 --max-epochs 30 --optim.lr 3e-3
    jaxlight fit digits --help                            # every option and its default

From Python:

    >>> from jaxlight.recipes import digits
    >>> config = digits.Config()
    >>> module, data = digits.build(config)
    >>> len(data.train.arrays["x"]), len(data.val.arrays["x"]), len(data.test.arrays["x"])
    (1297, 250, 250)
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlight.data import ArrayLoader
from jaxlight.module._module import TrainModule
from jaxlight.nn import Stacked
from jaxlight.recipes._base import Recipe, RecipeData, option, section

__all__ = ["MLP", "Config", "DigitsClassifier", "build", "load_digits"]

NUM_CLASSES = 10
NUM_PIXELS = 64


@dataclasses.dataclass
class ModelConfig:
    width: int = option(128, "residual stream width; a multiple of 8, so every sharding "
                              "splits it")
    hidden: int = option(256, "hidden units of each block's MLP (2x width, as wide as needed "
                              "for 97%)")
    num_layers: int = option(2, "residual MLP blocks in the stack; GPipe needs a multiple of "
                                "its stages")


@dataclasses.dataclass
class DataConfig:
    batch_size: int = option(64, "global batch; a multiple of 8 so 8 devices split it evenly")
    val_size: int = option(250, "validation examples held out (fixed by split_seed)")
    test_size: int = option(250, "test examples held out after the validation ones")
    split_seed: int = option(0, "seed of the fixed train/val/test permutation")


@dataclasses.dataclass
class OptimConfig:
    lr: float = option(2e-3, "peak AdamW learning rate (the schedule decays it to 10%)")
    weight_decay: float = option(1e-4, "AdamW weight decay; small, the data set is small")
    warmup_steps: int = option(20, "linear warm-up steps (one epoch)")


@dataclasses.dataclass
class Config:
    """Every setting of the digits recipe (`jaxlight fit digits --help` lists them)."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)


def _dense(din: int, dout: int, axes: tuple, *, rngs: nnx.Rngs, zero: bool = False
           ) -> nnx.Linear:
    init = nnx.initializers.zeros_init() if zero else nnx.initializers.lecun_normal()
    return nnx.Linear(din, dout, rngs=rngs, kernel_init=nnx.with_partitioning(init, axes),
                      bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), axes[1:]))


class Block(nnx.Module):
    """`x + down(relu(up(x)))`: Megatron's column-parallel `up`, row-parallel `down`."""

    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = _dense(width, hidden, ("embed", "mlp"), rngs=rngs)
        # Zero-initialized output: each block starts as the identity, so depth never hurts.
        self.down = _dense(hidden, width, ("mlp", "embed"), rngs=rngs, zero=True)

    def __call__(self, x):
        return x + self.down(nnx.relu(self.up(x)))


class MLP(nnx.Module):
    """A residual MLP: input projection, `num_layers` stacked blocks, a linear head.

    The blocks live in one `jaxlight.nn.Stacked` (a scan over a leading layer axis), so GPipe
    can split them into stages; every weight names its logical axes, so FSDP shards it and
    TensorParallel splits each block's hidden units.
    """

    def __init__(self, din: int, width: int, hidden: int, num_layers: int, dout: int, *,
                 rngs: nnx.Rngs):
        self.inp = _dense(din, width, (None, "embed"), rngs=rngs)
        self.blocks = Stacked(lambda r: Block(width, hidden, rngs=r), num_layers, rngs=rngs)
        self.head = _dense(width, dout, ("embed", None), rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.blocks(nnx.relu(self.inp(x)))))


class DigitsClassifier(TrainModule):
    """Classifies 8x8 digit images (64 pixels scaled to [0, 1]) into 10 classes.

    Args:
        width, hidden, num_layers: the residual MLP's shape.
        lr, weight_decay, warmup_steps: AdamW with linear warm-up and cosine decay.
        decay_steps: steps of the cosine decay (the fit's max_steps); None keeps the peak rate.
    """

    def __init__(self, width: int = 128, hidden: int = 256, num_layers: int = 2, lr: float = 2e-3,
                 weight_decay: float = 1e-4, warmup_steps: int = 20,
                 decay_steps: int | None = None):
        super().__init__()
        self.width, self.hidden, self.num_layers = width, hidden, num_layers
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps

    def configure_model(self, rngs: nnx.Rngs) -> nnx.Module:
        return MLP(NUM_PIXELS, self.width, self.hidden, self.num_layers, NUM_CLASSES, rngs=rngs)

    def configure_optimizers(self) -> optax.GradientTransformation:
        if self.decay_steps and self.decay_steps > self.warmup_steps:
            lr = optax.warmup_cosine_decay_schedule(0.0, self.lr, self.warmup_steps,
                                                    self.decay_steps, end_value=self.lr * 0.1)
        else:
            lr = optax.linear_schedule(0.0, self.lr, max(self.warmup_steps, 1))
        return optax.adamw(lr, weight_decay=self.weight_decay)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        return loss, {"accuracy": (logits.argmax(-1) == batch["y"]).mean()}

    def validation_step(self, model, batch):
        logits = model(batch["x"])
        return {
            "loss": optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(),
            "accuracy": (logits.argmax(-1) == batch["y"]).astype(jnp.float32).mean(),
        }

    def predict_step(self, model, batch):
        return model(batch["x"]).argmax(-1)


#: scikit-learn's copy of the UCI "Optical Recognition of Handwritten Digits" test set (CC BY
#: 4.0; 1,797 images of 8x8 pixels valued 0..16), bundled so the recipe needs neither the network
#: nor scikit-learn, whose import alone costs about a second of every run's start.
DIGITS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.npz")


def load_digits(config: DataConfig) -> dict[str, dict[str, np.ndarray]]:
    """The fixed train/val/test split of scikit-learn's digits, pixels scaled to [0, 1]."""
    with np.load(DIGITS_FILE) as raw:
        images, labels = raw["images"], raw["labels"]
    x = (images / 16.0).astype(np.float32)
    y = labels.astype(np.int32)
    order = np.random.default_rng(config.split_seed).permutation(len(y))
    n_val, n_test = config.val_size, config.test_size
    parts = {"val": order[:n_val], "test": order[n_val:n_val + n_test],
             "train": order[n_val + n_test:]}
    return {name: {"x": x[idx], "y": y[idx]} for name, idx in parts.items()}


def build(config: Config | None = None, max_steps: int | None = None
          ) -> tuple[DigitsClassifier, RecipeData]:
    """The classifier and its loaders (train shuffled per epoch; val and test in order)."""
    config = config or Config()
    split = load_digits(config.data)
    batch = config.data.batch_size
    module = DigitsClassifier(
        width=config.model.width, hidden=config.model.hidden, num_layers=config.model.num_layers,
        lr=config.optim.lr,
        weight_decay=config.optim.weight_decay, warmup_steps=config.optim.warmup_steps,
        decay_steps=max_steps,
    )
    test = ArrayLoader(split["test"], batch, shuffle=False, drop_remainder=False)
    data = RecipeData(
        train=ArrayLoader(split["train"], batch, shuffle=True, seed=config.data.split_seed),
        val=ArrayLoader(split["val"], batch, shuffle=False, drop_remainder=False),
        test=test,
        predict=test,  # predict_step reads the images only: the predicted class of each
    )
    return module, data


RECIPE = Recipe(
    name="digits",
    summary="residual MLP on scikit-learn's 8x8 digits (offline); ~98% validation accuracy",
    config=Config,
    build=build,
    # 20 steps per epoch: 15 epochs = 300 steps is past 95% with margin; validating every
    # epoch shows the curve at a cost of a few milliseconds.
    # Validation every val_check_interval steps counted across epochs (Lightning's
    # check_val_every_n_epoch=None): the interval may be longer than an epoch.
    fit_defaults={"max_steps": 300, "log_every_n_steps": 20, "val_check_interval": 60,
                  "check_val_every_n_epoch": None},
)
