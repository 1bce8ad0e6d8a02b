"""The gpt recipe's input pipeline: tokens/s with grain reading records on disk vs in memory.

The `gpt` recipe (its `tiny` preset by default) trains side by side, in alternating rounds, on
- `memory`: the training windows in one in-memory array behind an `ArrayLoader`;
- `grain`: the same windows as ArrayRecord files on disk, read by a grain pipeline in the
  training process (grain's background threads);
- `grain_workers`: the same pipeline read by `--workers` grain worker processes.
Each run uses `Fit`'s default device prefetch. Step time is the mean interval between
`on_train_batch_end` calls after `--warmup` steps; tokens/s = batch tokens / step time. The target
(issue 16): grain with worker processes keeps the in-memory tokens/s (ratio >= 0.95).

    python benchmarks/gpt_input.py                       # 8 simulated devices, DataParallel
    python benchmarks/gpt_input.py --devices 1 --steps 200 --rounds 5

Prints JSON; writes benchmarks/results/gpt_input.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import setup_devices, write_result  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    setup_devices(args.devices)

    import jax

    import jaxlight as jl
    from jaxlight import callbacks
    from jaxlight.recipes import gpt
    from jaxlight.recipes._base import apply_overrides

    records = tempfile.mkdtemp(prefix="gpt_input_")
    variants = {
        "memory": {"data.loader": "memory"},
        "grain": {"data.loader": "grain", "data.records_dir": records, "data.workers": 0},
        "grain_workers": {"data.loader": "grain", "data.records_dir": records,
                          "data.workers": args.workers},
    }

    def step_ms(overrides: dict) -> tuple[float, int]:
        config = apply_overrides(gpt.RECIPE.default_config(args.preset), overrides, "benchmark")
        module, data = gpt.build(config, args.steps)
        stamps = []
        cb = callbacks.LambdaCallback(
            on_train_batch_end=lambda *a: stamps.append(time.perf_counter()))
        fit = jl.Fit("dp" if args.devices > 1 else "single", max_steps=args.steps, callbacks=[cb],
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     log_every_n_steps=10**9)
        fit.fit(module, data.train)
        done = stamps[args.warmup:]
        tokens = config.data.batch_size * config.data.seq_len
        return (done[-1] - done[0]) / (len(done) - 1) * 1e3, tokens

    rounds = []
    for _ in range(args.rounds):
        row = {}
        for name, overrides in variants.items():
            ms, tokens = step_ms(overrides)
            row[name] = {"step_ms": ms, "tokens_per_s": tokens / ms * 1e3}
        row["grain_over_memory"] = row["grain"]["tokens_per_s"] / row["memory"]["tokens_per_s"]
        row["grain_workers_over_memory"] = (row["grain_workers"]["tokens_per_s"]
                                            / row["memory"]["tokens_per_s"])
        rounds.append(row)
    median = {name: {k: statistics.median(r[name][k] for r in rounds)
                     for k in ("step_ms", "tokens_per_s")} for name in variants}
    for key in ("grain_over_memory", "grain_workers_over_memory"):
        median[key] = statistics.median(r[key] for r in rounds)
    report = {
        "benchmark": "gpt_input",
        "device": f"{args.devices} x {jax.devices()[0].device_kind}",
        "config": {k: getattr(args, k) for k in ("preset", "devices", "steps", "warmup",
                                                 "rounds", "workers")},
        "median": median,
        "target_grain_workers_over_memory": 0.95,
        "met": median["grain_workers_over_memory"] >= 0.95,
        "rounds": rounds,
    }
    write_result("gpt_input", report, args.out)
    return report


if __name__ == "__main__":
    main()
