"""Shared pieces of the checkpoint tests (also imported by the `_child.py` subprocess)."""

from __future__ import annotations

import contextlib
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from jaxlight import strategies
from tests.models import Classifier, classification_data

BATCH = 32
EXAMPLES = 256  # 8 batches per epoch


def make_strategy(name: str):
    # min_shard_size=1: the tiny test model's parameters really are sharded under FSDP.
    return {
        "single": strategies.SingleDevice,
        "dp": strategies.DataParallel,
        "fsdp": lambda: strategies.FSDP(min_shard_size=1),
        "ddp": strategies.DDP,
        "hybrid": lambda: strategies.Hybrid({"data": 4, "tp": 2}, min_shard_size=1),
        "data2_expert4": lambda: strategies.Hybrid({"data": 2, "expert": 4}),
    }[name]()


def make_fit(strategy: str, max_steps: int, callbacks=(), **kw) -> jl.Fit:
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("enable_model_summary", False)
    kw.setdefault("logger", False)
    return jl.Fit(make_strategy(strategy), max_steps=max_steps, callbacks=list(callbacks), **kw)


def loader(seed: int = 1) -> jl.data.ArrayLoader:
    return jl.data.ArrayLoader(classification_data(EXAMPLES), BATCH, seed=seed)


class SlowBatches:
    """A generic re-iterable (no len, no state_dict): resumes by skipping consumed batches."""

    def __init__(self, delay: float = 0.0):
        data = classification_data(EXAMPLES)
        self.batches = [{k: v[i:i + BATCH] for k, v in data.items()}
                        for i in range(0, EXAMPLES, BATCH)]
        self.delay = delay

    def __iter__(self):
        for batch in self.batches:
            if self.delay:
                time.sleep(self.delay)
            yield batch


class Annotated(nnx.Module):
    """An MLP with logical axes, so that FSDP and tensor parallelism really shard it."""

    def __init__(self, din, hidden, dout, *, rngs):
        init = nnx.initializers.lecun_normal()
        self.l1 = nnx.Linear(din, hidden, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)),
                             rngs=rngs)
        self.l2 = nnx.Linear(hidden, dout,
                             kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class AnnotatedClassifier(Classifier):
    def __init__(self, din: int = 16, hidden: int = 32, classes: int = 8, lr: float = 1e-2):
        super().__init__(din, hidden, classes, lr)

    def configure_model(self, rngs):
        return Annotated(self.din, self.hidden, self.classes, rngs=rngs)


class DropoutClassifier(Classifier):
    """Has RNG state (a typed PRNG key and a counter) in `rest`: resume must restore it."""

    def configure_model(self, rngs):
        class Net(nnx.Module):
            def __init__(self, din, hidden, dout, rngs):
                self.l1 = nnx.Linear(din, hidden, rngs=rngs)
                self.drop = nnx.Dropout(0.5, rngs=rngs)
                self.l2 = nnx.Linear(hidden, dout, rngs=rngs)

            def __call__(self, x):
                return self.l2(self.drop(nnx.relu(self.l1(x))))

        return Net(self.din, self.hidden, self.classes, rngs)

    def configure_optimizers(self):
        return optax.adam(self.lr)


def params_of(model) -> dict:
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def assert_bitwise(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


@contextlib.contextmanager
def backend_compiles():
    """A list of the XLA compiles (backend_compile events) made inside the block, with the
    persistent compilation cache off so that every program this process has not compiled counts."""
    compiles: list[str] = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    cache = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.config.update("jax_enable_compilation_cache", cache)
