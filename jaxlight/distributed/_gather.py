"""Reading arrays that span processes on the host: `gather`, a `jax.device_get` for any job.

After a multi-process fit, `module.model` holds global arrays laid out by the strategy. Under
FSDP (or any layout that splits a parameter across processes) no process holds a whole
parameter, so `jax.device_get`, `np.asarray` and `nnx.state(...)` printing refuse it with JAX's
"Fetching value for `jax.Array` that spans non-addressable (non process local) devices is not
possible". `gather` returns the whole value on every process instead.
"""

from __future__ import annotations

from typing import TypeVar

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jaxlight._errors import ConfigurationTypeError

T = TypeVar("T")


def gather(tree: T) -> T:
    """The whole value of every array in `tree`, as NumPy, on every process.

    `jax.device_get` for a job of any size: `tree` is any pytree of arrays (a dict of
    parameters, an `nnx.State`) or an `nnx.Module`, whose copy it returns (same graph, every
    array a NumPy array; call it or read `nnx.state(copy)`). Leaves that are not JAX arrays are
    returned as they are, typed PRNG keys as key arrays, as `jax.device_get` does.

    **A collective: every process must call it, with the same tree.** A parameter split across
    processes (FSDP) is all-gathered, one array at a time, so the extra device memory is the
    largest such array, replicated; an array replicated on every device (DataParallel's
    parameters) is copied from a local device without communication. With one process
    it is `jax.device_get(tree)` and copies nothing more.

    Example:
        >>> import jaxlight as jl, jax.numpy as jnp
        >>> host = jl.distributed.gather({"w": jnp.ones((2, 3))})
        >>> type(host["w"]).__name__, host["w"].shape
        ('ndarray', (2, 3))
    """
    _refuse_train_module(tree)
    if isinstance(tree, nnx.Module):
        graphdef, state = nnx.split(tree)
        return nnx.merge(graphdef, gather(state))
    if jax.process_count() == 1:
        return jax.device_get(tree)
    return jax.tree.map(_whole, tree)


def _refuse_train_module(tree) -> None:
    """A TrainModule is a pytree leaf, so it would come back unchanged, arrays on device."""
    names = {c.__name__ for c in type(tree).__mro__}
    if "TrainModule" in names:
        raise ConfigurationTypeError(
            f"jaxlight.distributed.gather got a {type(tree).__name__} (a TrainModule), which "
            "holds its arrays in its model, not as pytree leaves: it would come back unchanged, "
            "on the devices. Gather the model: jaxlight.distributed.gather(module.model) (or "
            "its state, nnx.state(module.model))."
        )


def _whole(x):
    """One leaf on the host, whole (the leaf's sharding, the same on every process, decides
    whether this is a collective, so every process takes the same branch)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return jax.device_get(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # gathered as its raw key data
        return jax.random.wrap_key_data(_whole(jax.random.key_data(x)),
                                        impl=jax.random.key_impl(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
