"""`Stages` under `GPipe(mpmd=True)`: every stage a named call per microbatch.

While `jaxlight.strategies.GPipe(mpmd=True)` traces a step, `Stages.__call__` splits its input
into the strategy's m microbatches and calls stage s on each as a `jax.jit` function named
`jaxlight_stage_<s>`, taking that stage's own parameters (`Stages(..., packed=False)` keeps them
as separate arrays). The strategy's tracer (`jaxlight.strategies._mpmd_trace`) finds those
calls in the traced step, forward and transposed, and its runtime (`_mpmd_runtime`) runs each
on its stage's device: the stage's parameters live there and nowhere else.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlight._errors import ConfigurationError
from jaxlight.nn._pipeline import _ANY_BATCH
from jaxlight.nn._scan import remat_policy

#: The name prefix (and stage index) by which the MPMD runtime finds each stage's calls.
STAGE_PREFIX = "jaxlight_stage_"
#: The attribute `Stages(packed=False)` keeps its stage modules under; the MPMD strategy places
#: every state leaf below `<stage attribute>/<s>/...` on stage s's device.
STAGE_MODULES = "stage_modules"


def _entry(key) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def stage_index(path) -> int | None:
    """The stage a state leaf belongs to (`.../stage_modules/<s>/...`), or None."""
    names = [_entry(k) for k in path]
    for i, name in enumerate(names[:-1]):
        if name == STAGE_MODULES and isinstance(names[i + 1], int):
            return names[i + 1]
    return None


@dataclasses.dataclass
class MpmdConfig:
    """What `Stages` needs while `GPipe(mpmd=True)` traces a step.

    Attributes:
        devices: pipeline devices p.
        microbatches: microbatches m each batch is split into.
        remat: recompute each stage in the backward pass (store only its input).
        calls: `Stages` blocks that ran in this trace (0 after tracing: nothing pipelined).
    """

    devices: int
    microbatches: int
    remat: bool = False
    calls: int = 0


_ACTIVE: contextvars.ContextVar[MpmdConfig | None] = contextvars.ContextVar(
    "jaxlight_mpmd", default=None)


@contextlib.contextmanager
def mpmd_context(config: MpmdConfig) -> Iterator[MpmdConfig]:
    """Makes every `Stages` traced inside call its stages as named per-microbatch calls."""
    token = _ACTIVE.set(config)
    try:
        yield config
    finally:
        _ACTIVE.reset(token)


def active_mpmd() -> MpmdConfig | None:
    """The MPMD pipeline of the step being traced, or None."""
    return _ACTIVE.get()


def stage_call(module: nnx.Module, index: int, remat: Any = False,
               store_input_only: bool = False):
    """`(fn, params)`: `fn(params, x)` applies stage `index`, as a jit named for the runtime."""
    graphdef, params = nnx.split(module)
    rematerialize, policy = remat_policy(remat)
    dtypes = jax.tree.map(lambda v: v.dtype, params)
    # Floating parameters enter the call as float32 (cast back inside), so that the gradient
    # of each microbatch leaves the call as float32 and the microbatches' gradients sum in
    # float32, as callbacks.Microbatches sums them (bf16-mixed would otherwise add bf16).
    params = jax.tree.map(_widen, params)

    def body(params, x):
        params = jax.tree.map(lambda v, d: v.astype(d), params, dtypes)
        return nnx.merge(graphdef, params)(x)

    if rematerialize:
        body = jax.checkpoint(body, policy=policy)
    if store_input_only:
        body = jax.checkpoint(body, prevent_cse=False)

    def call(params, x):
        return body(params, x)

    call.__name__ = call.__qualname__ = f"{STAGE_PREFIX}{index}"
    return jax.jit(call), params


def _widen(v):
    if jnp.issubdtype(v.dtype, jnp.floating) and jnp.finfo(v.dtype).bits < 32:
        return v.astype(jnp.float32)
    return v


def run_mpmd(modules: list, remat: Any, config: MpmdConfig, x: Any) -> Any:
    """Applies `modules` in order to m microbatches of `x`, each stage a named call."""
    config.calls += 1
    n = len(modules)
    if n % config.devices:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ConfigurationError(
            f"Stages has {n} stages, which do not split into {config.devices} pipeline "
            f"devices. Use GPipe(stages=...) dividing {n} ({divisors}) or a multiple of "
            f"{config.devices} stage modules.")
    leaves = jax.tree.leaves(x)
    batch = leaves[0].shape[0]
    m = config.microbatches
    if batch % m:
        if not _ANY_BATCH.get():
            raise ConfigurationError(
                f"GPipe(mpmd=True): the batch reaching Stages has {batch} examples, which do "
                f"not split into {m} microbatches. Use a batch size that is a multiple of {m}, "
                "or change microbatches.")
        m = 1  # an evaluation batch of any size runs as one microbatch
    calls = [stage_call(mod, s, remat, config.remat) for s, mod in enumerate(modules)]
    size = batch // m
    # Every microbatch sliced first (one program on the first device), then the stage calls.
    inputs = [jax.tree.map(lambda v, i=i: jax.lax.slice_in_dim(v, i * size, (i + 1) * size), x)
              for i in range(m)]
    outs = []
    for h in inputs:
        for fn, params in calls:
            h = fn(params, h)
        outs.append(h)
    return jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=0), *outs)


__all__ = ["STAGE_MODULES", "STAGE_PREFIX", "MpmdConfig", "active_mpmd", "mpmd_context",
           "run_mpmd", "stage_call", "stage_index"]
