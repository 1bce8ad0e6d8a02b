"""A training run in its own process, for the kill / signal / failed-save tests.

Usage: python _child.py '<json config>'; see tests/checkpoint/test_resume.py. It prints
`STEP <n>` after every step (the parent watches for it) and exits 0 when training finishes.
"""

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

cfg = json.loads(sys.argv[1])

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks  # noqa: E402
from tests.checkpoint._common import SlowBatches, loader, make_fit  # noqa: E402
from tests.models import Classifier  # noqa: E402
from tests.optim.modules import PartitionedClassifier  # noqa: E402
from tests.strategies import moe_resume  # noqa: E402


def on_step(fit, module, outputs, batch, batch_idx):
    step = fit.global_step
    if step == cfg.get("selfkill_at"):
        # ModelCheckpoint (earlier in the list) has just handed this step's save to its
        # background thread: die in the middle of it, once orbax has created the step's
        # temporary directory and before the commit renames it.
        unfinished = os.path.join(os.path.abspath(cfg["dir"]), f"{step}.orbax-checkpoint-tmp")
        deadline = time.monotonic() + 60
        while not os.path.isdir(unfinished) and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"STEP {step}", flush=True)
    if step == cfg.get("pause_at"):
        ckpt.save_now(fit, module, wait=True)  # so that the parent kills after a commit
        print("PAUSED", flush=True)
        time.sleep(600)
    if cfg.get("sleep"):
        time.sleep(cfg["sleep"])  # a slow step, so that a signal arrives mid-run
    if step == cfg.get("fsize_limit_at"):
        import resource

        ckpt.save_now(fit, module, wait=True)
        # From now on no file may grow past 200 bytes: the next save fails inside orbax's write.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.RLIM_INFINITY))


cbs = []
ckpt = None
if cfg.get("dir"):
    ckpt = callbacks.ModelCheckpoint(cfg["dir"], every_n_steps=cfg.get("every", 1))
    cbs.append(ckpt)
cbs.append(callbacks.LambdaCallback(on_train_batch_end=on_step))
fit = make_fit(cfg["strategy"], cfg["max_steps"], cbs, log_every_n_steps=1,
               default_root_dir=cfg.get("root", "jaxlight_logs"))
data = SlowBatches(cfg["delay"]) if "delay" in cfg else loader()
try:
    module = PartitionedClassifier() if cfg.get("module") == "partitioned" else Classifier()
    if cfg.get("module") == "moe":  # tests/strategies/test_moe_equivalence.py
        module, data = moe_resume.module(), moe_resume.batches()
    fit.fit(module, data, ckpt_path=cfg.get("ckpt_path"))
except jl.CheckpointError as exc:
    print(f"CHECKPOINT_ERROR {exc}", flush=True)
    sys.exit(3)
print("DONE", flush=True)
