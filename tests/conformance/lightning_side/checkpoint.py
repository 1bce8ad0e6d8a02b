"""ModelCheckpoint: save_top_k with ties, mode, save_last, every_n_epochs, every_n_train_steps,
a training-metric monitor, best_model_path / best_k_models / last_model_path. Two training
batches an epoch (steps 2, 4, ...), six epochs, the monitored value given by the data."""

import os
import re

from _common import L, Passes, Reg, batches, problem, tmpdir, torch, trainer, write

prob = problem(seed=5)
x = torch.tensor(prob["val"]["x"][:4])
train = batches(prob, "train")
cases = {}


def step(path):
    """The global step of a Lightning checkpoint file (epoch=E-step=S.ckpt), or of last.ckpt."""
    if not path:
        return None
    if os.path.basename(path).startswith("last"):
        return int(torch.load(path, weights_only=False)["global_step"])
    return int(re.search(r"step=(\d+)", path).group(1))


def run(name, values, monitor="val_score", **kw):
    ckdir = tmpdir()
    ck = L.callbacks.ModelCheckpoint(ckdir, monitor=monitor, **kw)
    on_train = monitor == "train_score"
    tr = trainer(tmpdir(), max_epochs=len(values), callbacks=[ck],
                 limit_train_batches=None if on_train else 2)
    if on_train:
        tr.fit(Reg(prob), Passes(values, x))
    else:
        tr.fit(Reg(prob), train, Passes(values, x))
    files = sorted(os.listdir(ckdir))
    kept = sorted(step(os.path.join(ckdir, f)) for f in files if not f.startswith("last"))
    cases[name] = {
        "values": values, "monitor": monitor, "kwargs": kw, "files": files, "kept_steps": kept,
        "best_step": step(ck.best_model_path),
        "best_model_score": None if ck.best_model_score is None else float(ck.best_model_score),
        "best_k_models": {str(step(p)): float(v) for p, v in ck.best_k_models.items()},
        "last_step": step(ck.last_model_path),
        "has_last": any(f.startswith("last") for f in files),
    }


TIES = [2.0, 1.0, 1.0, 1.0, 1.0, 3.0]
run("top_2_ties", TIES, save_top_k=2)
run("top_1_ties", TIES, save_top_k=1)
run("top_1_mode_max", [1.0, 3.0, 2.0, 3.0, 4.0, 0.0], save_top_k=1, mode="max")
run("top_3_min", [5.0, 3.0, 4.0, 1.0, 2.0, 6.0], save_top_k=3)
run("top_all_monitor", [5.0, 3.0, 4.0, 1.0, 2.0, 6.0], save_top_k=-1)
run("save_last", [5.0, 3.0, 4.0, 1.0, 2.0, 6.0], save_top_k=1, save_last=True)
run("every_n_epochs_2", [0.0] * 6, monitor=None, save_top_k=-1, every_n_epochs=2)
run("every_n_train_steps_3", [0.0] * 6, monitor=None, save_top_k=-1, every_n_train_steps=3)
run("no_monitor_latest", [0.0] * 6, monitor=None)
run("train_metric_monitor", [5.0, 3.0, 4.0, 1.0, 2.0, 6.0], monitor="train_score",
    save_top_k=2)
write("checkpoint", cases, prob)
