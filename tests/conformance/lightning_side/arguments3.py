"""The display, monitoring and logger arguments no other group runs (tests/conformance/
_coverage.py lists them): TQDMProgressBar's refresh_rate / leave, ModelSummary's max_depth,
the weight averages' use_buffers / device, DeviceStatsMonitor, ThroughputMonitor, and
TensorBoardLogger's run directory (its naming only: the oracle environment has no tensorboard,
so Lightning's availability flag is set and no event is written)."""

import contextlib
import io
import os

from _common import L, Reg, batches, problem, tmpdir, torch, trainer, write
from lightning.pytorch import callbacks
from lightning.pytorch.utilities.model_summary import summarize
from torch import nn

prob = problem(seed=13)
train = batches(prob, "train")
cases = {}


def bars():
    out = {}
    for name, kw in {"refresh_3_leave": {"refresh_rate": 3, "leave": True},
                     "refresh_3_no_leave": {"refresh_rate": 3, "leave": False},
                     "refresh_0": {"refresh_rate": 0}}.items():
        bar = callbacks.TQDMProgressBar(**kw)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
            trainer(tmpdir(), max_epochs=2, limit_train_batches=4, enable_progress_bar=True,
                    callbacks=[bar]).fit(Reg(prob), train)
        text = err.getvalue()
        out[name] = {"refresh_rate": bar.refresh_rate, "disabled": bar.is_disabled,
                     "epoch_lines": text.count("\n"), "drawn": "Epoch 0" in text}
    cases["tqdm_progress_bar"] = out


class Nested(Reg):
    def __init__(self, prob):
        super().__init__(prob)
        self.encoder = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()))


def summary():
    module = Nested(prob)
    cases["model_summary"] = {
        str(depth): {"rows": summarize(module, max_depth=depth).layer_names}
        for depth in (1, 2, -1)}


class BnNet(Reg):
    def __init__(self, prob):
        super().__init__(prob)
        self.bn = nn.BatchNorm1d(4)

    def loss(self, batch):
        return nn.functional.mse_loss(self.layer(self.bn(batch["x"])), batch["y"])


def buffers():
    out = {}
    for use_buffers in (True, False):
        module = BnNet(prob)
        ema = callbacks.EMAWeightAveraging(decay=0.5, use_buffers=use_buffers, device="cpu")
        trainer(tmpdir(), max_epochs=1, limit_train_batches=3, callbacks=[ema]).fit(module, train)
        out[str(use_buffers)] = {"running_mean": module.bn.running_mean.tolist(),
                                 "kernel": module.layer.weight.detach().T.tolist()}
    cases["averaging_buffers"] = out


def monitors():
    out = {}
    try:
        trainer(tmpdir(), max_epochs=1, limit_train_batches=2,
                logger=L.loggers.CSVLogger(tmpdir()),
                callbacks=[callbacks.DeviceStatsMonitor()]).fit(Reg(prob), train)
        out["device_stats"] = "ran"
    except ModuleNotFoundError as err:  # on CPU Lightning's needs psutil
        out["device_stats"] = f"ModuleNotFoundError: {'psutil' in str(err)}"
    csv = L.loggers.CSVLogger(tmpdir())
    throughput = callbacks.ThroughputMonitor(batch_size_fn=lambda batch: len(batch["x"]),
                                             window_size=2)
    trainer(tmpdir(), max_epochs=1, limit_train_batches=4, logger=csv, log_every_n_steps=1,
            callbacks=[throughput]).fit(Reg(prob), train)
    with open(os.path.join(csv.log_dir, "metrics.csv")) as f:
        out["throughput_columns"] = sorted(f.readline().strip().split(","))
    cases["monitors"] = out


def tensorboard_dirs():
    import lightning.fabric.loggers.tensorboard as fabric_tb

    fabric_tb._TENSORBOARD_AVAILABLE = True  # only the directory naming runs; nothing is written
    root = tmpdir()
    out = {}
    for name, kw in {"auto": {}, "int": {"version": 3}, "str": {"version": "v7"}}.items():
        tb = L.loggers.TensorBoardLogger(os.path.join(root, "tb"), name="exp", **kw)
        out[name] = {"log_dir": os.path.relpath(tb.log_dir, root),
                     "save_dir": os.path.relpath(tb.save_dir, root), "name": tb.name,
                     "version": tb.version}
        os.makedirs(tb.log_dir, exist_ok=True)  # as the first logged value would
    out["second_auto"] = L.loggers.TensorBoardLogger(os.path.join(root, "tb"), name="exp").version
    cases["tensorboard_dirs"] = out


torch.manual_seed(0)
bars()
summary()
buffers()
monitors()
tensorboard_dirs()
write("arguments3", cases, prob)
