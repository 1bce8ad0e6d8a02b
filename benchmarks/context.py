"""Context parallelism (`Hybrid({"context": n})`): activation memory, collectives, equality, reach.

A tiny `TransformerLM` (width 32, 2 heads of 16, 1 layer, vocabulary 64, batch 1) on 8
simulated CPU devices, for both attention algorithms ("ring": keys/values passed around the
context ring; "allgather": gathered once per layer). Everything but the step times comes from
the compiled step (`Fit.plan`: `memory_analysis()` and the HLO's collectives); nothing is
allocated at the long lengths.

1. memory: at sequence length L (default 4096 and 16384), the compiled step's temporary bytes
   per device (the activations) for context degree n = 1, 2, 4, 8, and their ratio to n = 1.
2. collectives: the attention's collectives per step from the HLO against theory, for one
   layer's keys and values of `B·L·H·D` elements of β bytes:
   ring       collective-permutes: (n−1) hops × 2 (K, V) forward and the same of dK, dV
              backward, B·(L/n)·H·D·β each: 4(n−1)·B·(L/n)·H·D·β per device;
   allgather  all-gathers of K, V forward, reduce-scatters of dK, dV backward:
              2·2(n−1)/n·B·L·H·D·β of ring traffic, the same bytes as the ring.
   The gradient all-reduce over `context` (parameters are replicated over it) is reported
   beside them.
3. equality: 10 AdamW steps at L = 1024 under context=8, both algorithms, against
   SingleDevice (max absolute loss difference, target ≤ 1e-5).
4. step time (CPU, side by side, round robin): context=8 ring vs allgather at L = 4096.
5. reach: the longest sequence (a multiple of 256·n) whose compiled step fits a fixed
   per-device budget (the single device's bytes at L = 4096), for n = 1, 2, 4, 8, found by
   bisection on compiled `memory_analysis()` (argument + output + temp − alias).

    python benchmarks/context.py                  # everything: results/context.json
    python benchmarks/context.py --only memory --lengths 4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import setup_devices, write_result  # noqa: E402

setup_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks, nn, strategies  # noqa: E402

WIDTH, HEADS, LAYERS, VOCAB, BATCH = 32, 2, 1, 64, 1
HEAD_DIM = WIDTH // HEADS
ALGORITHMS = ("ring", "allgather")


class LM(jl.TrainModule):
    def __init__(self, layers: int = LAYERS):
        super().__init__()
        self.config = nn.TransformerConfig(vocab_size=VOCAB, embed_dim=WIDTH, num_layers=layers,
                                           num_heads=HEADS, mlp_dim=2 * WIDTH,
                                           tie_embeddings=False)

    def configure_model(self, rngs):
        return nn.TransformerLM(self.config, rngs=rngs)

    def configure_optimizers(self):
        return optax.adamw(3e-3)

    def training_step(self, model, batch):
        logits = model(batch["tokens"][:, :-1])
        return nn.lm_loss(logits, batch["tokens"][:, 1:])


def tokens(length: int, steps: int = 1, seed: int = 0, batch: int = BATCH) -> list[dict]:
    """`steps` batches of learnable sequences of `length` + 1 tokens (the model sees `length`)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, VOCAB, size=(batch, 1))
        stride = rng.integers(1, 4, size=(batch, 1))
        out.append({"tokens": ((start + stride * np.arange(length + 1)) % VOCAB)
                    .astype(np.int32)})
    return out


def strategy(n: int, algorithm: str):
    if n == 1:
        return strategies.SingleDevice()
    return strategies.Hybrid({"context": n}, context_attention=algorithm,
                             devices=jax.devices()[:n])


def plan(n: int, algorithm: str, length: int):
    fit = jl.Fit(strategy(n, algorithm), max_steps=1, enable_progress_bar=False, logger=False,
                 enable_model_summary=False)
    return fit.plan(LM(), tokens(length)[0], verbose=False)


def footprint(p) -> int:
    m = p.memory
    return m["argument"] + m["output"] + m["temp"] - m["alias"]


def kv_bytes(length: int) -> int:
    return BATCH * length * HEADS * HEAD_DIM * 4


def theory(n: int, algorithm: str, length: int) -> float:
    """Ring traffic per device and step of the attention's collectives (all layers)."""
    if n == 1:
        return 0.0
    per_layer = 4 * (n - 1) * kv_bytes(length) / n  # K, V forward; dK, dV backward
    return LAYERS * per_layer


def attention_collectives(p, n: int, algorithm: str) -> dict:
    """The attention's collectives, by kind, from the compiled step (groups of n devices)."""
    out: dict = {}
    for c in p.collectives:
        if c.group_size != n or c.result_bytes <= 8:  # scalars: the ring's hop counter
            continue
        if not all(dtype.startswith(("f", "bf")) for dtype, _ in c.shapes):
            continue  # int32 tokens shifted by one across shard boundaries, not attention
        if c.kind not in (("collective-permute",) if algorithm == "ring"
                          else ("all-gather", "reduce-scatter")):
            continue
        row = out.setdefault(c.kind, {"count": 0, "traffic_bytes": 0.0})
        row["count"] += c.executions
        row["traffic_bytes"] += c.traffic_bytes * c.executions
    return out


