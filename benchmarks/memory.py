"""Memory per device by strategy, from `compiled.memory_analysis()`, against ZeRO arithmetic.

fp32 AdamW keeps 4 bytes of parameter and 8 of optimizer state per parameter: 12 bytes/param
on every device under DataParallel, 12/N under FSDP (ZeRO-3), plus the small parameters FSDP
leaves replicated (norm scales; below `min_shard_size`).

    python benchmarks/memory.py [--devices 8]
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
    p.add_argument("--strategies", default="single,dp,ddp,fsdp,tp2,hybrid")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    setup_devices(args.devices)
    import math

    import jax

    rows = []
    for name in args.strategies.split(","):
        module = lm_module()
        fit = quiet_fit(strategy_from_name(name))
        batch = token_batch(args.batch, args.length, 512)
        plan = fit.plan(module, batch, verbose=False)
        abstract_params = fit.session.spec.abstract_state.params
        n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params))
        replicated_small = sum(p.bytes for p in plan.params if p.bytes_per_device == p.bytes)
        n = jax.device_count()
        state_per_device = plan.param_bytes_per_device + plan.opt_state_bytes_per_device
        zero = {"single": 12 * n_params, "dp": 12 * n_params, "ddp": 12 * n_params,
                "fsdp": 12 * n_params / n + 2 * replicated_small}
        row = {
            "strategy": name,
            "mesh": plan.strategy.get("mesh"),
            "parameters": n_params,
            "param_bytes_per_device": plan.param_bytes_per_device,
            "opt_state_bytes_per_device": plan.opt_state_bytes_per_device,
            "state_bytes_per_device": state_per_device,
            "bytes_per_param_per_device": state_per_device / n_params,
            "replicated_param_bytes": replicated_small,
            "memory_analysis": plan.memory,
        }
        if name in zero:
            row["zero_theory_bytes"] = zero[name]
            row["ratio_to_theory"] = state_per_device / zero[name]
        rows.append(row)
    by = {r["strategy"]: r for r in rows}
    report = {"benchmark": "memory", "devices": args.devices, "rows": rows}
    if "dp" in by and "fsdp" in by:
        dp, fsdp = by["dp"], by["fsdp"]
        # Parameters FSDP leaves whole on every device, with their two AdamW slots.
        small = 3 * fsdp["replicated_param_bytes"]
        bound = 1.05 * dp["state_bytes_per_device"] / args.devices + small
        report["fsdp_vs_dp"] = {
            "fsdp_state_bytes_per_device": fsdp["state_bytes_per_device"],
            "dp_state_bytes_per_device": dp["state_bytes_per_device"],
            "replicated_small_state_bytes": small,
            "bound_1.05x_dp_over_n_plus_replicated_small": bound,
            "met": bool(fsdp["state_bytes_per_device"] <= bound),
        }
    report["note"] = ("state = parameters + optimizer state per device (fp32 AdamW: 12 B/param);"
                      " memory_analysis gives the compiled step's argument/output/temp bytes "
                      "per device")
    write_result("memory", report, args.out)


if __name__ == "__main__":
    main()
