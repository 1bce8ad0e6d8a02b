"""Microbatches: collective bytes per optimizer step flat in k, temp memory falling.

At a fixed global batch, k microbatches (`callbacks.Microbatches(k)`, the scan that
`GradientAccumulation` also compiles) are scanned inside one compiled step. The gradient
collective must run once per optimizer step (after the loop), so the collective bytes read from
the compiled HLO (loop bodies counted once per iteration) must not grow with k; the temporary
memory (`memory_analysis().temp_size_in_bytes`) should fall as fewer activations are alive.

    python benchmarks/accumulation.py [--strategies dp,fsdp,ddp] [--ks 1,2,4,8]
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
    p.add_argument("--strategies", default="dp,fsdp,ddp")
    p.add_argument("--ks", default="1,2,4,8")
    p.add_argument("--batch", type=int, default=64, help="global batch (fixed across k)")
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    setup_devices(args.devices)
    from jaxlight import callbacks

    rows = []
    for name in args.strategies.split(","):
        # k = 0 stands for "no Microbatches callback" (the plain step), for reference.
        for k in [0] + [int(x) for x in args.ks.split(",")]:
            module = lm_module(layers=2)
            fit = quiet_fit(strategy_from_name(name),
                            callbacks=[callbacks.Microbatches(k)] if k else [])
            plan = fit.plan(module, token_batch(args.batch, args.length, 512), verbose=False)
            totals = plan.collective_totals

            rows.append({
                "strategy": name, "k": k,
                "collective_traffic_bytes": sum(t["traffic_bytes"] for t in totals.values()),
                "collective_buffer_bytes": sum(t["buffer_bytes"] for t in totals.values()),
                "collectives_in_loop": sum(1 for c in plan.collectives if c.in_loop
                                           and c.executions > 1),
                "by_kind": {kind: t for kind, t in totals.items() if t["count"]},
                "temp_bytes": plan.memory.get("temp"),
            })
    summary = {}
    for name in args.strategies.split(","):
        plain = next(r for r in rows if r["strategy"] == name and r["k"] == 0)
        mine = [r for r in rows if r["strategy"] == name and r["k"]]
        base = mine[0]["collective_traffic_bytes"]
        temps = [r["temp_bytes"] for r in mine]
        summary[name] = {
            "traffic_ratio_max_k_over_k1": mine[-1]["collective_traffic_bytes"] / base,
            "collective_traffic_bytes_by_k": {r["k"]: r["collective_traffic_bytes"] for r in mine},
            "collective_bytes_flat": all(abs(r["collective_traffic_bytes"] - base) <= 0.05 * base
                                         for r in mine),
            "temp_bytes_by_k": {r["k"]: r["temp_bytes"] for r in mine},
            "temp_falls_with_k": all(b < a for a, b in zip(temps, temps[1:], strict=False)),
            "plain_step_traffic_bytes": plain["collective_traffic_bytes"],
            "plain_step_temp_bytes": plain["temp_bytes"],
        }
    note = ("k counts microbatches of Microbatches(k) (one loader batch split in k); k=0 rows "
            "are the plain step without the callback. Traffic is the ring-algorithm bytes per "
            "device per optimizer step (jaxlight.analysis._hlo), loop bodies counted once per "
            "iteration.")
    write_result("accumulation", {"benchmark": "accumulation", "global_batch": args.batch,
                                  "rows": rows, "summary": summary, "note": note}, args.out)


if __name__ == "__main__":
    main()
