"""First-save cost of checkpoint checksums: what a save of a new state structure pays.

An asynchronous save dispatches a device-side copy of the state with a digest of every array
(`jaxlight.checkpoint._verify.snapshot_with_digests`), then the writer thread reads the digests
(`record()`); a restore recomputes them (`verify`). Whatever has to compile for a structure not
seen before is paid at the first save of every fit of a new model (the default ModelCheckpoint
saves in every fit) and at the first restore.

Runs, in one process and in this order, a save of each of five train-state trees shaped like
`state_tree`'s (parameters, optax state, step): an MLP with Adam; the same MLP with SGD momentum
(a new structure of the same shapes); a deeper MLP of the same widths with Adam (more arrays of
the same shapes); a restore's verification of the first MLP's parameters alone
(`load_checkpoint`); an MLP of other widths with Adam (new shapes). For each: CPU seconds
(process time: XLA compiles in other threads) and wall seconds of the first save (dispatch plus
waiting for the digests), of the dispatch alone, and the median steady-state dispatch.

    python benchmarks/checkpoint_first_save.py                 # one device
    python benchmarks/checkpoint_first_save.py --devices 8     # each matrix sharded over 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import setup_devices, write_result  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="steady-state dispatches timed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_devices(args.devices)

    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxlight.checkpoint import _verify

    mesh = jax.make_mesh((args.devices,), ("data",))
    rng = np.random.default_rng(0)

    def place(a):
        # FSDP-like: matrices split along their first axis when it divides, the rest replicated.
        spec = P("data") if a.ndim == 2 and a.shape[0] % args.devices == 0 else P()
        return jax.device_put(a, NamedSharding(mesh, spec))

    def mlp(widths):
        return {f"l{i}": {"kernel": place(rng.normal(size=(a, b)).astype(np.float32)),
                          "bias": place(np.zeros(b, np.float32))}
                for i, (a, b) in enumerate(zip(widths[:-1], widths[1:], strict=False))}

    def state(params, tx):
        return {"params": params, "opt_state": tx.init(params), "step": place(np.int32(7))}

    small = mlp([64, 256, 256, 10])
    cases = [
        ("mlp_adam", state(small, optax.adam(1e-3)), "save"),
        ("same_shapes_sgd_momentum", state(small, optax.sgd(1e-2, momentum=0.9)), "save"),
        ("deeper_same_widths_adam", state(mlp([64, 256, 256, 256, 10]), optax.adam(1e-3)),
         "save"),
        ("restore_params_only", {"params": small}, "verify"),
        ("new_widths_adam", state(mlp([64, 512, 128, 10]), optax.adam(1e-3)), "save"),
    ]

    def save(tree):
        copy, pending = _verify.snapshot_with_digests(tree)
        return copy, pending

    def timed(fn):
        cpu, wall = time.process_time(), time.perf_counter()
        result = fn()
        return result, time.process_time() - cpu, time.perf_counter() - wall

    report = {"devices": args.devices, "backend": jax.default_backend(),
              "algorithm": _verify.ALGORITHM, "cases": {}}
    records = {}
    for name, tree, kind in cases:
        jax.block_until_ready(tree)
        n = len(jax.tree.leaves(tree))
        if kind == "save":
            (copy, pending), d_cpu, d_wall = timed(lambda tree=tree: save(tree))
            record, r_cpu, r_wall = timed(pending.record)
            jax.block_until_ready(copy)
            records[name] = record
            steady = []
            for _ in range(args.repeats):
                (copy, pending), _, wall = timed(lambda tree=tree: save(tree))
                steady.append(wall)
                pending.record()
            report["cases"][name] = {
                "arrays": n, "first_save_cpu_s": round(d_cpu + r_cpu, 4),
                "first_save_wall_s": round(d_wall + r_wall, 4),
                "first_dispatch_wall_s": round(d_wall, 4),
                "steady_dispatch_wall_s": round(statistics.median(steady), 5)}
        else:
            saved = records["mlp_adam"]
            _, v_cpu, v_wall = timed(lambda tree=tree: _verify.verify("bench", tree, saved))
            _, _, again = timed(lambda tree=tree: _verify.verify("bench", tree, saved))
            report["cases"][name] = {"arrays": n, "first_verify_cpu_s": round(v_cpu, 4),
                                     "first_verify_wall_s": round(v_wall, 4),
                                     "steady_verify_wall_s": round(again, 5)}
    firsts = [c.get("first_save_cpu_s", c.get("first_verify_cpu_s"))
              for c in report["cases"].values()]
    report["total_first_cpu_s"] = round(sum(firsts), 3)
    write_result(f"checkpoint_first_save_{args.devices}dev", report, args.out)


if __name__ == "__main__":
    main()
