"""Observability figures: FLOP counts against analytic ones, and the cost of the monitors.

1. `flops`: a stack of L bias-free dense layers under `jl.nn.Stacked` (a scan), optionally
   with `Microbatches(k)` (a second, outer loop). Analytic training FLOPs:
   6 * B * D^2 * L (4 * B * D^2 for L = 1, where no loop is left and the unused input
   gradient is dropped). Reported: `compiled_flops` (loops multiplied out) and XLA's
   `cost_analysis()` alone, each over the analytic figure; under `dp` the count sums the 8
   devices, whose replicated optimizer update and gradient accumulation add a few percent.
2. `lm`: `jl.nn.TransformerLM` (Stacked blocks). Analytic: 6 * N_matmul * tokens (every
   weight used in a matmul: attention, SwiGLU, untied head) + 12 * L * T * d * tokens
   (attention scores and values, forward and backward, full T x T).
3. `overhead`: steps/s of a small MLP with no host callbacks against the same fit with
   ThroughputMonitor + LearningRateMonitor + DeviceStatsMonitor + CSVLogger, alternated over
   rounds; median step time from host timestamps (steady state).

    python benchmarks/observability.py                       # everything, 8 simulated devices
    python benchmarks/observability.py --only flops lm
    python benchmarks/observability.py --only overhead --steps 400 --rounds 5

Prints JSON; writes benchmarks/results/observability.json when everything runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._common import lm_module, setup_devices, token_batch, write_result  # noqa: E402


def flops_stack(args) -> list[dict]:
    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight import callbacks, strategies
    from jaxlight.analysis._flops import compiled_flops

    B, D = args.batch, args.width

    class Stack(jl.TrainModule):
        def __init__(self, layers: int):
            super().__init__()
            self.layers = layers

        def configure_model(self, rngs):
            return jl.nn.Stacked(lambda r: nnx.Linear(D, D, use_bias=False, rngs=r),
                                 self.layers, rngs=rngs)

        def configure_optimizers(self):
            return optax.sgd(0.01)

        def training_step(self, model, batch):
            return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, D)).astype(np.float32)
    data = [{"x": x, "y": np.tanh(x)}]
    out = []
    for strategy in ("single", "dp"):
        for layers in args.layers:
            for accumulate in (1, 4):
                fit = jl.Fit(strategies.resolve(strategy), max_steps=1,
                             callbacks=[callbacks.Microbatches(accumulate)]
                             if accumulate > 1 else [],
                             enable_progress_bar=False, enable_model_summary=False,
                             logger=False)
                fit.fit(Stack(layers), data)
                count = compiled_flops(fit.compiled_train_step)
                devices = fit.strategy.mesh.devices.size
                # Forward 2BD^2 and backward 4BD^2 per layer. A scan's uniform body computes
                # every layer's input gradient; a single layer (no loop left) skips it.
                analytic = 6.0 * B * D * D * layers if layers > 1 else 4.0 * B * D * D
                out.append({
                    "strategy": strategy, "devices": int(devices), "layers": layers,
                    "accumulate": accumulate, "analytic_flops": analytic,
                    "counted_flops": count.flops * devices,
                    "counted_over_analytic": count.flops * devices / analytic,
                    "xla_only_over_analytic": (count.xla_flops or 0) * devices / analytic,
                    "loops": [(lp.trip_count, lp.multiplicity) for lp in count.loops],
                })
    return out


def flops_lm(args) -> dict:
    import jaxlight as jl
    from jaxlight.analysis._flops import compiled_flops

    vocab, d, layers, heads, mlp, T, B = 512, 256, 4, 8, 1024, 128, 8
    module = lm_module(vocab=vocab, embed=d, layers=layers, heads=heads, mlp=mlp)
    fit = jl.Fit("single", max_steps=1, enable_progress_bar=False, enable_model_summary=False,
                 logger=False)
    fit.fit(module, [token_batch(B, T, vocab)])
    count = compiled_flops(fit.compiled_train_step)
    tokens = B * T
    n_matmul = layers * (4 * d * d + 3 * d * mlp) + d * vocab  # qkv+out, gate/up+down, head
    analytic = 6.0 * n_matmul * tokens + 12.0 * layers * T * d * tokens
    return {"config": {"vocab": vocab, "embed": d, "layers": layers, "heads": heads, "mlp": mlp,
                       "seq": T, "batch": B},
            "analytic_flops": analytic, "counted_flops": count.flops,
            "counted_over_analytic": count.flops / analytic,
            "xla_only_over_analytic": (count.xla_flops or 0) / analytic,
            "loops": [(lp.trip_count, lp.multiplicity) for lp in count.loops]}


def overhead(args) -> dict:
    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight import callbacks

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(64, 256, rngs=rngs)
            self.l2 = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.l1(x)))

    class Module(jl.TrainModule):
        def configure_model(self, rngs):
            return MLP(rngs)

        def configure_optimizers(self):
            return optax.adamw(optax.cosine_decay_schedule(1e-3, args.steps))

        def training_step(self, model, batch):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    rng = np.random.default_rng(0)
    n = 64 * 16
    data = {"x": rng.normal(size=(n, 64)).astype(np.float32),
            "y": rng.integers(0, 10, n).astype(np.int32)}

    def run(monitors: bool) -> float:
        stamps = []
        stamp = callbacks.LambdaCallback(
            on_train_batch_end=lambda *a: stamps.append(time.perf_counter()))
        extra = []
        if monitors:
            extra = [callbacks.ThroughputMonitor(), callbacks.LearningRateMonitor(),
                     callbacks.DeviceStatsMonitor(), callbacks.CSVLogger(tempfile.mkdtemp(),
                                                                         plot=False)]
        fit = jl.Fit("single", max_steps=args.steps, log_every_n_steps=10,
                     callbacks=[*extra, stamp], enable_progress_bar=False,
                     enable_model_summary=False, logger=False)
        fit.fit(Module(), jl.data.ArrayLoader(data, 64, seed=0))
        deltas = np.diff(stamps[len(stamps) // 5:])  # steady state
        return float(np.median(deltas))

    rounds = []
    for _ in range(args.rounds):
        plain, monitored = run(False), run(True)
        rounds.append({"plain_step_ms": plain * 1e3, "monitored_step_ms": monitored * 1e3,
                       "ratio": monitored / plain})
    ratios = sorted(r["ratio"] for r in rounds)
    return {"steps": args.steps, "rounds": rounds, "median_ratio": ratios[len(ratios) // 2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=["flops", "lm", "overhead"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, nargs="*", default=[1, 4, 16])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    setup_devices(args.devices)
    import jax

    report = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "devices": jax.device_count()}
    if "flops" in args.only:
        report["flops_stack"] = flops_stack(args)
    if "lm" in args.only:
        report["flops_lm"] = flops_lm(args)
    if "overhead" in args.only:
        report["overhead"] = overhead(args)
    everything = set(args.only) >= {"flops", "lm", "overhead"}
    if everything or args.out:
        write_result("observability", report, args.out)
    else:
        import json

        print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
