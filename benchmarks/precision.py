"""Mixed precision on the digits recipe: validation accuracy of bf16 against float32.

Trains the digits recipe (its default 300 steps) once per precision policy under the same
strategy and seed, and reports the final validation accuracy and loss, the wall time and
whether each bf16 policy is within 1 accuracy point of float32 (the target for "bf16-mixed").

    python benchmarks/precision.py [--strategy dp] [--devices 8] \
        [--precisions 32-true,bf16-mixed,bf16-true] [--max-steps 300]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import setup_devices, strategy_from_name, write_result  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--strategy", default="dp")
    p.add_argument("--precisions", default="32-true,bf16-mixed,bf16-true")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    setup_devices(args.devices)
    import jaxlight as jl
    from jaxlight.recipes import digits

    rows = []
    for precision in args.precisions.split(","):
        module, data = digits.build(digits.Config(), max_steps=args.max_steps)
        fit = jl.Fit(strategy_from_name(args.strategy), max_steps=args.max_steps,
                     precision=precision, log_every_n_steps=50, enable_progress_bar=False,
                     enable_model_summary=False, logger=False)
        start = time.perf_counter()
        fit.fit(module, data.train)
        wall = time.perf_counter() - start
        val = fit.validate(module, data.val)
        rows.append({"precision": precision, "val_accuracy": val["val_accuracy"],
                     "val_loss": val["val_loss"], "train_loss": fit.logged_metrics.get("loss"),
                     "fit_seconds": round(wall, 2),
                     "compile_seconds": round(fit.compile_times.get("train", 0.0), 2)})
    base = next((r for r in rows if r["precision"] == "32-true"), None)
    if base is not None:
        for r in rows:
            r["accuracy_points_vs_fp32"] = round(100 * (r["val_accuracy"] - base["val_accuracy"]),
                                                 2)
            r["within_1_point"] = abs(r["accuracy_points_vs_fp32"]) <= 1.0
    write_result("precision", {"benchmark": "precision", "recipe": "digits",
                               "strategy": args.strategy, "devices": args.devices,
                               "max_steps": args.max_steps, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
