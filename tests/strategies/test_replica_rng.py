"""Dropout under per-replica gradient layouts (issue 17 item 4).

DDP, FSDP's gather-once layout and accumulation under SPMD run the step once per replica on its
rows. Every replica used to draw the same mask for its rows; now each draws its rows of the
single-device draw (jaxlight/sharding/_replica_rng.py), so masks differ across replicas and the run
equals the single-device run with the same global batch and accumulation.

The probe reads the masks back exactly: `w[p] -= lr · d loss / d w[p]` with a loss that picks
global row `rows[p]` of the masked ones, and `lr = B · keep`, subtracts `mask[rows[p]]` per step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks

B, F, KEEP = 32, 64, 0.5
PROBE_ROWS = (0, 1, 4, 5, 8, 13, 16, 31)  # the first rows of replicas 0, 1, 2, 4 of 8, and more


class Probe(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jnp.zeros((len(PROBE_ROWS), F)))
        self.wb = nnx.Param(jnp.zeros((len(PROBE_ROWS), F)))
        self.drop = nnx.Dropout(1 - KEEP, rngs=rngs)  # a mask per example
        self.drop_b = nnx.Dropout(1 - KEEP, broadcast_dims=(0,), rngs=rngs)  # one for the batch

    def __call__(self, pick):
        ones = jnp.ones((pick.shape[0], F))
        # (rows, P) · (rows, F) -> (P, F): row p holds the mask of the picked global row.
        return (jnp.einsum("rp,rf,pf->r", pick, self.drop(ones), self.w)
                + jnp.einsum("rp,rf,pf->r", pick, self.drop_b(ones), self.wb))


class ProbeModule(jl.TrainModule):
    def configure_model(self, rngs):
        return Probe(rngs)

    def configure_optimizers(self):
        return optax.sgd(B * KEEP)

    def training_step(self, model, batch):
        return model(batch["pick"]).mean()


def _batch():
    pick = np.zeros((B, len(PROBE_ROWS)), np.float32)
    pick[list(PROBE_ROWS), range(len(PROBE_ROWS))] = 1.0
    return {"pick": pick}


def _run(strategy, k):
    """Two steps: `w = -(mask of step 0 + mask of step 1)` for the probed rows; and the dropout
    stream's key and counter after them."""
    module = ProbeModule()
    jl.Fit(strategy, max_steps=2, callbacks=[callbacks.Microbatches(k)] if k > 1 else [],
           enable_progress_bar=False, enable_checkpointing=False,
           enable_model_summary=False, logger=False).fit(module, [_batch()] * 2)
    model = module.model
    return {"per_example": -np.asarray(jax.device_get(model.w[...])),
            "broadcast": -np.asarray(jax.device_get(model.wb[...])),
            "key": np.asarray(jax.random.key_data(model.drop.rngs.key[...])),
            "count": int(model.drop.rngs.count[...])}


@pytest.fixture(scope="module")
def single():
    return {k: _run("single", k) for k in (1, 2)}


def test_single_device_draws_differ_per_example(single):
    for k in (1, 2):
        run = single[k]
        assert len({row.tobytes() for row in run["per_example"]}) == len(PROBE_ROWS)
        # One broadcast mask per microbatch; microbatch i holds the rows i mod k.
        for p, row in enumerate(PROBE_ROWS):
            first = PROBE_ROWS.index(row % k)
            np.testing.assert_array_equal(run["broadcast"][p], run["broadcast"][first])
        assert run["count"] == 2 * k  # one draw per microbatch


@pytest.mark.parametrize("strategy, k", [
    ("fsdp", 1),   # gather-once layout: shard_map over 8 replicas
    ("fsdp", 2),   # accumulation under FSDP: per-replica scan over 2 microbatches
    ("ddp", 1),    # pmap
    ("ddp", 2),    # pmap, scan over each replica's 2 microbatches
    ("hybrid", 2), # batch over two mesh axes: replica index (data, fsdp), data major
])
def test_per_replica_layouts_draw_the_single_device_masks(strategy, k, single):
    if strategy == "hybrid":
        strategy = jl.strategies.Hybrid({"data": 2, "fsdp": 4})
    run = _run(strategy, k)
    # Rows 0, 4, 8, 16 start replicas 0, 1, 2, 4: their masks differ (before: all equal).
    assert len({row.tobytes() for row in run["per_example"]}) == len(PROBE_ROWS)
    np.testing.assert_array_equal(run["per_example"], single[k]["per_example"])
    # A mask broadcast over the batch is one draw, the same on every replica and on one device.
    np.testing.assert_array_equal(run["broadcast"], single[k]["broadcast"])
    # The stream's key leaves the step unchanged and its counter as on one device.
    np.testing.assert_array_equal(run["key"], single[k]["key"])
    assert run["count"] == single[k]["count"]
