"""Compile time per strategy: the transformer LM's train step, compiled ahead of time by Fit.

Each strategy runs a 2-step fit in a fresh `Fit`; `fit.compile_times` holds the seconds spent
in lowering + compiling each step kind (init includes running the initializer once).

    python benchmarks/compile_time.py [--strategies single,dp,ddp,fsdp,tp2,hybrid,gpipe4]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    lm_module,
    quiet_fit,
    setup_devices,
    strategy_from_name,
    token_batch,
    write_result,  # noqa: E402
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--strategies", default="single,dp,ddp,fsdp,tp2,hybrid,gpipe4")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    setup_devices(args.devices)
    import jax

    rows = []
    batches = [token_batch(args.batch, args.length, 512, seed=i) for i in range(2)]
    for name in args.strategies.split(","):
        fit = quiet_fit(strategy_from_name(name), max_steps=2)
        fit.fit(lm_module(), batches)
        rows.append({"strategy": name, "mesh": fit.strategy.describe().get("mesh"),
                     "compile_seconds": {k: round(v, 3) for k, v in fit.compile_times.items()},
                     "compiles": dict(fit.compile_counts)})
    write_result("compile_time", {"benchmark": "compile_time", "devices": jax.device_count(),
                                  "rows": rows}, args.out)


if __name__ == "__main__":
    main()
