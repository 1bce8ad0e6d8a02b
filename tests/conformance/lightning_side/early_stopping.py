"""EarlyStopping: patience, min_delta, mode, check_on_train_epoch_end, stopping_threshold,
divergence_threshold. The monitored metric is given by the data (the k-th validation, or the
k-th training epoch, sees values[k]); one training batch an epoch, at most 10 epochs."""

from _common import L, Passes, Reg, batches, problem, tmpdir, torch, trainer, write

prob = problem(seed=4)
x = torch.tensor(prob["val"]["x"][:4])
cases = {}

DOWN_UP = [5.0, 4.0, 4.5, 4.2, 3.9, 4.1, 4.0, 4.3, 4.4, 4.5]
SLOW = [5.0, 4.8, 4.7, 4.65, 4.62, 4.6, 4.59, 4.58, 4.57, 4.56]
UP_DOWN = [1.0, 2.0, 1.5, 1.8, 2.5, 2.4, 2.3, 2.2, 2.1, 2.0]
CASES = {
    "patience_1": (DOWN_UP, {"patience": 1}),
    "patience_2": (DOWN_UP, {"patience": 2}),
    "patience_3": (DOWN_UP, {"patience": 3}),
    "min_delta": (SLOW, {"patience": 2, "min_delta": 0.05}),
    "mode_max": (UP_DOWN, {"patience": 2, "mode": "max"}),
    "stopping_threshold": (SLOW, {"patience": 5, "stopping_threshold": 4.61}),
    "divergence_threshold": ([5.0, 4.0, 6.0, 7.0, 8.0, 9.0, 9.0, 9.0, 9.0, 9.0],
                             {"patience": 5, "divergence_threshold": 5.5}),
    "check_on_train_epoch_end": (DOWN_UP, {"patience": 2, "check_on_train_epoch_end": True}),
}

for name, (values, kw) in CASES.items():
    on_train = kw.get("check_on_train_epoch_end", False)
    monitor = "train_score" if on_train else "val_score"
    stop = L.callbacks.EarlyStopping(monitor=monitor, **kw)
    # one training batch an epoch: the epoch's own pass of Passes, or the first fixed batch
    tr = trainer(tmpdir(), max_epochs=len(values), callbacks=[stop],
                 limit_train_batches=None if on_train else 1)
    if on_train:
        tr.fit(Reg(prob), Passes(values, x))
    else:
        tr.fit(Reg(prob), batches(prob, "train"), Passes(values, x))
    cases[name] = {"values": values, "kwargs": kw, "monitor": monitor,
                   "stopped_epoch": stop.stopped_epoch, "global_step": tr.global_step,
                   "epochs_run": tr.current_epoch, "wait_count": stop.wait_count,
                   "best_score": float(stop.best_score)}

write("early_stopping", cases, prob)
