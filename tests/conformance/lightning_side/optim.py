"""Optimizer steps and weights: accumulate_grad_batches, gradient clipping, and schedulers given
through configure_optimizers' dict (LambdaLR, StepLR, OneCycleLR, ReduceLROnPlateau)."""

import math

from _common import L, Passes, Reg, batches, problem, tmpdir, torch, trainer, write

prob = problem(seed=1)
train = batches(prob, "train")
cases = {}


class LRs(L.Callback):
    """The learning rate each optimizer step uses."""

    def __init__(self):
        self.lrs = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def run(name, module_kw=None, val=None, **kw):
    module = Reg(prob, **(module_kw or {}))
    lrs = LRs()
    tr = trainer(tmpdir(), callbacks=[lrs], **kw)
    tr.fit(module, train, val)
    cases[name] = {"weights": module.weights(), "global_step": tr.global_step, "lrs": lrs.lrs}


# accumulate_grad_batches: k loader batches per optimizer step (8 batches an epoch)
run("accumulate_1_sgd", max_epochs=2, accumulate_grad_batches=1)
run("accumulate_2_sgd", max_epochs=2, accumulate_grad_batches=2)
run("accumulate_3_sgd", max_epochs=2, accumulate_grad_batches=3)  # 8 = 3 + 3 + 2
run("accumulate_2_adam", {"optimizer": "adam", "lr": 0.05}, max_epochs=2,
    accumulate_grad_batches=2)
run("accumulate_2_max_steps_3", max_steps=3, accumulate_grad_batches=2)

# gradient clipping
run("clip_norm_sgd", {"lr": 0.2}, max_epochs=1, gradient_clip_val=0.5)
run("clip_value_sgd", {"lr": 0.2}, max_epochs=1, gradient_clip_val=0.05,
    gradient_clip_algorithm="value")
run("clip_norm_adam", {"optimizer": "adam", "lr": 0.05}, max_epochs=1, gradient_clip_val=0.3)


def sched(make, **entry):
    return lambda opt: {"scheduler": make(opt), **entry}


lam = torch.optim.lr_scheduler.LambdaLR
run("lambdalr_epoch", {"scheduler": sched(lambda o: lam(o, lambda e: 0.5 ** e),
                                          interval="epoch")}, max_epochs=3)
run("lambdalr_step", {"scheduler": sched(lambda o: lam(o, lambda s: 0.9 ** s),
                                         interval="step")}, max_epochs=2)
run("lambdalr_step_frequency_3", {"scheduler": sched(lambda o: lam(o, lambda s: 0.8 ** s),
                                                     interval="step", frequency=3)},
    max_epochs=2)
run("steplr_epoch", {"scheduler": sched(
    lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5), interval="epoch")},
    max_epochs=5)
run("onecycle_step", {"lr": 0.3, "scheduler": sched(
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.3, total_steps=16,
                                                  cycle_momentum=False), interval="step")},
    max_epochs=2)
cases["onecycle_step"]["total_steps"] = 16

# ReduceLROnPlateau on a validation metric given by the data (the k-th validation sees
# values[k]); 1 training batch an epoch so that the rate each epoch is visible in the weights
x = torch.tensor(prob["val"]["x"][:4])
PLATEAU_VALUES = {
    "plateau_patience_1": ([5, 6, 7, 8, 9, 10, 11, 12], {"patience": 1}),
    "plateau_patience_0": ([5, 6, 7, 8, 9, 10, 11, 12], {"patience": 0}),
    "plateau_threshold_rel": ([5, 4.9, 4.85, 4.0, 3.99, 3.98, 3.97, 3.96],
                              {"patience": 0, "threshold": 0.01}),
    "plateau_threshold_abs": ([5, 4.9, 4.85, 4.0, 3.99, 3.98, 3.97, 3.96],
                              {"patience": 0, "threshold": 0.06, "threshold_mode": "abs"}),
    "plateau_cooldown": ([5, 6, 7, 8, 9, 10, 11, 12], {"patience": 0, "cooldown": 2}),
    "plateau_min_lr": ([5, 6, 7, 8, 9, 10, 11, 12], {"patience": 0, "min_lr": 0.02}),
    "plateau_mode_max": ([5, 6, 5, 5, 7, 7, 7, 7], {"patience": 1, "mode": "max"}),
}
for name, (values, kw) in PLATEAU_VALUES.items():
    make = (lambda kw: lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.5, **kw)
            )(kw)
    run(name, {"scheduler": sched(make, interval="epoch", monitor="val_score")},
        val=Passes(values, x), max_epochs=len(values), limit_train_batches=1)
    cases[name].update(values=values, kwargs=kw)

assert math.isfinite(cases["accumulate_2_sgd"]["weights"]["bias"][0])
write("optim", cases, prob)
