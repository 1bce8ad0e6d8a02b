"""GPipe: equivalence, per-stage memory, schedule length, bubble and collective-permute bytes.

Four measurements on 8 simulated CPU devices, one `jaxlight.nn.TransformerLM`:

1. equivalence: 10 training steps under SingleDevice, GPipe(stages=4, microbatches=8) (mesh
   data 2 × pipe 4) and Hybrid({"data": 2, "pipe": 4}); the largest relative loss difference
   and the largest parameter difference against SingleDevice.
2. memory: per-device bytes of the stacked-layer parameters (and their Adam slots) under GPipe
   against total / stages.
3. schedule: for m in --microbatches at a fixed global batch, how many times each
   collective-permute of the compiled step runs (the trip counts of the forward and backward
   schedule loops in the HLO; expected m + p − 1 each), the collective-permute bytes per step
   and device against 2(m + p − 1)·b·s·h·β (b: examples per microbatch and device), and the
   median step time. The bubble fraction (p − 1)/(m + p − 1) is reported beside a measured
   one: with a fixed global batch every iteration costs ∝ b = B/m, so the step time follows
   T(m) = α + β·(m + p − 1)/m; α (embedding, head, optimizer) and β (the stack's useful work)
   are fitted by least squares over the m values, and the measured bubble is the share of the
   schedule's time beyond its useful work, (T(m) − α − β)/(T(m) − α). Without any fit, the
   step time relative to the largest m is reported beside the schedule's ratio of
   (m + p − 1)/m. Steps are timed round robin over m (a changing machine load hits every m).
   Simulated devices share the host's cores, so an "idle" stage here computes on an empty
   buffer instead of idling: time still grows with iterations × microbatch size, as on chips.
4. remat: the compiled step's temporary bytes per device with and without `remat=True`.

    python benchmarks/pipeline.py                      # everything, writes results/pipeline.json
    python benchmarks/pipeline.py --only schedule --microbatches 1 2 4 8 16

Collectives come from `jaxlight.strategies._pipelined.schedule_stats` over
`jaxlight.analysis._hlo`, a
loop-aware reader of `compiled.as_text()` (a collective in a while body counts once per
iteration, from XLA's recorded trip count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import strategies  # noqa: E402
from jaxlight.nn._pipeline import bubble_fraction  # noqa: E402
from jaxlight.strategies._pipelined import schedule_stats  # noqa: E402

sys.path.insert(0, HERE)
from _common import lm_module  # noqa: E402


def token_batches(steps, batch, length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, size=(batch, 1))
        stride = rng.integers(1, 4, size=(batch, 1))
        out.append({"tokens": ((start + stride * np.arange(length)) % vocab).astype(np.int32)})
    return out


def _module(args):
    return lm_module(vocab=args.vocab, embed=args.embed, layers=args.layers, heads=args.heads,
                     mlp=args.mlp, lr=3e-3, weight_decay=0.01)


def _fit(args, strategy, steps, batch):
    losses = []
    log = jl.callbacks.LambdaCallback(
        on_log=lambda fit, module, metrics, step: losses.append(metrics["loss"]))
    fit = jl.Fit(strategy=strategy, max_steps=steps, log_every_n_steps=1, callbacks=[log],
                 enable_progress_bar=False, enable_model_summary=False, logger=False)
    module = _module(args)
    data = token_batches(steps, batch, args.seq + 1, args.vocab)
    fit.fit(module, data)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return fit, np.asarray(losses), params, data


def equivalence(args) -> dict:
    _, ref_losses, ref_params, _ = _fit(args, strategies.SingleDevice(), args.steps, args.batch)
    out = {"steps": args.steps, "global_batch": args.batch, "tolerance": 1e-4, "runs": {}}
    for name, strategy in (
        ("GPipe(stages=4, microbatches=8)", strategies.GPipe(4, 8)),
        ("Hybrid(data 2 x pipe 4, microbatches=8)",
         strategies.Hybrid({"data": 2, "pipe": 4}, microbatches=8)),
    ):
        fit, losses, params, _ = _fit(args, strategy, args.steps, args.batch)
        loss_rel = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
        param_abs = max(float(np.max(np.abs(a - b))) for a, b in
                        zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True))
        param_rel = max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-2))) for a, b in
                        zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True))
        out["runs"][name] = {
            "mesh": dict(fit.strategy.mesh.shape),
            "max_loss_rel_diff": loss_rel,
            "max_param_abs_diff": param_abs,
            "max_param_rel_diff": param_rel,
            "final_loss": float(losses[-1]), "single_final_loss": float(ref_losses[-1]),
            "compiles": fit.compile_counts.get("train"),
            "ok": loss_rel <= 1e-4 and param_abs <= 1e-4,
        }
        if "GPipe" in name:
            out["memory"] = memory(fit, stages=4)
    return out


def memory(fit, stages) -> dict:
    state = fit.state
    stacked = jax.tree.leaves(state.params["blocks"]["layers"])
    total = sum(x.nbytes for x in stacked)
    per_device = max(sum(x.addressable_shards[i].data.nbytes for x in stacked)
                     for i in range(len(stacked[0].addressable_shards)))
    slots = jax.tree.leaves(state.opt_state[0].mu["blocks"]["layers"]) + \
        jax.tree.leaves(state.opt_state[0].nu["blocks"]["layers"])
    slot_total = sum(x.nbytes for x in slots)
    slot_device = max(sum(x.addressable_shards[i].data.nbytes for x in slots)
                      for i in range(len(slots[0].addressable_shards)))
    return {
        "stacked_param_bytes_total": total,
        "stacked_param_bytes_per_device": per_device,
        "ratio_to_total_over_stages": per_device / (total / stages),
        "adam_slot_bytes_per_device": slot_device,
        "adam_slot_ratio_to_total_over_stages": slot_device / (slot_total / stages),
        "target": "<= 1.05",
        "ok": per_device <= 1.05 * total / stages,
    }


def _time_steps(fit, batch, steps) -> list[float]:
    """Seconds per step of the compiled train step, one step in flight (exact timings)."""
    compiled = fit.compiled_train_step
    state = fit.session.state
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    fit.session.state = state  # the previous state was donated
    return times


def schedule(args) -> dict:
    p = 4
    devices = jax.devices()[:p]  # one stage per device, no data axis: b = B / m
    rows, fits = [], {}
    for m in args.microbatches:
        strategy = strategies.GPipe(p, m, devices=devices)
        fit, _, _, data = _fit(args, strategy, 1, args.timing_batch)
        fits[m] = (fit, fit.strategy.put_batch(data[0], fit.session.train_batch_shardings))
        stats = schedule_stats(fit.compiled_train_step.as_text())
        b = args.timing_batch // m
        expected = 2 * (m + p - 1) * b * args.seq * args.embed * 4
        rows.append({
            "microbatches": m,
            "microbatch_size": b,
            "schedule_iterations": stats["iterations"],
            "expected_iterations": m + p - 1,
            "iterations_ok": stats["iterations"] == [m + p - 1] * 2,
            "collective_permute_bytes": stats["collective_permute_bytes"],
            "expected_permute_bytes": expected,
            "permute_bytes_rel_error": abs(stats["collective_permute_bytes"] - expected)
            / expected,
            "other_collectives": stats["other_collectives"],
            "bubble_fraction_theory": bubble_fraction(p, m),
        })
    # Round robin over m, so that a change in the machine's load hits every m alike.
    times: dict[int, list[float]] = {m: [] for m in args.microbatches}
    for _ in range(args.rounds):
        for m in args.microbatches:
            times[m] += _time_steps(*fits[m], args.timing_steps)[1:]
    for r in rows:
        r["step_seconds"] = statistics.median(times[r["microbatches"]])
    # T(m) = α + β·(m + p − 1)/m, least squares over the m values.
    x = np.array([(r["microbatches"] + p - 1) / r["microbatches"] for r in rows])
    t = np.array([r["step_seconds"] for r in rows])
    design = np.stack([np.ones_like(x), x], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, t, rcond=None)
    largest = rows[-1]
    for r, xi, ti in zip(rows, x, t, strict=True):
        r["step_seconds_fit"] = float(alpha + beta * xi)
        r["bubble_fraction_measured"] = float((ti - alpha - beta) / (ti - alpha))
        # Without the fit: the step time relative to the largest m, against the schedule's
        # (m + p − 1)/m ratio (exact if nothing but the stack's work costs time).
        r["time_ratio_to_largest_m"] = float(ti / largest["step_seconds"])
        r["time_ratio_theory"] = float(xi / x[-1])
    return {"stages": p, "global_batch": args.timing_batch, "seq": args.seq,
            "embed": args.embed, "rounds": args.rounds, "steps_per_round": args.timing_steps,
            "fit_alpha_s": float(alpha), "fit_beta_s": float(beta), "rows": rows}


def permute_bytes_8_devices(args) -> dict:
    """GPipe(4, 8) on 8 devices (data 2): per-device permute bytes with b per data shard."""
    fit, _, _, _ = _fit(args, strategies.GPipe(4, 8), 1, args.batch)
    stats = schedule_stats(fit.compiled_train_step.as_text())
    p, m, dp = 4, 8, 2
    b = args.batch // (m * dp)
    expected = 2 * (m + p - 1) * b * args.seq * args.embed * 4
    measured = stats["collective_permute_bytes"]
    return {"mesh": dict(fit.strategy.mesh.shape), "microbatch_size_per_device": b,
            "schedule_iterations": stats["iterations"],
            "collective_permute_bytes": measured, "expected": expected,
            "rel_error": abs(measured - expected) / expected,
            "ok": abs(measured - expected) <= 0.05 * expected,
            "other_collectives": stats["other_collectives"]}


def remat(args) -> dict:
    out = {}
    for flag in (False, True):
        fit, _, _, _ = _fit(args, strategies.GPipe(4, 8, remat=flag), 1, args.batch)
        mem = fit.compiled_train_step.memory_analysis()
        out[f"remat={flag}"] = {"temp_bytes_per_device": int(mem.temp_size_in_bytes)}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["equivalence", "schedule", "permute", "remat"],
                        nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="global batch (equivalence)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--embed", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--mlp", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--timing-batch", type=int, default=64)
    parser.add_argument("--timing-steps", type=int, default=5, help="steps per m and round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "pipeline.json"))
    args = parser.parse_args(argv)
    parts = args.only or ["equivalence", "permute", "schedule", "remat"]
    result = {"jax": jax.__version__, "devices": jax.device_count(),
              "platform": jax.devices()[0].platform, "cpus": os.cpu_count(),
              "model": {"embed": args.embed, "layers": args.layers, "seq": args.seq,
                        "vocab": args.vocab, "mlp": args.mlp, "heads": args.heads}}
    if "equivalence" in parts:
        result["equivalence"] = equivalence(args)
    if "permute" in parts:
        result["collective_permute_8_devices"] = permute_bytes_8_devices(args)
    if "schedule" in parts:
        result["schedule"] = schedule(args)
    if "remat" in parts:
        result["remat"] = remat(args)
    print(json.dumps(result, indent=2))
    if args.only is None:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
