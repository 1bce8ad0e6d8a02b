"""Trainer(enable_checkpointing): by default (None) a ModelCheckpoint saves at each epoch's end
and keeps the newest, under <default_root_dir>/checkpoints without a logger, and
test(ckpt_path="best") loads it; False saves nothing; False beside a ModelCheckpoint in callbacks
is refused."""

import os
import re

from _common import L, Reg, batches, problem, tmpdir, trainer, write

prob = problem(seed=12)
train = batches(prob, "train")


def saved_steps(root: str) -> list[int]:
    folder = os.path.join(root, "checkpoints")
    if not os.path.isdir(folder):
        return []
    return sorted(int(re.search(r"step=(\d+)", name).group(1)) for name in os.listdir(folder))


cases = {}
for name, flag in (("default", None), ("false", False)):
    tmp = tmpdir()
    t = trainer(tmp, max_epochs=3, limit_train_batches=2, enable_checkpointing=flag)
    module = Reg(prob)
    t.fit(module, train)
    try:
        t.test(module, train, ckpt_path="best", verbose=False)
        best = True
    except ValueError:
        best = False
    cases[name] = {"saved_steps": saved_steps(tmp), "test_best_loads": best}
try:
    trainer(tmpdir(), enable_checkpointing=False,
            callbacks=[L.callbacks.ModelCheckpoint(dirpath=tmpdir())])
    cases["false_with_model_checkpoint_refused"] = False
except Exception:  # noqa: BLE001 - Lightning's MisconfigurationException
    cases["false_with_model_checkpoint_refused"] = True
write("checkpointing", cases, prob)