def memory_section(lengths, degrees) -> dict:
    out = {}
    for length in lengths:
        rows = {}
        for algorithm in ALGORITHMS:
            base = None
            for n in degrees:
                if n == 1 and algorithm != ALGORITHMS[0]:  # one device: no algorithm
                    rows[f"{algorithm} n=1"] = dict(rows[f"{ALGORITHMS[0]} n=1"],
                                                    algorithm=algorithm)
                    base = rows[f"{algorithm} n=1"]["temp_bytes"]
                    continue
                p = plan(n, algorithm, length)
                found = attention_collectives(p, n, algorithm)
                measured = sum(r["traffic_bytes"] for r in found.values())
                grads = sum(c.traffic_bytes * c.executions for c in p.collectives
                            if c.kind == "all-reduce" and c.group_size == n)
                temp = p.memory["temp"]
                base = temp if n == 1 else base
                rows[f"{algorithm} n={n}"] = {
                    "context": n, "algorithm": algorithm, "temp_bytes": temp,
                    "footprint_bytes": footprint(p), "temp_ratio_to_n1": temp / base,
                    "ideal_ratio": 1 / n,
                    "attention_collectives": found,
                    "attention_traffic_bytes": measured,
                    "theory_traffic_bytes": theory(n, algorithm, length),
                    "other_all_reduce_traffic_bytes": grads,
                }
                print(f"L={length} {algorithm} n={n}: temp {temp / 2**20:.1f} MiB "
                      f"(x{temp / base:.3f}), attention traffic {measured / 2**20:.2f} MiB "
                      f"(theory {theory(n, algorithm, length) / 2**20:.2f})", file=sys.stderr)
        out[str(length)] = rows
    return out


class _Losses(callbacks.Callback):
    def __init__(self):
        self.losses = []

    def on_log(self, fit, module, metrics, step):
        if "loss" in metrics:
            self.losses.append(float(metrics["loss"]))


def train(s, length: int, steps: int, module=None, batch: int = BATCH):
    rec = _Losses()
    fit = jl.Fit(s, max_steps=steps, log_every_n_steps=1, callbacks=[rec],
                 enable_progress_bar=False, enable_model_summary=False, logger=False)
    module = module or LM()
    fit.fit(module, tokens(length, steps, batch=batch))
    return fit, np.asarray(rec.losses)


def equality_section(length: int, steps: int, make_strategy=lambda a: strategy(8, a),
                     layers: int = LAYERS, batch: int = BATCH) -> dict:
    """Losses over `steps` steps under `make_strategy(algorithm)` for both algorithms, against
    SingleDevice (max absolute difference, target ≤ 1e-5)."""
    _, ref = train(strategies.SingleDevice(), length, steps, LM(layers), batch)
    out = {"length": length, "steps": steps, "single_losses": ref.tolist(), "runs": {}}
    for algorithm in ALGORITHMS:
        _, losses = train(make_strategy(algorithm), length, steps, LM(layers), batch)
        diff = float(np.max(np.abs(losses - ref)))
        out["runs"][algorithm] = {"losses": losses.tolist(), "max_abs_loss_diff": diff,
                                  "ok": diff <= 1e-5 and len(losses) == steps}
    return out


def time_section(length: int, rounds: int, steps: int) -> dict:
    runs = {}
    for algorithm in ALGORITHMS:
        fit, _ = train(strategy(8, algorithm), length, 1)
        batch = jax.device_put(tokens(length)[0], fit.strategy.batch_shardings(tokens(length)[0]))
        runs[algorithm] = [fit.session.compiled_train_step, fit.state, batch, []]
    for _ in range(rounds):
        for run in runs.values():
            step, state, batch, times = run
            state, metrics = step(state, batch)  # warm (and the first round after the other)
            jax.block_until_ready(metrics)
            start = time.perf_counter()
            for _ in range(steps):  # one step in flight at a time
                state, metrics = step(state, batch)
                jax.block_until_ready(metrics)
            times.append((time.perf_counter() - start) / steps)
            run[1] = state
    out = {"length": length, "context": 8}
    for algorithm, run in runs.items():
        out[f"{algorithm}_step_s"] = float(np.median(run[3]))
    out["ratio_allgather_over_ring"] = out["allgather_step_s"] / out["ring_step_s"]
    return out


# -- pipe × context: GPipe(2 stages, 2 microbatches) over a 2-layer LM, each stage's sequence
# split over n devices ----------------------------------------------------------------------

PIPE, PIPE_MICROBATCHES, PIPE_LAYERS, PIPE_BATCH = 2, 2, 2, 2


def pipe_strategy(n: int, algorithm: str = "ring"):
    shape = {"pipe": PIPE} | ({"context": n} if n > 1 else {})
    return strategies.Hybrid(shape, microbatches=PIPE_MICROBATCHES, context_attention=algorithm,
                             devices=jax.devices()[:PIPE * n])


