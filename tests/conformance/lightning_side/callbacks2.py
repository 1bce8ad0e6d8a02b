"""Lightning side of the `callbacks2` group: weight averaging (`WeightAveraging`,
`EMAWeightAveraging`) and other Lightning 2.6 callbacks jaxlight carries under their names.

Run only under the reference environment (torch CPU + lightning 2.6):
    /work/venv-lightning/bin/python tests/conformance/lightning_side/callbacks2.py
writes tests/conformance/fixtures/callbacks2.json.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import sys
import tempfile
import warnings

import lightning
import lightning.pytorch as L
import torch
from lightning.pytorch import callbacks
from torch import nn
from torch.utils.data import DataLoader, Dataset

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _data2_problem import checksum, make_problem  # noqa: E402

FIXTURES = HERE.parent / "fixtures"
warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
torch.set_num_threads(1)


class Examples(Dataset):
    def __init__(self, x, y):
        self.x, self.y = torch.tensor(x), torch.tensor(y)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class Reg(L.LightningModule):
    def __init__(self, prob, lr, optimizer="sgd"):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor(prob["kernel"].T))
            self.layer.bias.copy_(torch.tensor(prob["bias"]))
        self.lr, self.optimizer = lr, optimizer
        self.val_losses = []

    def loss(self, batch):
        return nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def training_step(self, batch, batch_idx):
        return self.loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self):
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[self.optimizer]
        return cls(self.parameters(), lr=self.lr)


def weights(module) -> dict:
    return {"kernel": module.layer.weight.detach().numpy().T.tolist(),
            "bias": module.layer.bias.detach().numpy().tolist()}


def averaging_case(make_callback, spec: dict, n=48, n_val=16, batch_size=8, epochs=3,
                   lr=0.05, optimizer="sgd") -> dict:
    prob = make_problem(n + n_val, seed=1)
    x, y = prob["x"], prob["y"]
    module = Reg(prob, lr, optimizer)
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            callbacks=[make_callback()], num_sanity_val_steps=0)
        trainer.fit(module, DataLoader(Examples(x[:n], y[:n]), batch_size=batch_size),
                    DataLoader(Examples(x[n:], y[n:]), batch_size=batch_size))
    return {"callback": spec, "n": n + n_val, "seed": 1, "checksum": checksum(prob),
            "n_train": n, "batch_size": batch_size, "epochs": epochs, "lr": lr,
            "optimizer": optimizer, "global_step": trainer.global_step,
            "val_losses": module.val_losses, "final": weights(module)}


class FakeClock:
    """`time.monotonic` advanced by 10 s at each training batch start: Timer cases become
    deterministic (the jaxlight side patches its Timer's clock the same way)."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now


class Tick(callbacks.Callback):
    def __init__(self, clock, events):
        self.clock, self.events = clock, events

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.now += 10.0

    def on_train_epoch_end(self, trainer, pl_module):
        self.events.append(f"epoch_end:{trainer.global_step}")

    def on_train_end(self, trainer, pl_module):
        self.events.append(f"train_end:{trainer.global_step}")


def timer_case(spec: dict, epochs=3, batches=5) -> dict:
    """spec: {"timer": Timer kwargs} or {"max_time": value}; 10 s per batch, 5 per epoch."""
    from lightning.pytorch.callbacks import timer as timer_module

    prob = make_problem(batches * 8, seed=2)
    clock, events = FakeClock(), []
    saved = timer_module.time
    timer_module.time = clock
    try:
        module = Reg(prob, 0.05)
        extra = [callbacks.Timer(**spec["timer"])] if "timer" in spec else []
        with tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=root,
                                max_time=spec.get("max_time"),
                                callbacks=[Tick(clock, events), *extra])
            trainer.fit(module, DataLoader(Examples(prob["x"], prob["y"]), batch_size=8))
    finally:
        timer_module.time = saved
    return {"spec": spec, "epochs": epochs, "n": batches * 8, "seed": 2,
            "checksum": checksum(prob), "batch_size": 8, "global_step": trainer.global_step,
            "events": events}


class Boom(callbacks.Callback):
    def __init__(self, at_step):
        self.at_step = at_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at_step:
            raise RuntimeError(f"boom at step {self.at_step}")


def on_exception_case(at_step=7, epochs=2, batches=5) -> dict:
    """A hook raises after step `at_step`; OnExceptionCheckpoint saves; a new fit resumes."""
    prob = make_problem(batches * 8, seed=3)

    def loader():
        return DataLoader(Examples(prob["x"], prob["y"]), batch_size=8)

    def trainer(root, extra):
        # A Checkpoint callback (OnExceptionCheckpoint is one) needs enable_checkpointing.
        return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=bool(extra), enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, callbacks=extra)

    with tempfile.TemporaryDirectory() as root:
        failed = trainer(root, [Boom(at_step), callbacks.OnExceptionCheckpoint(root)])
        with contextlib.suppress(RuntimeError):
            failed.fit(Reg(prob, 0.05), loader())
        ckpt = torch.load(f"{root}/on_exception.ckpt", weights_only=False)
        resumed_module = Reg(prob, 0.05)
        resumed = trainer(root, [])
        resumed.fit(resumed_module, loader(), ckpt_path=f"{root}/on_exception.ckpt")
    whole_module = Reg(prob, 0.05)
    with tempfile.TemporaryDirectory() as root:
        trainer(root, []).fit(whole_module, loader())
    return {"at_step": at_step, "epochs": epochs, "n": batches * 8, "seed": 3,
            "checksum": checksum(prob), "batch_size": 8,
            "saved_global_step": ckpt["global_step"], "resumed_global_step": resumed.global_step,
            "resumed": weights(resumed_module), "uninterrupted": weights(whole_module)}


