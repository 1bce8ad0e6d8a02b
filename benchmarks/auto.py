"""What `Fit("auto")` chooses for transformer LMs of several sizes under several memory budgets.

For each model, every candidate layout of 8 simulated CPU devices is compiled once (an
unbounded search: the reference table of bytes per device, collective bytes and predicted step
time). Then `strategies.Auto` runs with each budget, bounded as it is by default, and the report
compares its choice with the best layout of the full table that fits the same budget (the
fastest predicted): whether the bounded search found it, how many compiles it took and how long
choosing took. Budgets lie between the least any layout needs and what DataParallel needs
(compiled bytes per device): a fraction f gives `least + f × (DP − least)` usable bytes, so
that each step down forces more sharding; `real` is the machine's memory (the default budget).

A persistent compilation cache in a temporary directory serves the repeated compiles of one
candidate (same model, batch and layout) across budgets, as it would across runs; the reported
choosing times are from those runs. XLA's LLVM backend runs at -O0 (as in the tests): memory
analysis and collectives come from the HLO passes, which it does not change.

    python benchmarks/auto.py [--devices 8] [--sizes xs,s] [--fractions real,1,0.5,0.1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import lm_module, quiet_fit, setup_devices, token_batch, write_result  # noqa: E402

#: name -> (vocab, embed, layers, heads, mlp)
SIZES = {
    "xs": (256, 64, 2, 4, 256),
    "s": (512, 128, 2, 8, 512),
    "m": (1024, 256, 4, 8, 1024),
}


def run_auto(size, batch, cache, **auto_kw):
    from jaxlight import strategies

    vocab, embed, layers, heads, mlp = SIZES[size]
    module = lm_module(vocab=vocab, embed=embed, layers=layers, heads=heads, mlp=mlp)
    auto = strategies.Auto(verbose=False, **auto_kw)
    fit = quiet_fit(auto, compilation_cache=cache)
    start = time.perf_counter()
    try:
        fit.plan(module, batch, verbose=False)
    except Exception as err:  # noqa: BLE001 - "nothing fits" is a result of the sweep
        return auto, None, time.perf_counter() - start, f"{type(err).__name__}: {err}"
    return auto, fit.strategy, time.perf_counter() - start, None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--sizes", default="xs,s")
    p.add_argument("--fractions", default="real,1,0.5,0.1")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    setup_devices(args.devices)
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    import jax

    cache = tempfile.mkdtemp(prefix="jaxlight_auto_bench_")
    models = []
    for size in args.sizes.split(","):
        vocab = SIZES[size][0]
        batch = token_batch(args.batch, args.length, vocab)
        full, _, full_s, _ = run_auto(size, batch, cache, shortcut=0, max_compiles=10**6,
                                      explore=10**6)
        table = {c.layout: c for c in full.choice.candidates}
        dp_need = table[f"data={args.devices}"].bytes_per_device
        least = min(c.bytes_per_device for c in table.values() if c.bytes_per_device)
        params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
            _param_shapes(size)))
        runs = []
        for frac in args.fractions.split(","):
            kw = {} if frac == "real" else {
                "memory_budget": int((least + float(frac) * (dp_need - least)) / 0.9) + 1}
            auto, chosen, seconds, error = run_auto(size, batch, cache, **kw)
            usable = (auto.choice.usable_bytes if auto.choice is not None
                      else int(kw["memory_budget"] * 0.9))
            fitting = [c for c in table.values() if c.fits is not None
                       and c.bytes_per_device <= usable]
            best = min(fitting, key=lambda c: c.predicted_s, default=None)
            runs.append({
                "budget": frac,
                "budget_bytes": None if auto.choice is None else auto.choice.budget_bytes,
                "usable_bytes": usable,
                "chosen": None if auto.choice is None else auto.choice.chosen,
                "reason": None if auto.choice is None else auto.choice.reason,
                "error": error,
                "compiles": None if auto.choice is None else auto.choice.compiles,
                # choosing alone (Auto.choice.seconds: screening and candidate compiles)
                "choose_seconds": round(auto.choice.seconds if auto.choice else seconds, 2),
                # the whole Fit.plan call: model spec, choosing, the chosen step's compile
                "plan_seconds": round(seconds, 2),
                "best_of_full_table": None if best is None else best.layout,
                "found_best": (best is None and chosen is None) or (
                    best is not None and auto.choice is not None
                    and auto.choice.chosen == best.layout),
                # the full table's prediction for the chosen layout over the best one's
                "predicted_vs_best": (None if best is None or auto.choice is None else round(
                    table[auto.choice.chosen].predicted_s / best.predicted_s, 4)),
                "candidates": None if auto.choice is None else [
                    {k: c.to_dict()[k] for k in ("layout", "status", "bytes_per_device",
                                                  "predicted_s")}
                    for c in auto.choice.candidates],
            })
            print(f"{size} budget {frac}: {runs[-1]['chosen']} ({runs[-1]['compiles']} compiles, "
                  f"{runs[-1]['choose_seconds']:.1f} s); best of full table "
                  f"{runs[-1]['best_of_full_table']}",
                  file=sys.stderr, flush=True)
        models.append({
            "size": size,
            "config": dict(zip(("vocab", "embed", "layers", "heads", "mlp"), SIZES[size],
                               strict=True)),
            "param_bytes": params,
            "batch": [args.batch, args.length + 1],
            "full_search_seconds": round(full_s, 1),
            "full_table": [{k: v for k, v in c.to_dict().items() if k != "memory"}
                           for c in full.choice.candidates],
            "full_table_text": full.choice.table(),
            "runs": runs,
        })
    report = {
        "devices": f"{args.devices} simulated CPU devices (2 shared cores)",
        "device_row": full.choice.to_dict()["device"],
        "models": models,
        "found_best": sum(r["found_best"] for m in models for r in m["runs"]),
        "runs": sum(len(m["runs"]) for m in models),
        "max_compiles": max((r["compiles"] or 0) for m in models for r in m["runs"]),
        "worst_predicted_vs_best": max((r["predicted_vs_best"] or 1.0) for m in models
                                       for r in m["runs"]),
        "max_choose_seconds": max(r["choose_seconds"] for m in models for r in m["runs"]),
    }
    write_result("auto", report, args.out)


def _param_shapes(size):
    from flax import nnx

    from jaxlight import nn

    vocab, embed, layers, heads, mlp = SIZES[size]
    config = nn.TransformerConfig(vocab_size=vocab, embed_dim=embed, num_layers=layers,
                                  num_heads=heads, mlp_dim=mlp, tie_embeddings=False)
    model = nnx.eval_shape(lambda: nn.TransformerLM(config, rngs=nnx.Rngs(0)))
    return nnx.state(model, nnx.Param)


if __name__ == "__main__":
    main()