def pipe_theory(n: int, length: int) -> float:
    """Ring traffic per device and step of the attention's permutes inside the schedule: each of
    the m + p − 1 iterations runs the stage's L/p layers on a microbatch of B/m sequences (the
    bubble's iterations too, on a zero buffer), each layer 4(n−1) permutes of its K/V shard."""
    if n == 1:
        return 0.0
    iterations = PIPE_MICROBATCHES + PIPE - 1
    shard = PIPE_BATCH // PIPE_MICROBATCHES * (length // n) * HEADS * HEAD_DIM * 4
    return iterations * (PIPE_LAYERS // PIPE) * 4 * (n - 1) * shard


def pipe_section(length: int, degrees, equality_length: int, steps: int) -> dict:
    out = {"pipe": PIPE, "microbatches": PIPE_MICROBATCHES, "layers": PIPE_LAYERS,
           "batch": PIPE_BATCH, "length": length, "memory": {}}
    base = None
    for n in degrees:
        fit = jl.Fit(pipe_strategy(n), max_steps=1, enable_progress_bar=False, logger=False,
                     enable_model_summary=False)
        p = fit.plan(LM(PIPE_LAYERS), tokens(length, batch=PIPE_BATCH)[0], verbose=False)
        temp = p.memory["temp"]
        base = temp if base is None else base
        # The context ring's permutes: key/value blocks (B·H, L/n, D); the pipeline's own
        # permutes carry (b, L/n, width) activations between the stages.
        found = sum(c.traffic_bytes * c.executions for c in p.collectives
                    if c.kind == "collective-permute" and c.result_bytes > 8
                    and c.shapes and all(len(d) == 3 and d[-1] == HEAD_DIM
                                         for _, d in c.shapes))
        out["memory"][str(n)] = {
            "context": n, "temp_bytes": temp, "temp_ratio_to_n1": temp / base,
            "ideal_ratio": 1 / n, "attention_traffic_bytes": found,
            "theory_traffic_bytes": pipe_theory(n, length)}
        print(f"pipe×context L={length} n={n}: temp {temp / 2**20:.1f} MiB (x{temp / base:.3f}),"
              f" attention traffic {found / 2**20:.2f} MiB (theory "
              f"{pipe_theory(n, length) / 2**20:.2f})", file=sys.stderr)
    out["equality"] = equality_section(equality_length, steps,
                                       lambda algorithm: pipe_strategy(4, algorithm),
                                       PIPE_LAYERS, PIPE_BATCH)
    return out


def reach_section(degrees, budget_length: int) -> dict:
    budget = footprint(plan(1, "ring", budget_length))
    out = {"budget_bytes": budget, "budget": f"single device at L={budget_length}", "rows": {}}
    for algorithm in ALGORITHMS:
        rows = {}
        for n in degrees:
            unit = 256 * n
            fits = lambda k, n=n, algorithm=algorithm, unit=unit: footprint(  # noqa: E731
                plan(n, algorithm, k * unit)) <= budget
            lo, hi = max(1, budget_length // unit), None
            while fits(lo * 2 if hi is None else hi):  # double while it fits
                lo = lo * 2 if hi is None else hi
                if lo * unit > 64 * budget_length:
                    break
            hi = lo * 2
            while hi - lo > max(1, lo // 16):  # bisect to ~6 %
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            rows[str(n)] = {"max_length": lo * unit}
            print(f"reach {algorithm} n={n}: {lo * unit}", file=sys.stderr)
        first = rows[str(degrees[0])]["max_length"]
        for n in degrees:
            rows[str(n)]["growth"] = rows[str(n)]["max_length"] / first
        out["rows"][algorithm] = rows
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*",
                        default=["memory", "equality", "time", "reach", "pipe"])
    parser.add_argument("--pipe-length", type=int, default=4096)
    parser.add_argument("--pipe-degrees", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 16384])
    parser.add_argument("--degrees", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--equality-length", type=int, default=1024)
    parser.add_argument("--equality-steps", type=int, default=10)
    parser.add_argument("--time-length", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget-length", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = {"model": {"width": WIDTH, "heads": HEADS, "head_dim": HEAD_DIM, "layers": LAYERS,
                        "vocab": VOCAB, "batch": BATCH},
              "backend": jax.default_backend(), "devices": len(jax.devices())}
    partial = (args.out or os.path.join(HERE, "results", "context.json")) + ".partial"
    sections = {"memory": lambda: memory_section(args.lengths, args.degrees),
                "equality": lambda: equality_section(args.equality_length, args.equality_steps),
                "time": lambda: time_section(args.time_length, args.rounds, args.steps),
                "reach": lambda: reach_section(args.degrees, args.budget_length),
                "pipe": lambda: pipe_section(args.pipe_length, args.pipe_degrees,
                                             args.equality_length, args.equality_steps)}
    for name, run in sections.items():
        if name in args.only:
            report[name] = run()
            with open(partial, "w") as f:  # what is measured survives an interrupted run
                json.dump(report, f, indent=2)
    write_result("context", report, args.out)
    os.remove(partial)


if __name__ == "__main__":
    main()
