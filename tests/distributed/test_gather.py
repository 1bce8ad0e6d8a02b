"""`jaxlight.distributed.gather` in one process (8 devices): it is `jax.device_get`, for pytrees
and nnx Modules alike. test_multiprocess.py checks it on 2 processes, after an FSDP fit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlight as jl


class Tied(nnx.Module):
    """A Linear layer reached twice (tied), and an RNG stream."""

    def __init__(self, rngs):
        self.encode = nnx.Linear(4, 8, rngs=rngs)
        self.decode = self.encode
        self.rngs = nnx.Rngs(dropout=1)

    def __call__(self, x):
        return self.decode(x) * 2


def _sharded_model() -> Tied:
    """The model with its kernel split over the 8 devices, as FSDP lays it out."""
    model = Tied(nnx.Rngs(0))
    mesh = jax.make_mesh((8,), ("fsdp",))
    kernel = model.encode.kernel
    kernel.set_value(jax.device_put(kernel[...], NamedSharding(mesh, P(None, "fsdp"))))
    return model


def test_gather_is_device_get_on_one_process():
    tree = {"w": jax.device_put(jnp.arange(32.0).reshape(8, 4),
                                NamedSharding(jax.make_mesh((8,), ("fsdp",)), P("fsdp"))),
            "step": 3, "name": "run", "key": jax.random.key(0)}
    host = jl.distributed.gather(tree)
    # The very array jax.device_get returns (cached on the jax.Array): no copy beyond it.
    assert host["w"] is jax.device_get(tree["w"])
    np.testing.assert_array_equal(host["w"], np.arange(32.0).reshape(8, 4))
    assert host["step"] == 3 and host["name"] == "run"
    assert jax.dtypes.issubdtype(host["key"].dtype, jax.dtypes.prng_key)


def test_gather_copies_a_module_to_numpy():
    model = _sharded_model()
    assert len(model.encode.kernel[...].sharding.device_set) == 8
    host = jl.distributed.gather(model)
    assert isinstance(host, Tied) and host is not model
    leaves = jax.tree.leaves(nnx.state(host, nnx.Param))
    assert {type(x) for x in leaves} == {np.ndarray}
    np.testing.assert_array_equal(host.encode.kernel[...], np.asarray(model.encode.kernel[...]))
    assert host.decode is host.encode  # the graph is kept: tied layers stay one
    assert jax.dtypes.issubdtype(host.rngs.dropout.key[...].dtype, jax.dtypes.prng_key)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(host(x), model(x), rtol=1e-6)