class Writer(callbacks.BasePredictionWriter):
    def __init__(self, write_interval, calls):
        super().__init__(write_interval)
        self.calls = calls

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch,
                           batch_idx, dataloader_idx):
        self.calls.append(["batch", batch_idx, list(batch_indices), dataloader_idx,
                           prediction.detach().numpy().tolist()])

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.calls.append(["epoch", [p.detach().numpy().tolist() for p in predictions],
                           batch_indices])


def prediction_writer_case(write_interval: str, n=20, batch_size=8) -> dict:
    prob = make_problem(n, seed=4)
    calls = []

    class Predicting(Reg):
        def predict_step(self, batch, batch_idx):
            return self.layer(batch["x"])

    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            callbacks=[Writer(write_interval, calls)])
        returned = trainer.predict(Predicting(prob, 0.0),
                                   DataLoader(Examples(prob["x"], prob["y"]),
                                              batch_size=batch_size))
    return {"write_interval": write_interval, "n": n, "seed": 4, "checksum": checksum(prob),
            "batch_size": batch_size, "calls": calls, "returned": len(returned)}


def spike_case(kwargs: dict, spike_batch=6, batches=10, epochs=2) -> dict:
    """Batch `spike_batch` of each epoch has targets x50: a loss spike Lightning may catch."""
    from lightning.fabric.utilities.spike import TrainingSpikeException

    prob = make_problem(batches * 8, seed=5)
    y = prob["y"].copy()
    y[spike_batch * 8:(spike_batch + 1) * 8] *= 50
    module = Reg(prob, 0.02)
    raised = None
    with tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=root,
                            callbacks=[callbacks.SpikeDetection(**kwargs)])
        try:
            trainer.fit(module, DataLoader(Examples(prob["x"], y), batch_size=8))
        except TrainingSpikeException as exc:
            raised = str(exc)
        path = pathlib.Path(root) / "skip_batches.json"
        skipped = json.loads(path.read_text()) if path.exists() else None
    return {"kwargs": kwargs, "spike_batch": spike_batch, "epochs": epochs,
            "n": batches * 8, "seed": 5, "checksum": checksum(prob), "batch_size": 8,
            "raised": raised, "global_step": trainer.global_step,
            "skip_batches": skipped}


def main() -> None:
    timer_cases = {
        "timer_step_interval_stops_after_the_batch_that_reaches_it": timer_case(
            {"timer": {"duration": {"seconds": 25}, "interval": "step"}}),
        "timer_epoch_interval_stops_at_an_epoch_end": timer_case(
            {"timer": {"duration": {"seconds": 25}, "interval": "epoch"}}),
        "max_time_string_is_a_step_timer": timer_case({"max_time": "00:00:01:10"}),
        "timer_zero_duration_trains_nothing": timer_case(
            {"timer": {"duration": "00:00:00:00"}}),
    }
    cases = {
        "weight_averaging_default_is_swa_mean": averaging_case(
            lambda: callbacks.WeightAveraging(), {"name": "WeightAveraging", "kwargs": {}}),
        "ema_decay_start_and_every": averaging_case(
            lambda: callbacks.EMAWeightAveraging(decay=0.8, update_starting_at_step=4,
                                                 update_every_n_steps=2),
            {"name": "EMAWeightAveraging",
             "kwargs": {"decay": 0.8, "update_starting_at_step": 4, "update_every_n_steps": 2}}),
        "ema_adam_default_decay": averaging_case(
            lambda: callbacks.EMAWeightAveraging(decay=0.9),
            {"name": "EMAWeightAveraging", "kwargs": {"decay": 0.9}}, optimizer="adam",
            lr=0.01),
        # Updates start after the first validation: that validation sees the initial weights.
        "ema_validation_before_first_update_uses_initial_weights": averaging_case(
            lambda: callbacks.EMAWeightAveraging(decay=0.5, update_starting_at_step=8),
            {"name": "EMAWeightAveraging",
             "kwargs": {"decay": 0.5, "update_starting_at_step": 8}}),
    }
    other_cases = {"on_exception_checkpoint_resumes": on_exception_case()}
    other_cases["spike_detection_raises_at_the_spike"] = spike_case(
        {"window": 3, "warmup": 2})
    other_cases["spike_detection_tolerant_trains_on"] = spike_case(
        {"window": 3, "warmup": 2, "rtol": 1e6})
    for interval in ("batch", "epoch", "batch_and_epoch"):
        other_cases[f"prediction_writer_{interval}"] = prediction_writer_case(interval)
    from lightning.pytorch import loggers

    names = {"callbacks": sorted(callbacks.__all__), "loggers": sorted(loggers.__all__)}
    out = {"group": "callbacks2", "torch": torch.__version__, "lightning": lightning.__version__,
           "cases": cases, "timer_cases": timer_cases, "other_cases": other_cases,
           "lightning_names": names}
    FIXTURES.mkdir(exist_ok=True)
    path = FIXTURES / "callbacks2.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
