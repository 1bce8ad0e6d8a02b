"""Device prefetch: step time with a slow loader, with and without `Fit(prefetch_batches=...)`.

A loader that spends `--load-ms` of host time on every batch (sleeping, as reading records from
disk or the network waits; or `--work numpy`, busy NumPy work) feeds an MLP whose step takes
about `--hidden`-dependent milliseconds. Measured side by side, in alternating rounds:
- compute: the step time with batches already in memory (no load cost);
- load: the loader's time per batch, iterated alone;
- prefetch 0 and prefetch N: the step time with the slow loader.
Step time is the median interval between `on_train_batch_end` calls after the first steps. The
targets (issue 16): with prefetch, within 10% of max(load, compute); without, about their sum.

    python benchmarks/prefetch.py                    # 5 ms load, ~10 ms step, 1 device
    python benchmarks/prefetch.py --load-ms 8 --work numpy --rounds 3

Prints JSON; writes benchmarks/results/prefetch.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import setup_devices, write_result  # noqa: E402


class SlowLoader:
    """Cycles over a few batches, spending `loads_ms[i % len(loads_ms)]` of host time on batch i.

    `steady`: the same time on every batch. `bursty`: the same mean, all of it on every 4th batch
    (a new file opened, a shuffle buffer refilled, a garbage collection).
    """

    def __init__(self, batches, steps, load_ms, work, pattern="steady"):
        self.batches, self.steps, self.work = batches, steps, work
        self.loads_s = [load_ms / 1e3] if pattern == "steady" else [0, 0, 0, 4 * load_ms / 1e3]

    def _spend(self, seconds):
        if self.work == "sleep":
            time.sleep(seconds)
            return
        import numpy as np

        end = time.perf_counter() + seconds
        a = np.ones((64, 64), np.float32)
        while time.perf_counter() < end:
            a = np.tanh(a @ a * 1e-3)

    def __iter__(self):
        for i in range(self.steps):
            seconds = self.loads_s[i % len(self.loads_s)]
            if seconds:
                self._spend(seconds)
            yield self.batches[i % len(self.batches)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--load-ms", type=float, default=5.0)
    p.add_argument("--work", choices=["sleep", "numpy"], default="sleep")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    setup_devices(args.devices)

    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight import callbacks

    class MLP(nnx.Module):
        def __init__(self, d, h, rngs):
            self.l1 = nnx.Linear(d, h, rngs=rngs)
            self.l2 = nnx.Linear(h, h, rngs=rngs)
            self.l3 = nnx.Linear(h, 10, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    class Module(jl.TrainModule):
        def configure_model(self, rngs):
            return MLP(args.hidden, args.hidden, rngs)

        def configure_optimizers(self):
            return optax.adam(1e-4)

        def training_step(self, model, batch):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)
    batches = [{"x": rng.normal(size=(args.batch, args.hidden)).astype(np.float32),
                "y": rng.integers(0, 10, args.batch).astype(np.int32)} for _ in range(4)]

    def step_ms(load_ms, depth, pattern="steady"):
        stamps = []
        cb = callbacks.LambdaCallback(
            on_train_batch_end=lambda *a: stamps.append(time.perf_counter()))
        strategy = "single" if args.devices == 1 else "dp"
        fit = jl.Fit(strategy, max_steps=args.steps, callbacks=[cb], prefetch_batches=depth,
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     log_every_n_steps=10**9)
        fit.fit(Module(), SlowLoader(batches, args.steps, load_ms, args.work, pattern))
        # Mean over whole cycles of the load pattern (a bursty loader's cost comes in bursts).
        done = stamps[args.warmup:]
        n = (len(done) - 1) // 4 * 4
        return (done[n] - done[0]) / n * 1e3

    def load_ms(pattern):
        loader = SlowLoader(batches, 60, args.load_ms, args.work, pattern)
        start = time.perf_counter()
        for _ in loader:
            pass
        return (time.perf_counter() - start) / 60 * 1e3

    rounds = {"steady": [], "bursty": []}
    for _ in range(args.rounds):
        compute = step_ms(0.0, args.depth)
        for pattern, rows in rounds.items():
            r = {"compute_ms": compute, "load_ms": load_ms(pattern),
                 "no_prefetch_ms": step_ms(args.load_ms, 0, pattern),
                 "prefetch_ms": step_ms(args.load_ms, args.depth, pattern)}
            r["max_ms"] = max(r["compute_ms"], r["load_ms"])
            r["sum_ms"] = r["compute_ms"] + r["load_ms"]
            r["prefetch_over_max"] = r["prefetch_ms"] / r["max_ms"]
            r["no_prefetch_over_max"] = r["no_prefetch_ms"] / r["max_ms"]
            r["no_prefetch_over_sum"] = r["no_prefetch_ms"] / r["sum_ms"]
            rows.append(r)
    median = {pattern: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
              for pattern, rows in rounds.items()}
    report = {
        "benchmark": "prefetch",
        "config": {k: getattr(args, k) for k in ("load_ms", "work", "hidden", "batch", "steps",
                                                 "warmup", "rounds", "depth", "devices")},
        "median": median,
        "target_prefetch_over_max": 1.10,
        "prefetch_met": all(m["prefetch_over_max"] <= 1.10 for m in median.values()),
        "rounds": rounds,
    }
    write_result("prefetch", report, args.out)
    return report


if __name__ == "__main__":
    main()
