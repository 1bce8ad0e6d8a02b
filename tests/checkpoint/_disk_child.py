"""A training run that meets a disk fault or a second run, in its own process.

Usage: python _disk_child.py '<json config>' (tests/checkpoint/test_disk_faults.py). It saves
every `every` steps to `dir` and prints `STEP <n>` after every step. At step `fault_at`, once
the saves so far have committed, `fault` happens: "fill" leaves no free byte on the filesystem
mounted at `mount` (a file of the rest), "readonly" remounts it read-only. At step `hold_at` it
prints `HOLDING` and sleeps (a live run, for the parent to race and kill). A CheckpointError
prints `CHECKPOINT_ERROR <message>` and exits 3: the process must exit in every case.
"""

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

cfg = json.loads(sys.argv[1])

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks  # noqa: E402
from tests.checkpoint._common import loader, make_fit  # noqa: E402
from tests.models import Classifier  # noqa: E402


def on_step(fit, module, outputs, batch, batch_idx):
    step = fit.global_step
    print(f"STEP {step}", flush=True)
    if step == cfg.get("fault_at"):
        ckpt.save_now(fit, module, wait=True)  # this step is saved already: waits for commits
        if cfg["fault"] == "fill":
            stat = os.statvfs(cfg["mount"])
            with open(os.path.join(cfg["mount"], "filler"), "wb") as f:
                f.write(b"\0" * (stat.f_bavail * stat.f_frsize))
        else:
            subprocess.run(["mount", "-o", "remount,ro", cfg["mount"]], check=True, timeout=30)
    if cfg.get("fault_at") is not None and step > cfg["fault_at"]:
        time.sleep(0.5)  # steps of a real size, so a failing write ends before the next save
    if step == cfg.get("hold_at"):
        print("HOLDING", flush=True)
        time.sleep(600)


# save_top_k=-1: no older step is deleted, so no space comes free after the fault.
ckpt = callbacks.ModelCheckpoint(cfg["dir"], every_n_steps=cfg.get("every", 3), save_top_k=-1,
                                 async_save=cfg.get("async", True))
fit = make_fit("single", cfg["max_steps"],
               [ckpt, callbacks.LambdaCallback(on_train_batch_end=on_step)])
try:
    fit.fit(Classifier(), loader(), ckpt_path=cfg.get("ckpt_path"))
except jl.CheckpointError as exc:
    print("CHECKPOINT_ERROR " + str(exc).replace("\n", " "), flush=True)
    sys.exit(3)
print("DONE", flush=True)
