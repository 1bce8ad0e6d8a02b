"""Disk faults met for real: a full disk, a read-only remount, a removed directory, two runs.

The small disks are real tmpfs mounts (the test machines run as root; elsewhere the tests that
need one skip, saying why). Every wait on a child process is bounded, so a hang fails the test.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess

import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._restore import complete_steps
from tests.checkpoint._common import loader, make_fit
from tests.checkpoint._proc import Child
from tests.models import Classifier

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_disk_child.py")


@contextlib.contextmanager
def small_disk(path, size="4m"):
    """A tmpfs of `size` mounted at `path` (skips where mounting is refused)."""
    os.makedirs(path)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the CI machines run as root)")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode:
        pytest.skip(f"mount -t tmpfs refused: {done.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=30, check=False)


def _steps(child):
    return [int(line.split()[1]) for line in child.lines if line.startswith("STEP ")]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["fill", "readonly"])
def test_an_async_save_that_fails_is_reported_at_the_next_save_and_the_process_exits(
        tmp_path, fault):
    # Saves every 3 steps; once 3 and 6 have committed the disk is full (or read-only), so the
    # save of step 9 fails in the background. Its error must stop the run at step 12 (the next
    # save), not at 15, in jaxlight's words, and the process must exit: orbax's writer threads
    # used to wait 20 minutes for a directory that could not be made.
    with small_disk(tmp_path / "disk") as disk:
        ckpt_dir = os.path.join(disk, "ckpt")
        child = Child({"dir": ckpt_dir, "mount": disk, "max_steps": 16, "fault_at": 6,
                       "fault": fault}, str(tmp_path), script=CHILD)
        assert child.finish(timeout=150) == 3, child.stderr()[-3000:]
        line = child.wait_for("CHECKPOINT_ERROR", timeout=5)
        # Raised after the step at which the failure was known (polled after every step), at
        # the latest at step 12, the next save: before its STEP line.
        assert 9 <= max(_steps(child)) <= 11, (child.lines, line)
        assert "step 9" in line and ckpt_dir in line
        if fault == "fill":
            free, need = re.search(r"the disk is full \(No space left on device\): ([\d,]+) "
                                   r"bytes are free .* needs about ([\d,]+) bytes", line).groups()
            assert int(free.replace(",", "")) < 8192 < int(need.replace(",", "")), line
            assert "spec" not in line and "tensorstore" not in line.lower()
        else:
            assert "cannot be written (Read-only file system)" in line
        assert re.search(r"Checkpoints saved before are untouched: (steps )?\[3, 6\]\.", line)
        assert complete_steps(ckpt_dir) == [3, 6]
        jl.load_checkpoint(ckpt_dir, Classifier())  # nothing saved is lost


def test_a_full_disk_names_free_and_needed_bytes_when_saving_synchronously(tmp_path):
    with small_disk(tmp_path / "disk") as disk:
        ckpt_dir = os.path.join(disk, "ckpt")

        def fill(fit, module, outputs, batch, batch_idx):
            if fit.global_step == 2:
                stat = os.statvfs(disk)
                with open(os.path.join(disk, "filler"), "wb") as f:
                    f.write(b"\0" * (stat.f_bavail * stat.f_frsize))

        fit = make_fit("single", 6, [
            callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=2, save_top_k=-1,
                                      async_save=False),
            callbacks.LambdaCallback(on_train_batch_end=fill)])
        with pytest.raises(jl.CheckpointError, match=r"saving checkpoint step 4 to .* failed: "
                           r"the disk is full .* bytes are free .* needs about [\d,]+ bytes "
                           r"\(step 2 takes [\d,]+ bytes on disk\).*untouched: \[2\]"):
            fit.fit(Classifier(), loader())
        assert fit.global_step == 4
        assert complete_steps(ckpt_dir) == [2]


def test_a_checkpoint_directory_removed_mid_run_is_named_in_a_warning(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    ckpt = callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=2, save_top_k=-1)

    def remove(fit, module, outputs, batch, batch_idx):
        if fit.global_step == 4:
            ckpt.save_now(fit, module, wait=True)
            shutil.rmtree(ckpt_dir)

    fit = make_fit("single", 8, [ckpt, callbacks.LambdaCallback(on_train_batch_end=remove)])
    with pytest.warns(jl.JaxlightWarning, match=rf"checkpoint directory {re.escape(ckpt_dir)} "
                      r"was removed while this run was saving into it \(it held steps \[2, 4\]"):
        fit.fit(Classifier(), loader())
    assert complete_steps(ckpt_dir) == [6, 8]


@pytest.mark.slow
def test_a_second_run_in_a_live_runs_directory_is_refused_and_a_killed_runs_lock_is_not(
        tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    first = Child({"dir": ckpt_dir, "max_steps": 12, "every": 2, "hold_at": 4},
                  str(tmp_path), script=CHILD)
    first.wait_for("HOLDING", timeout=150)
    # The same job launched again: refused before it touches the directory (orbax's start-up
    # would delete the live run's unfinished save).
    second = Child({"dir": ckpt_dir, "max_steps": 12, "every": 2}, str(tmp_path), script=CHILD)
    assert second.finish(timeout=150) == 3, second.stderr()[-3000:]
    line = second.wait_for("CHECKPOINT_ERROR", timeout=5)
    assert (f"{ckpt_dir} is in use by another run: host {socket.gethostname()}, pid "
            f"{first.proc.pid}") in line, line
    assert "STEP 1" not in second.lines
    assert complete_steps(ckpt_dir) == [2, 4]
    # SIGKILL leaves the lock file behind; the system released the lock itself, so a resume
    # into the directory goes ahead.
    os.kill(first.proc.pid, signal.SIGKILL)
    assert first.finish(timeout=30) == -signal.SIGKILL
    assert os.path.exists(os.path.join(ckpt_dir, ".jaxlight-writer.lock"))
    fit = make_fit("single", 6, [callbacks.ModelCheckpoint(ckpt_dir, every_n_steps=2)])
    fit.fit(Classifier(), loader(), ckpt_path="last")
    assert fit.global_step == 6 and complete_steps(ckpt_dir)[-1] == 6
    assert not os.path.exists(os.path.join(ckpt_dir, ".jaxlight-writer.lock"))  # released
