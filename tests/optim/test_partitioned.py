"""Partitioned optax transformations (`optax.partition` / `multi_transform`, `optax.masked`
with stateful inner transforms) under every strategy: each strategy reproduces the
single-device trajectory, and the optimizer state is sharded like the parameters it covers.

Before jaxlight placed `optax.MaskedNode`, setup failed under every strategy with a raw
"pytree structure error ... MaskedNode ... _Axes"."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from tests.optim.modules import PartitionedRegression, regression_batches

STEPS = 6
RTOL = 1e-4

STRATEGIES = {
    "single": strategies.SingleDevice,
    "ddp": strategies.DDP,
    "dp": strategies.DataParallel,
    "fsdp": lambda: strategies.FSDP(min_shard_size=1),
    "tp": lambda: strategies.TensorParallel(2),
    "gpipe": lambda: strategies.GPipe(stages=4, microbatches=4),
    "hybrid": lambda: strategies.Hybrid({"fsdp": 4, "tp": 2}, min_shard_size=1),
}


def _train(name):
    losses = {}
    log = callbacks.LambdaCallback(
        on_log=lambda fit, m, metrics, step: losses.__setitem__(step, metrics["loss"]))
    fit = jl.Fit(STRATEGIES[name](), max_steps=STEPS, log_every_n_steps=1, callbacks=[log],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    module = PartitionedRegression()
    fit.fit(module, regression_batches(STEPS))
    assert fit.compile_counts["train"] == 1
    params = jax.device_get(nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return fit, np.array([losses[s] for s in range(1, STEPS + 1)]), params


@pytest.fixture(scope="module")
def runs():
    return {}


def _run(runs, name):
    if name not in runs:
        runs[name] = _train(name)
    return runs[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "single"])
def test_partitioned_transforms_match_single_device(name, runs):
    _, ref_losses, ref_params = _run(runs, "single")
    fit, losses, params = _run(runs, name)
    assert ref_losses[-1] < 0.8 * ref_losses[0], "the reference must learn"
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=0)
    for (path, value), ref in zip(jax.tree_util.tree_leaves_with_path(params),
                                  jax.tree.leaves(ref_params), strict=True):
        rel = np.linalg.norm(value - ref) / np.linalg.norm(ref)
        assert rel < RTOL, f"{name}: {jax.tree_util.keystr(path)} differs by {rel:.2e}"


def _moments(opt_state):
    """The blocks' AdamW first moment and the edges' masked Adam first moment."""
    blocks = opt_state.inner_states["blocks"].inner_state[0].mu
    edges = opt_state.inner_states["edges"].inner_state[0].inner_state.mu
    return blocks, edges


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "tp", "gpipe", "hybrid"])
def test_optimizer_state_is_sharded_like_its_parameters(name, runs):
    fit, _, _ = _run(runs, name)
    state = fit.state
    blocks_mu, edges_mu = _moments(state.opt_state)
    kernel = state.params["blocks"]["layers"]["dense"]["kernel"]
    assert kernel.sharding.spec != jax.sharding.PartitionSpec()  # really sharded
    assert blocks_mu["blocks"]["layers"]["dense"]["kernel"].sharding == kernel.sharding
    # The edges' optimizer holds no slot for the blocks, and Adam moments for vectors only.
    assert isinstance(blocks_mu["inp"]["kernel"], optax.MaskedNode)
    assert isinstance(edges_mu["blocks"]["layers"]["dense"]["kernel"], optax.MaskedNode)
    assert isinstance(edges_mu["inp"]["kernel"], optax.MaskedNode)
    assert edges_mu["inp"]["bias"].sharding == state.params["inp"]["bias"].sharding


def test_the_plan_counts_partitioned_state_per_device(runs):
    module = PartitionedRegression()
    batch = regression_batches(1)[0]
    single = jl.Fit("single", max_steps=1).plan(module, batch, verbose=False)
    fsdp = jl.Fit(strategies.FSDP(min_shard_size=1), max_steps=1).plan(
        PartitionedRegression(), batch, verbose=False)
    assert 0 < fsdp.opt_state_bytes_per_device < single.opt_state_bytes_per_device
