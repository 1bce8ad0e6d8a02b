"""`Strategy.step_input`: what the loop's own thread hands a compiled step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxlight import strategies
from jaxlight._fit._session import abstract_global_batch


def _batch():
    return {"x": np.arange(64, dtype=np.float32).reshape(16, 4), "y": np.arange(16, dtype=np.int32)}


@pytest.mark.parametrize("make", [strategies.SingleDevice, strategies.DataParallel,
                                  strategies.FSDP])
def test_spmd_hands_numpy_batches_to_the_step_as_they_are(make):
    strategy = make()
    strategy.setup()
    batch = _batch()
    sh = strategy.batch_shardings(abstract_global_batch(batch))
    assert strategy.step_input(batch, sh) is batch  # the compiled call places it

    # The compiled step places the host arrays as device_put would: same values, same layout.
    step = jax.jit(lambda b: jax.tree.map(lambda v: v * 2, b), in_shardings=(sh,),
                   out_shardings=sh).lower(abstract_global_batch(batch)).compile()
    from_host, from_put = step(batch), step(strategy.put_batch(batch, sh))
    for key in batch:
        np.testing.assert_array_equal(np.asarray(from_host[key]), np.asarray(from_put[key]))
        assert from_host[key].sharding == from_put[key].sharding == sh[key]


def test_spmd_puts_a_batch_with_other_leaves():
    strategy = strategies.DataParallel()
    strategy.setup()
    batch = dict(_batch(), y=jax.numpy.arange(16, dtype=np.int32))  # one leaf on a device
    sh = strategy.batch_shardings(abstract_global_batch(batch))
    got = strategy.step_input(batch, sh)
    assert all(isinstance(v, jax.Array) and v.sharding == sh[k] for k, v in got.items())


def test_ddp_hands_the_step_its_per_device_view():
    strategy = strategies.DDP()
    strategy.setup()
    batch = _batch()
    sh = strategy.batch_shardings(abstract_global_batch(batch))
    got = strategy.step_input(batch, sh)
    n = len(strategy.devices)
    assert got["x"].shape == (n, 16 // n, 4)
    np.testing.assert_array_equal(np.asarray(got["x"]).reshape(16, 4), batch["x"])
