"""Every strategy reproduces the single-device trajectory of the same transformer LM.

One SingleDevice reference run (module scope); each strategy trains the same TinyLM 10 steps on
8 simulated devices. Losses agree step by step, and every final parameter agrees, to 1e-4
relative (parameter: ‖p − p_ref‖ / ‖p_ref‖ per array).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import strategies
from jaxlight.callbacks import Callback
from tests.models import saves_checkpoints
from tests.strategies.lm import TinyLM, token_batches

#: The whole suite's tier: tests/strategies/test_tiny_equivalence.py is the fast tier's version.
pytestmark = pytest.mark.slow

STEPS = 10
RTOL = 1e-4


class LossRecorder(Callback):
    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_log(self, fit, module, metrics, step):
        if "loss" in metrics and "val_loss" not in metrics:
            self.losses[step] = metrics["loss"]


def train(strategy, module=None, batches=None, steps=STEPS, cbs=()):
    """(fit, per-step losses, final parameters) of `steps` steps of `module` (TinyLM) on
    `batches` (token_batches), with callbacks `cbs` besides the loss recorder."""
    recorder = LossRecorder()
    module = TinyLM() if module is None else module
    fit = jl.Fit(strategy=strategy, max_steps=steps, log_every_n_steps=1,
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=saves_checkpoints(cbs), callbacks=[recorder, *cbs])
    fit.fit(module, token_batches(steps) if batches is None else batches)
    losses = np.array([recorder.losses[s] for s in range(1, steps + 1)])
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return fit, losses, params


def assert_params_close(name, params, ref_params, rtol):
    """Every array of `params` has its reference's shape (the published model is canonical
    whatever the strategy: no device axis) and is within `rtol` of it, relatively."""
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_params))
    for path, value in jax.tree_util.tree_leaves_with_path(params):
        ref = flat_ref[path]
        assert value.shape == ref.shape, jax.tree_util.keystr(path)
        rel = np.linalg.norm(value - ref) / np.linalg.norm(ref)
        assert rel < rtol, f"{name}: {jax.tree_util.keystr(path)} differs by {rel:.2e}"


@pytest.fixture(scope="module")
def reference():
    return train(strategies.SingleDevice())


STRATEGIES = {
    "ddp": strategies.DDP,
    "dp": strategies.DataParallel,
    "fsdp": strategies.FSDP,
    "fsdp_per_layer": lambda: strategies.FSDP(reshard_after_forward=True),
    "tp2": lambda: strategies.TensorParallel(2),
    "tp4": lambda: strategies.TensorParallel(4),
    "hybrid_d2_f2_t2": lambda: strategies.Hybrid({"data": 2, "fsdp": 2, "tp": 2}),
}


@pytest.fixture(scope="module")
def runs():
    return {}


def run(runs, name):
    if name not in runs:
        runs[name] = train(STRATEGIES[name]())
    return runs[name]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_matches_single_device(name, reference, runs):
    _, ref_losses, ref_params = reference
    fit, losses, params = run(runs, name)
    assert fit.compile_counts["train"] == 1
    assert ref_losses[-1] < ref_losses[0] - 0.5, "the reference run must actually learn"
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=0)
    assert_params_close(name, params, ref_params, RTOL)


def test_strategies_really_shard(runs):
    """The layouts differ as intended (so the agreement above is not vacuous)."""
    qkv = lambda fit: fit.state.params["blocks"]["layers"]["attn"]["qkv"]["kernel"]  # noqa: E731
    assert qkv(run(runs, "fsdp")[0]).sharding.spec[1] == "fsdp"
    assert qkv(run(runs, "tp4")[0]).sharding.spec[3] == "tp"
    hybrid = qkv(run(runs, "hybrid_d2_f2_t2")[0]).sharding.spec
    assert (hybrid[1], hybrid[3]) == ("fsdp", "tp")
    assert qkv(run(runs, "ddp")[0]).shape[0] == 8  # DDP's internal device axis


def _bytes_on(device, tree) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def test_fsdp_memory_per_device(runs):
    """Params + optimizer state per device <= 1.05 * (DataParallel's / 8) + replicated leaves."""
    fsdp_fit = run(runs, "fsdp")[0]
    dp_fit = run(runs, "dp")[0]
    device = jax.devices()[0]
    state = fsdp_fit.state
    fsdp_bytes = _bytes_on(device, (state.params, state.opt_state))
    dp_bytes = _bytes_on(device, (dp_fit.state.params, dp_fit.state.opt_state))
    replicated = sum(
        leaf.nbytes for leaf in jax.tree.leaves((state.params, state.opt_state))
        if leaf.ndim and leaf.sharding.is_fully_replicated
    )
    n = len(jax.devices())
    assert replicated < 0.05 * dp_bytes, "only small leaves (norm scales) may stay replicated"
    assert fsdp_bytes <= 1.05 * dp_bytes / n + replicated, (fsdp_bytes, dp_bytes, replicated)
