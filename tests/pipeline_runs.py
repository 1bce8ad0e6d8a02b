"""The pipelined runs the SIGKILL resume tests kill and resume (in `_pipeline_child.py`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from tests.models import saves_checkpoints
from tests.nn.staged_lm import StagedLM, lm_data
from tests.nn.stages_mlp import StageMLP, stage_data
from tests.strategies.interleaved_net import Regression, regression_data

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_pipeline_child.py")


def pipelined_run(kind: str, devices):
    """(strategy, module, resumable loader) of one kind of pipelined run."""
    if kind == "stages":
        return (strategies.GPipe(3, 4, devices=devices[:6]), StageMLP(),
                jl.data.ArrayLoader(stage_data(192), 24, seed=1))
    if kind == "stages_mpmd":  # a program per device, 3 devices
        return (strategies.GPipe(3, 4, mpmd=True, devices=devices[:3]), StageMLP(packed=False),
                jl.data.ArrayLoader(stage_data(192), 24, seed=1))
    if kind in ("stages_1f1b", "stages_zb-h1"):  # the same under another schedule
        return (strategies.GPipe(3, 4, schedule=kind.split("_")[1], mpmd=True,
                                 devices=devices[:3]), StageMLP(packed=False),
                jl.data.ArrayLoader(stage_data(192), 24, seed=1))
    if kind == "staged_lm":  # data 2 × pipe 4: embedding, block, block, head
        return (strategies.GPipe(4, 4, devices=devices[:8]), StagedLM(),
                jl.data.ArrayLoader(lm_data(160, 9), 16, seed=1))
    batches = regression_data(12)
    arrays = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
    return (strategies.GPipe(4, 4, repeats=2, devices=devices[:4]), Regression(),
            jl.data.ArrayLoader(arrays, len(batches[0]["y"]), seed=1))


def _saved_steps(ckpt: str) -> list[int]:
    """The finalized checkpoints' steps (orbax renames a save to its step when it completes)."""
    return sorted(int(s) for s in os.listdir(ckpt) if s.isdigit()) if os.path.isdir(ckpt) else []


def kill_at(kind: str, ckpt: str, max_steps: int, step: int) -> list[int]:
    """`kill_child_at` for `_pipeline_child.py` training `kind`."""
    return kill_child_at([CHILD, json.dumps({"kind": kind, "dir": ckpt, "max_steps": max_steps})],
                         ckpt, step)


def kill_child_at(args: list[str], ckpt: str, step: int) -> list[int]:
    """Runs `python *args` until it prints `STEP step` and a checkpoint in `ckpt` is finalized
    (saves are asynchronous: on a loaded machine none may have completed by then), SIGKILLs it;
    returns the saved steps. A child that dies first fails with its stderr."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                stderr=err, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            for line in proc.stdout:
                if line.strip() == f"STEP {step}" or time.monotonic() > deadline:
                    break
            while (not _saved_steps(ckpt) and proc.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
        err.seek(0)
        saved = _saved_steps(ckpt)
        assert saved, f"the child saved no checkpoint; its stderr:\n{err.read()[-3000:]}"
    return saved


def assert_runs_close(run: dict, ref: dict, tol: float = 1e-5) -> None:
    """Two `logged_fit` results: every logged loss and every parameter within `tol`."""
    np.testing.assert_allclose(run["losses"], ref["losses"], rtol=tol)
    for a, b in zip(jax.tree.leaves(run["params"]), jax.tree.leaves(ref["params"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def logged_fit(strategy, module, loader, steps: int, cbs=(), ckpt_path=None) -> dict:
    """Fits `module` for `steps` steps logging every loss: {fit, module, losses, params}."""
    losses = []
    log = callbacks.LambdaCallback(on_log=lambda fit, m, metrics, step: losses.append(
        metrics["loss"]))
    fit = jl.Fit(strategy=strategy, max_steps=steps, log_every_n_steps=1,
                 callbacks=[log, *cbs], enable_progress_bar=False, enable_model_summary=False,
                 logger=False,  # a run saves only where its callbacks ask
                 enable_checkpointing=saves_checkpoints(cbs))
    fit.fit(module, loader, ckpt_path=ckpt_path)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return {"fit": fit, "module": module, "losses": np.asarray(losses), "params": params}
