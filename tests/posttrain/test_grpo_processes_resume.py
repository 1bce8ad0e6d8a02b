"""GRPO across processes, SIGKILLed and resumed: a 2 processes x 4 devices grpo fit that
checkpoints every step is killed (SIGKILL, both processes) after step 3's checkpoint, in the
middle of a generation batch; a fresh 2-process job resumes it with ckpt_path="last" and ends
with the policy of an uninterrupted 2-process fit, bitwise, having trained the last step on the
same rows in each process (each process's own half of the generation batch). A checkpoint taken
inside a generation batch by 2 processes does not resume in 1."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxlight import CheckpointError
from jaxlight.distributed._launch import child_env, free_port
from jaxlight.recipes import grpo
from tests.distributed._launch_util import REPO, run_processes
from tests.posttrain import _grpo_processes as script
from tests.posttrain import _grpo_processes_resume as child

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "_grpo_processes.py")
CHILD = os.path.join(HERE, "_grpo_processes_resume.py")


def _run_and_kill(out: str, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Starts the pausing job, SIGKILLs both processes once both wrote their pause marker."""
    port, procs, logs = free_port(), [], []
    try:
        for rank in (0, 1):
            env = child_env(rank, 2, port, devices_per_proc=4, timeout=30.0)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
            log = open(os.path.join(out, f"log{rank}.txt"), "w+")  # noqa: SIM115
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, CHILD, out, "pause"], env=env,
                                          cwd=out, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        markers = [os.path.join(out, f"paused{r}") for r in (0, 1)]
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(m) for m in markers):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.2)
        paused = all(os.path.exists(m) for m in markers)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    output = []
    for log in logs:
        log.seek(0)
        output.append(log.read())
        log.close()
    assert paused, "the job did not pause:\n" + "\n".join(o[-4000:] for o in output)
    return [p.returncode for p in procs]


@pytest.mark.slow
def test_sigkilled_two_process_grpo_resumes_bitwise(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir()
    killed.mkdir()
    results = run_processes(SCRIPT, [str(straight)], nprocs=2, devices_per_proc=4, timeout=900)
    assert all(r.returncode == 0 for r in results), "\n".join(r.output[-6000:] for r in results)

    assert _run_and_kill(str(killed)) == [-signal.SIGKILL, -signal.SIGKILL]
    steps = sorted(int(d) for d in os.listdir(killed / "ckpt") if d.isdigit())
    assert steps == list(range(1, child.PAUSE_AT + 1)), steps
    assert not (killed / "rank0.npz").exists()

    results = run_processes(CHILD, [str(killed), "resume"], nprocs=2, devices_per_proc=4,
                            timeout=900)
    assert all(r.returncode == 0 for r in results), "\n".join(r.output[-6000:] for r in results)
    for rank in (0, 1):
        want = np.load(straight / f"rank{rank}.npz")
        got = np.load(killed / f"rank{rank}.npz")
        # The resumed job trained (and logged) only step 4, on the generation batch this
        # process held at step 3: its own half of the rows, from the checkpoint.
        np.testing.assert_array_equal(got["steps"], [4])
        assert not [k for k in got.files if k.startswith("first_")]  # it sampled nothing
        for key in ("tokens", "mask", "rewards", "advantages", "old_logps"):
            np.testing.assert_array_equal(got[f"batch_{key}"], want[f"batch_{key}"],
                                          f"rank {rank} {key}")  # not process 0's rows
        np.testing.assert_array_equal(got["losses"], want["losses"][-1:])
        params = [k for k in want.files if k.startswith("param")]
        assert params and sorted(params) == sorted(k for k in got.files if k.startswith("param"))
        for key in params:
            np.testing.assert_array_equal(got[key], want[key], f"rank {rank} {key}")


def test_another_process_count_cannot_resume_inside_a_generation_batch():
    config = grpo.Config()
    config.model.pretrained = script.FIXTURE
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.updates = 4, 2
    _, data = grpo.build(config)
    rows = {"tokens": np.zeros((4, 6), np.int32)}
    state = {"generation": 2, "taken": 1, "batch": None,
             "batches": [grpo._encode_batch(rows)] * 2}
    with pytest.raises(CheckpointError, match=r"GRPO generation batch 1 \(1 of its 2 updates "
                       r"taken\), whose rows 2 process\(es\) held, but this run has 1"):
        data.train.load_state_dict(state)
    state["batches"] = [grpo._encode_batch(rows)]  # one process's: its own rows
    data.train.load_state_dict(state)
    np.testing.assert_array_equal(data.train.batch["tokens"], rows["tokens"])
