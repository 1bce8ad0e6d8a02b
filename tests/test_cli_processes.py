"""The multi-process commands the docs show, run as they are written: two real processes of one
JAX job (Gloo collectives on CPU), each finishing well before any collective's deadline.

A callback that starts a collective on some processes only (SaveConfigCallback's broadcast, when
the CSV logger had chosen its run directory on process 0 only) left process 0 waiting ~5 minutes
for Gloo's DEADLINE_EXCEEDED; the timeout here fails such a hang in ~3.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jaxlight(argv: list[str], cwd, timeout: float = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "JAXLIGHT_COMPILATION_CACHE": "off",
           # `jaxlight` in the launched command: this interpreter's console script.
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]])}
    env.pop("XLA_FLAGS", None)  # --devices-per-proc sets each process's devices
    # A session of its own, so that a hang ends with every process of the job.
    proc = subprocess.Popen([sys.executable, "-m", "jaxlight._cli", *argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"jaxlight {' '.join(argv)} still ran after {timeout} s (a hang):\n"
                    f"{out[-3000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
def test_cli_md_launch_of_two_processes_fits_and_saves_its_config(tmp_path):
    # docs/cli.md, Devices: `jaxlight launch --nprocs 2 --devices-per-proc 4 -- jaxlight fit
    # digits` (fewer steps), with the default CSV logger and SaveConfigCallback.
    result = _jaxlight(["launch", "--nprocs", "2", "--devices-per-proc", "4", "--", "jaxlight",
                        "fit", "digits", "--max-steps", "20", "--enable-progress-bar", "false"],
                       tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "8 cpu devices, process 0 of 2" in result.stdout
    assert "final validation metrics (step 20" in result.stdout
    saved = list(tmp_path.rglob("config.yaml"))
    assert [p.relative_to(tmp_path).as_posix() for p in saved] == \
        ["jaxlight_logs/csv/version_0/config.yaml"]
    assert "max_steps: 20" in saved[0].read_text()
