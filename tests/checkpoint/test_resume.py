"""Exact resume after SIGKILL (real subprocesses), a kill during a save, a failed save."""

import os
import re
import signal

import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._restore import complete_steps
from tests.checkpoint._common import assert_bitwise, loader, make_fit, params_of
from tests.checkpoint._proc import Child
from tests.models import Classifier

STEPS = 12  # 8 batches per epoch: every resumed run crosses an epoch boundary


def _reference(strategy, steps=STEPS):
    module = Classifier()
    make_fit(strategy, steps).fit(module, loader())
    return params_of(module.model)


def _resume(strategy, ckpt_dir, steps=STEPS):
    module = Classifier()
    fit = make_fit(strategy, steps, [callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=1)])
    fit.fit(module, loader(), ckpt_path="last")
    assert fit.global_step == steps
    return params_of(module.model)


def _pausing(strategy, ckpt_dir, step, tmp_path, ckpt_path=None):
    """A child that trains, saving every step, and pauses once step `step` has committed."""
    return Child({"strategy": strategy, "dir": ckpt_dir, "max_steps": STEPS, "pause_at": step,
                  "ckpt_path": ckpt_path}, str(tmp_path))


def _kill_when_paused(child):
    child.wait_for("PAUSED")
    os.kill(child.proc.pid, signal.SIGKILL)
    assert child.finish() == -signal.SIGKILL


def _self_killing(strategy, ckpt_dir, step, tmp_path, ckpt_path=None):
    """A child that SIGKILLs itself while the asynchronous save of `step` is being written."""
    return Child({"strategy": strategy, "dir": ckpt_dir, "max_steps": STEPS,
                  "selfkill_at": step, "ckpt_path": ckpt_path}, str(tmp_path))


def _check_killed_during_save(child, ckpt_dir, step):
    assert child.finish() == -signal.SIGKILL, child.stderr()[-3000:]
    assert child.lines[-1] == f"STEP {step - 1}"
    # The interrupted save is still unfinished on disk; the step before it is complete (and
    # possibly the one before that, whose deletion runs in orbax's background thread).
    assert os.path.isdir(os.path.join(ckpt_dir, f"{step}.orbax-checkpoint-tmp"))
    assert complete_steps(ckpt_dir) in ([step - 1], [step - 2, step - 1])


@pytest.mark.slow
def test_resume_after_sigkill_is_bitwise_exact(tmp_path):
    single, dp, fsdp = (str(tmp_path / name) for name in ("single", "dp", "fsdp"))
    # The three first runs at once (independent processes; a 2-core machine runs two at once).
    children = {"single": _pausing("single", single, 3, tmp_path),
                "dp": _pausing("dp", dp, 5, tmp_path),
                "fsdp": _self_killing("fsdp", fsdp, 6, tmp_path)}
    _kill_when_paused(children["single"])
    # Older steps are deleted in orbax's background thread: a kill right after a commit may
    # leave the previous step too (the next run's retention deletes it, checked below).
    assert complete_steps(single) in ([3], [2, 3])
    # Resumed from 3, then killed in the middle of saving step 9: step 8 (the last batch of
    # epoch 0) is the newest complete checkpoint, so the next resume starts epoch 1.
    second = _self_killing("single", single, 9, tmp_path, ckpt_path="last")
    _kill_when_paused(children["dp"])
    assert complete_steps(dp) in ([5], [4, 5])
    _check_killed_during_save(children["fsdp"], fsdp, 6)
    _check_killed_during_save(second, single, 9)

    for strategy, ckpt_dir in (("single", single), ("dp", dp), ("fsdp", fsdp)):
        assert_bitwise(_resume(strategy, ckpt_dir), _reference(strategy))
        assert complete_steps(ckpt_dir) == [STEPS]  # unfinished saves were cleaned up


@pytest.mark.slow
def test_a_failed_save_deletes_nothing_and_says_so(tmp_path):
    # After step 3 has committed the child caps file sizes (RLIMIT_FSIZE, as a full disk
    # would): the write of step 4 fails inside orbax. Keeping only the newest checkpoint, a
    # successful step 4 would have deleted step 3; the failed one must not.
    ckpt_dir = str(tmp_path / "ckpt")
    child = Child({"strategy": "single", "dir": ckpt_dir, "max_steps": 8, "fsize_limit_at": 3},
                  str(tmp_path))
    assert child.finish() == 3, child.stderr()[-3000:]
    line = child.wait_for("CHECKPOINT_ERROR")
    assert "checkpoint save to" in line and "failed" in line and "File too large" in line
    # Step 2 may still be listed: older steps are deleted in orbax's background thread.
    assert re.search(r"Checkpoints saved before are untouched: steps \[(2, )?3\]\.", line), line
    assert complete_steps(ckpt_dir) == [3]
    jl.load_checkpoint(ckpt_dir, Classifier())  # still readable
