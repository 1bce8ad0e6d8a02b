"""The jaxlight side of the conformance problems: the same regression, loaders and recorder
as `lightning_side/_common.py`, built from the numbers stored in a fixture."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from tests.conformance._cases import fixture
from tests.conformance._problem import COMPARED_HOOKS

RTOL = 1e-5


class Batches:
    """A loader: each `iter()` is a fresh pass over fixed dict batches, in order."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return iter(self.items)


def batches(group: str, key: str = "train", batch_size: int = 4) -> Batches:
    prob = fixture(group)["problem"]
    x, y = (np.asarray(prob[key][k], np.float32) for k in ("x", "y"))
    return Batches([{"x": x[i:i + batch_size], "y": y[i:i + batch_size]}
                    for i in range(0, len(x), batch_size)])


class Passes:
    """The k-th pass yields one batch whose "score" is `values[k]` (lightning_side's twin)."""

    def __init__(self, values, x):
        self.values, self.x, self.passes = list(values), np.asarray(x, np.float32), 0

    def __len__(self):
        return 1

    def __iter__(self):
        value = self.values[min(self.passes, len(self.values) - 1)]
        self.passes += 1
        yield {"x": self.x, "y": self.x[:, :2] * 0,
               "score": np.full((len(self.x),), value, np.float32)}


def _mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


class Reg(jl.TrainModule):
    """lightning_side's `Reg`: linear 4 -> 2, MSE, the fixture's initial weights."""

    def __init__(self, group: str = "hooks", optimizer: str = "sgd", lr: float = 0.1,
                 log_train: bool = True):
        super().__init__()
        self.group, self.optimizer, self.lr, self.log_train = group, optimizer, lr, log_train

    def configure_model(self, rngs):
        prob = fixture(self.group)["problem"]
        layer = nnx.Linear(4, 2, rngs=rngs)
        layer.kernel.value = jnp.asarray(prob["kernel"], jnp.float32)
        layer.bias.value = jnp.asarray(prob["bias"], jnp.float32)
        return layer

    def make_optimizer(self, lr):
        return {"sgd": optax.sgd, "adam": optax.adam}[self.optimizer](lr)

    def configure_optimizers(self):
        return self.make_optimizer(self.lr)

    def training_step(self, model, batch):
        loss = _mse(model, batch)
        if self.log_train:
            self.log("train_loss", loss)
        if "score" in batch:
            self.log("train_score", batch["score"].mean(), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, model, batch):
        self.log("val_loss", _mse(model, batch))
        if "score" in batch:
            self.log("val_score", batch["score"].mean())

    def test_step(self, model, batch):
        self.log("test_loss", _mse(model, batch))

    def predict_step(self, model, batch):
        return model(batch["x"])


def weights(module) -> dict:
    return {"kernel": np.asarray(module.model.kernel.value),
            "bias": np.asarray(module.model.bias.value)}


def assert_weights(module, expected: dict) -> None:
    """Equal to RTOL relative to each array's scale (float32 sums in another order, and Adam's
    division by small second moments, differ by a few ulps of the largest entry)."""
    got = weights(module)
    for name in ("kernel", "bias"):
        want = np.asarray(expected[name], np.float32)
        np.testing.assert_allclose(got[name], want, rtol=RTOL,
                                   atol=RTOL * float(np.abs(want).max()), err_msg=name)


def _entry(name, args, kind):
    if name in ("setup", "teardown"):
        return f"{kind}{name}:{args[-1]}"
    if name in ("on_train_batch_start", "on_train_batch_end", "on_validation_batch_end"):
        return f"{kind}{name}:{args[-1]}"
    return f"{kind}{name}"


class Recorder(callbacks.Callback):
    """Appends "Callback.<hook>" (":batch_idx" / ":stage") for every compared hook."""

    def __init__(self, calls):
        self.calls = calls


class HookedReg(Reg):
    """Reg recording its own hooks into `self.calls` (set after construction)."""

    calls = None


def _callback_hook(name):
    def hook(self, fit, module, *args):
        self.calls.append(_entry(name, args, "Callback."))

    return hook


def _module_hook(name):
    def hook(self, *args):
        if self.calls is not None:
            self.calls.append(_entry(name, args, ""))

    return hook


for _name in COMPARED_HOOKS:
    setattr(Recorder, _name, _callback_hook(_name))
    # Lightning's LightningModule has no sanity-check hooks (its Callback has): jaxlight's
    # module hooks of those names are extra and not compared.
    if "sanity" not in _name:
        setattr(HookedReg, _name, _module_hook(_name))


def hooked(group: str = "hooks", **kw) -> tuple[list, HookedReg]:
    calls: list = []
    module = HookedReg(group, **kw)
    object.__setattr__(module, "calls", calls)
    return calls, module


def make_fit(**kw) -> jl.Fit:
    """`Fit` with Lightning-side `trainer()`'s settings: one device, no bar, summary, logger
    or sanity check unless a case asks."""
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("enable_model_summary", False)
    kw.setdefault("logger", False)
    kw.setdefault("num_sanity_val_steps", 0)
    # As trainer(): the default checkpoint only where a case gives a ModelCheckpoint.
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, callbacks.ModelCheckpoint) for cb in kw.get("callbacks", [])))
    return jl.Fit("single", **kw)
