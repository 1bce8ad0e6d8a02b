"""GroupTransfer: k loader batches as one step input, the full group's weights sent once."""

from __future__ import annotations

import jax
import numpy as np

from jaxlight.step._microbatch import Accumulated, GroupTransfer, stack_batches


def _batches(n: int, rows: int = 3):
    return [{"x": np.full((rows, 2), i, np.float32), "y": np.arange(rows) + 10 * i}
            for i in range(n)]


def _shardings(batches, k):
    device = jax.devices()[0]
    return jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(device),
                        stack_batches(batches, k))


def test_full_groups_transfer_their_weights_once_and_short_groups_their_own():
    puts = []

    def put(tree, shardings):
        puts.append(tree)
        return jax.device_put(tree, shardings)

    transfer, k = GroupTransfer(put), 4
    sh = _shardings(_batches(k), k)
    first = transfer(_batches(k), k, sh)
    second = transfer(_batches(k), k, sh)
    assert isinstance(first, Accumulated)
    assert second.weight is first.weight  # the device array of ones is reused
    assert len(puts) == 3  # the ones once, then a stacked batch per group
    np.testing.assert_array_equal(np.asarray(first.weight), np.ones(3 * k, np.float32))

    short = transfer(_batches(2), k, sh)  # an epoch's last group: 2 real batches of 4
    want = stack_batches(_batches(2), k)
    np.testing.assert_array_equal(np.asarray(short.weight), want.weight)
    np.testing.assert_array_equal(np.asarray(short.weight), np.tile([1, 1, 0, 0], 3))
    for got, expected in zip(jax.tree.leaves(short.batch), jax.tree.leaves(want.batch),
                             strict=True):
        np.testing.assert_array_equal(np.asarray(got), expected)
    # Row j of loader batch i sits at row j*k + i.
    np.testing.assert_array_equal(np.asarray(first.batch["x"])[:, 0],
                                  np.tile(np.arange(k), 3).astype(np.float32))
