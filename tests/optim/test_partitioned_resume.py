"""A partitioned optimizer state (optax.multi_transform with a masked momentum) survives a
SIGKILL: a real training process is killed after step 5's checkpoint committed, and resuming
it is bit for bit the uninterrupted run; the same checkpoint restores on another mesh."""

from __future__ import annotations

import os
import shutil
import signal

import jax
import numpy as np
import optax
import pytest

from jaxlight import callbacks
from tests.checkpoint._common import assert_bitwise, loader, make_fit, params_of
from tests.checkpoint._proc import Child
from tests.optim.modules import PartitionedClassifier

STEPS = 10


def _train(strategy, ckpt_dir=None):
    module = PartitionedClassifier()
    cbs = [callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=1)] if ckpt_dir else []
    fit = make_fit(strategy, STEPS, cbs)
    fit.fit(module, loader(), ckpt_path="last" if ckpt_dir else None)
    assert fit.global_step == STEPS
    return fit, params_of(module.model)


@pytest.mark.slow
def test_partitioned_state_resumes_bitwise_after_sigkill_and_on_another_mesh(tmp_path):
    ckpt_dir = str(tmp_path / "fsdp")
    child = Child({"strategy": "fsdp", "dir": ckpt_dir, "max_steps": STEPS, "pause_at": 5,
                   "module": "partitioned"}, str(tmp_path))
    child.wait_for("PAUSED")
    os.kill(child.proc.pid, signal.SIGKILL)
    assert child.finish() == -signal.SIGKILL
    other_mesh = str(tmp_path / "copy")
    shutil.copytree(ckpt_dir, other_mesh)

    fit, resumed = _train("fsdp", ckpt_dir)
    reference_fit, reference = _train("fsdp")
    assert_bitwise(resumed, reference)
    # The optimizer state too: Adam's moments on l1, the masked momentum on l2's kernel.
    assert_bitwise(jax.device_get(fit.state.opt_state),
                   jax.device_get(reference_fit.state.opt_state))
    trace = fit.state.opt_state.inner_states["sgd"].inner_state[0].inner_state.trace
    assert isinstance(trace["l2"]["bias"], optax.MaskedNode)
    assert isinstance(trace["l1"]["kernel"], optax.MaskedNode)

    # Restored on another mesh (FSDP's checkpoint, one device): the run continues the same
    # trajectory up to the rounding of a different layout.
    _, moved = _train("single", other_mesh)
    for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(reference), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
