"""fit at and past its limit, and mid-epoch resume: what a requeued or extended run does."""

import os

from _common import L, Reg, batches, problem, tmpdir, trainer, write

prob = problem(seed=6)
train = batches(prob, "train")
cases = {}


class Seen(L.Callback):
    """(batch_idx, first input value) of every training batch."""

    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append([batch_idx, round(float(batch["x"][0, 0]), 4)])


def first_run(**kw):
    ckdir = tmpdir()
    ck = L.callbacks.ModelCheckpoint(ckdir, save_top_k=-1, save_last=True, **kw.pop("ck", {}))
    module = Reg(prob)
    tr = trainer(tmpdir(), callbacks=[ck], **kw)
    tr.fit(module, train)
    return ck, module, tr


def resume(name, ckpt, **kw):
    seen = Seen()
    module = Reg(prob)
    tr = trainer(tmpdir(), callbacks=[seen], **kw)
    tr.fit(module, train, ckpt_path=ckpt)
    cases[name] = {"global_step": tr.global_step, "seen": seen.seen,
                   "weights": module.weights(), "resume": kw}
    return module


ck, done, tr = first_run(max_epochs=2)
cases["uninterrupted_2_epochs"] = {"weights": done.weights(), "global_step": tr.global_step}
last = ck.last_model_path
resume("fit_again_at_max_epochs", last, max_epochs=2)
resume("fit_past_max_epochs", last, max_epochs=1)

ck, done, tr = first_run(max_steps=10)
resume("fit_again_at_max_steps", ck.last_model_path, max_steps=10)
resume("fit_past_max_steps", ck.last_model_path, max_steps=6)

ck, _, _ = first_run(max_steps=5, ck={"every_n_train_steps": 5})
step5 = os.path.join(os.path.dirname(ck.last_model_path), "epoch=0-step=5.ckpt")
resume("mid_epoch_resume", step5, max_epochs=2)
write("resume", cases, prob)
