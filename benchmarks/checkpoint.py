"""Checkpoint cost: how long a save blocks the training loop, async vs sync, and resume time.

Trains an MLP (`--width` wide, `--layers` deep, Adam: 3x the parameters in state) for `--steps`
steps four times: without checkpoints, with an asynchronous ModelCheckpoint every `--every`
steps, with a synchronous one, and with an asynchronous one whose previous save is waited for
outside the timed region (`async_writer_idle`: what a save costs the loop when the writer keeps
up; in `async` a save also waits for the previous one when writing takes longer than `--every`
steps). Reports seconds per step, the time each save held the loop (inside ModelCheckpoint's
hook), the bytes of the last checkpoint and the time to restore.

    python benchmarks/checkpoint.py --devices 8 --strategy fsdp --width 1024 --layers 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import setup_devices, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--strategy", default="fsdp", choices=["single", "dp", "fsdp"])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--compress", action="store_true",
                        help="ModelCheckpoint(compress=True): orbax's zstd on the array data")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_devices(args.devices)

    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight import callbacks, strategies

    class Deep(nnx.Module):
        def __init__(self, width, layers, rngs):
            self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(layers)])

        def __call__(self, x):
            for layer in self.layers:
                x = nnx.relu(layer(x))
            return x

    class Module(jl.TrainModule):
        def __init__(self, width=1024, layers=4):
            super().__init__()
            self.width, self.layers = width, layers

        def configure_model(self, rngs):
            return Deep(self.width, self.layers, rngs)

        def configure_optimizers(self):
            return optax.adam(1e-4)

        def training_step(self, model, batch):
            return ((model(batch["x"]) - batch["x"]) ** 2).mean()

    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(args.batch * 8, args.width)).astype(np.float32)}

    class TimedCheckpoint(callbacks.ModelCheckpoint):
        blocked: list

        idle_writer = False

        def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
            # The step itself must finish before its state can be copied; time only the save.
            jax.block_until_ready(fit.state)
            if self.idle_writer and self._writer is not None:
                self._writer.wait()  # the previous save has committed: not timed
            start = time.perf_counter()
            super().on_train_batch_end(fit, module, outputs, batch, batch_idx)
            if fit.global_step % self.every_n_steps == 0:
                self.blocked.append(time.perf_counter() - start)

    def make_strategy():
        return {"single": strategies.SingleDevice, "dp": strategies.DataParallel,
                "fsdp": lambda: strategies.FSDP(min_shard_size=1)}[args.strategy]()

    def run(mode: str, root: str) -> dict:
        step_times: list[float] = []
        last = [time.perf_counter()]

        def tick(fit, module, outputs, batch, batch_idx):
            jax.block_until_ready(outputs.metrics)  # per-step time of a finished step
            now = time.perf_counter()
            step_times.append(now - last[0])
            last[0] = now

        cbs = []
        ckpt = None
        if mode != "none":
            ckpt = TimedCheckpoint(os.path.join(root, mode), every_n_steps=args.every,
                                   save_top_k=1, async_save=(mode != "sync"),
                                   compress=args.compress)
            ckpt.blocked = []
            ckpt.idle_writer = mode == "async_writer_idle"
            cbs.append(ckpt)
        cbs.append(callbacks.LambdaCallback(on_train_batch_end=tick))
        fit = jl.Fit(make_strategy(), max_steps=args.steps, callbacks=cbs,
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     log_every_n_steps=args.steps)
        start = time.perf_counter()
        fit.fit(Module(args.width, args.layers), jl.data.ArrayLoader(data, args.batch))
        total = time.perf_counter() - start
        steady = step_times[2:]  # the first steps include compilation
        out = {"seconds_total": round(total, 3),
               "seconds_per_step_median": round(statistics.median(steady), 5)}
        if ckpt is not None:
            out["saves"] = len(ckpt.blocked)
            out["loop_blocked_per_save_median_s"] = round(statistics.median(ckpt.blocked), 5)
            out["loop_blocked_per_save_max_s"] = round(max(ckpt.blocked), 5)
        return out

    root = tempfile.mkdtemp(prefix="jaxlight-ckpt-bench-")
    try:
        report = {"config": vars(args), "jax": jax.__version__,
                  "load_average": os.getloadavg()[0], "cpus": os.cpu_count(),
                  "devices": f"{jax.device_count()} x {jax.devices()[0].platform}"}
        module = Module(args.width, args.layers)
        params = sum(x.size for x in jax.tree.leaves(
            nnx.state(nnx.eval_shape(lambda: module.configure_model(nnx.Rngs(0))), nnx.Param)))
        report["parameters"] = int(params)
        report["state_megabytes"] = round(params * 4 * 3 / 2**20, 1)  # params + Adam mu, nu
        for mode in ("none", "async", "sync", "async_writer_idle"):
            report[mode] = run(mode, root)
        sync = report["sync"]["loop_blocked_per_save_median_s"]
        report["async_over_sync_hold"] = round(
            report["async"]["loop_blocked_per_save_median_s"] / sync, 4)
        report["async_writer_idle_over_sync_hold"] = round(
            report["async_writer_idle"]["loop_blocked_per_save_median_s"] / sync, 4)
        # Restore cost: resume the async run's last checkpoint for one more step.
        fit = jl.Fit(make_strategy(), max_steps=args.steps + 1, enable_progress_bar=False,
                     enable_model_summary=False, logger=False)
        from jaxlight.checkpoint._restore import restore_training

        fit.session.setup(Module(args.width, args.layers))
        start = time.perf_counter()
        restored = restore_training(fit.session, os.path.join(root, "async"))
        jax.block_until_ready(restored.state)
        report["restore_seconds"] = round(time.perf_counter() - start, 3)
        last = os.path.join(root, "async", str(args.steps), "state")
        report["checkpoint_megabytes"] = round(sum(
            os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(last)
            for f in files) / 2**20, 1)
        write_result("checkpoint", report, args.out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
