"""Preemption: SIGTERM (real subprocess) and SIGUSR1 finish the step, checkpoint, exit."""

import os
import signal

import numpy as np
import pytest

from jaxlight import callbacks
from jaxlight._fit._preemption import Preempted
from jaxlight.checkpoint._restore import complete_steps
from tests.checkpoint._common import SlowBatches, assert_bitwise, loader, make_fit, params_of
from tests.checkpoint._proc import Child
from tests.models import Classifier

STEPS = 12  # 8 batches per epoch: the resumed run re-iterates the generic iterable


@pytest.mark.slow
def test_sigterm_saves_commits_and_exits_with_resume_message(tmp_path):
    # No ModelCheckpoint: the preemption checkpoint goes to <default_root_dir>/checkpoints.
    # The data is a generic iterable (no len, no state_dict) taking 0.25 s per batch, so the
    # signal arrives while the child is busy; the resume skips the consumed batches.
    child = Child({"strategy": "single", "max_steps": STEPS, "delay": 0.25, "root": "run"},
                  str(tmp_path))
    child.wait_for("STEP 2")
    os.kill(child.proc.pid, signal.SIGTERM)
    assert child.finish() == 128 + signal.SIGTERM
    err = child.stderr()
    ckpt_dir = str(tmp_path / "run" / "checkpoints")
    steps = complete_steps(ckpt_dir)
    assert len(steps) == 1 and 2 <= steps[0] < STEPS, (steps, err[-2000:])
    assert "received SIGTERM" in err
    assert f"stopped by SIGTERM after step {steps[0]}" in err
    assert "ckpt_path='last'" in err and os.path.join(ckpt_dir, str(steps[0])) in err
    assert "DONE" not in child.lines

    module = Classifier()
    fit = make_fit("single", STEPS, default_root_dir=str(tmp_path / "run"))
    fit.fit(module, SlowBatches(), ckpt_path="last")
    reference = Classifier()
    make_fit("single", STEPS).fit(reference, SlowBatches())
    assert_bitwise(params_of(module.model), params_of(reference.model))


def test_sigusr1_finishes_the_step_checkpoints_and_exits(tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    ckpt = callbacks.ModelCheckpoint("ckpt", every_n_steps=100)

    def send(fit, module, outputs, batch, batch_idx):
        if fit.global_step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's --signal=USR1@90 does

    fit = make_fit("single", STEPS, [ckpt, callbacks.LambdaCallback(on_train_batch_end=send)])
    with pytest.raises(Preempted) as info:
        fit.fit(Classifier(), loader())
    assert info.value.code == 128 + signal.SIGUSR1
    assert "stopped by SIGUSR1 after step 3" in str(info.value)
    assert complete_steps("ckpt") == [3]
    assert signal.getsignal(signal.SIGUSR1) is before  # handlers restored after fit

    module = Classifier()
    make_fit("single", STEPS, [callbacks.ModelCheckpoint("ckpt", every_n_steps=100)]).fit(
        module, loader(), ckpt_path="last")
    reference = Classifier()
    make_fit("single", STEPS).fit(reference, loader())
    assert_bitwise(params_of(module.model), params_of(reference.model))


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_checkpoints_the_same_step_on_both(tmp_path):
    # 2 processes x 4 devices, FSDP over all 8: each process writes its own shards. Only rank 1
    # gets SIGTERM; JAX's coordination service makes both save the same step and exit.
    from jaxlight.distributed._launch import child_env, free_port

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    port, ckpt_dir = free_port(), str(tmp_path / "ckpt")
    cfg = {"strategy": "fsdp", "dir": ckpt_dir, "every": 100, "max_steps": STEPS, "sleep": 0.3}
    children = []
    for rank in range(2):
        env = child_env(rank, 2, port, devices_per_proc=4, timeout=60)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
        children.append(Child(cfg, str(tmp_path), env=env))
    children[1].wait_for("STEP 2")
    os.kill(children[1].proc.pid, signal.SIGTERM)
    codes = [c.finish() for c in children]
    assert codes == [128 + signal.SIGTERM] * 2, [c.stderr()[-3000:] for c in children]
    steps = complete_steps(ckpt_dir)
    assert len(steps) == 1 and 2 <= steps[0] < STEPS
    for c in children:
        assert f"STEP {steps[0]}" in c.lines and f"STEP {steps[0] + 1}" not in c.lines
    assert "stopped by SIGTERM" in children[0].stderr()  # process 0 prints the message
    shards = [n for n in os.listdir(os.path.join(ckpt_dir, str(steps[0]), "state"))
              if n.startswith("ocdbt.process_")]
    assert sorted(shards) == ["ocdbt.process_0", "ocdbt.process_1"]

    # Written by 2 processes under FSDP, resumed by 1 process on one device.
    losses = {}

    def record(fit, module, metrics, step):
        losses.setdefault(fit.strategy.name, {})[step] = metrics["loss"]

    rec = callbacks.LambdaCallback(on_log=record)
    make_fit("single", STEPS, [rec], log_every_n_steps=1).fit(
        Classifier(), loader(), ckpt_path=ckpt_dir)
    make_fit("fsdp", STEPS, [rec], log_every_n_steps=1).fit(Classifier(), loader())
    for step in range(steps[0] + 1, STEPS + 1):
        np.testing.assert_allclose(losses["single"][step], losses["fsdp"][step], rtol=1e-5)
