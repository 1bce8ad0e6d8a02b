"""Tokens/s and MFU of `jaxlight.nn.MoETransformerLM` at a Qwen3-30B-A3B-like shape, one GPU.

Qwen3-30B-A3B: width 2048, 48 layers, 32 query heads of 128, 128 experts, top-8, expert
width 768, vocabulary 151936. The `h200` preset keeps every per-layer dimension and scales the
depth to 6 layers and the vocabulary to 32768 so that the fp32 weights, the AdamW state and
the activations fit one H200 (141 GB) with margin at batch 8 × 2048 tokens. One difference in
the layer itself: `MoETransformerLM`'s attention has as many key/value heads as query heads
(32, no grouped-query attention), 33.6 M attention weights per layer instead of 18.9 M.

Memory estimate, `h200` (bf16-mixed: fp32 master weights, bf16 compute):
    parameters 3.96 B (experts 3.62 B, attention 0.20 B, embedding + head 0.13 B)
    fp32 weights + gradients + AdamW m, v   16 B/param   63.4 GB
    bf16 copy of the weights in the step     2 B/param    7.9 GB
    activations kept for the backward pass (no recomputation; `activation_bytes_per_example`):
    per layer the T·k = 131072 sorted expert rows of 2048 in and out, their 768-wide
    gate/up/SwiGLU outputs, q/k/v, fp32 residuals: 3.1 GB per example, 8 examples  24.8 GB
    total ~96 GB of the 134 GB JAX may take at XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 (XLA:CPU
    compiles this step with 47.5 GB of donated arguments: the fp32 weights and AdamW m, v).
If `jax.lax.ragged_dot` is lowered densely (XLA:GPU without a grouped-matmul kernel multiplies
every row by every expert: E = 128 times the FLOPs, and temporaries such as the input
gradient's (T·k, E·D), 68.7 GB in bf16 at 8 × 2048 tokens), the `probe` part detects it from
the compiled program's temporary bytes and the model parts run at the largest batch the
probe's temporaries leave room for (1 × 2048 at these sizes); the JSON says so
(`ragged_dot`, `global_batch`, `batch_reduced_for_dense_ragged_dot`).

FLOPs are analytic (XLA's cost analysis may count `ragged_dot` densely or not at all; it is
recorded as `xla_cost_flops_per_step`, never used): per token, training = 3 × forward,
    6 · N_active + 12 · L · S · H · d_head
with N_active the weights a token multiplies (per layer: q/k/v/o projections, router, k of
the E experts' gate/up/down; plus the output head; not the embedding lookup) and the second
term the attention scores and weighted values (QKᵀ and AV, 2 · 2 · S · H · d_head per token
and layer forward, not halved for causality, PaLM's convention). MFU = FLOPs per step / step
time / the device's dense bf16 peak (`jaxlight.analysis._flops`, H200: 989 TFLOP/s).

Parts, each under its own share of `--budget` seconds (a part stops its steps early when its
share is spent; the JSON is rewritten after every part, so a timeout still leaves results):
    probe      one expert matmul (gate) forward + backward at one example's S·k rows, as
               `jax.lax.ragged_dot` and as the plain matmul of the same FLOPs: seconds,
               temporary bytes, effective TFLOP/s; `--ragged-lowering auto` also tries JAX's
               Pallas Triton lowering there and keeps it for the model if it works and is faster
    rounds     `--rounds` × (a hand-written `jax.jit` loop, then `Fit`), alternated: the same
               module, AdamW, bf16 compute with fp32 master weights, state donated, two steps
               in flight; median step times (first `--warmup` steps dropped), Fit / hand.

    python benchmarks/moe_mfu.py --preset h200      # one H200 (benchmarks/moe_gpu.sh)
    python benchmarks/moe_mfu.py --preset tiny      # CPU smoke run, < 1 minute

Writes benchmarks/results/moe_mfu_<preset>_<device>.json (or `--out`).
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, write_result  # noqa: E402

PRESETS = {
    # Qwen3-30B-A3B's layer, 6 layers, 32k vocabulary.
    "h200": dict(embed_dim=2048, num_layers=6, num_heads=32, head_dim=128, num_experts=128,
                 experts_per_token=8, expert_dim=768, vocab_size=32768, batch=8, seq=2048),
    # The same proportions, small enough for a CPU smoke run.
    "tiny": dict(embed_dim=64, num_layers=2, num_heads=4, head_dim=16, num_experts=16,
                 experts_per_token=4, expert_dim=32, vocab_size=512, batch=4, seq=64),
}
PEAK_NAME = "H200"  # the row of jaxlight.analysis._flops.PEAK_FLOPS the h200 preset targets


def log(*args):
    print(f"[moe_mfu {time.strftime('%H:%M:%S')}]", *args, flush=True)


def param_counts(p: dict) -> dict:
    """Total and active (per token) parameters of the preset, by part."""
    d, h, hd, e, k, f, v, n = (p["embed_dim"], p["num_heads"], p["head_dim"], p["num_experts"],
                               p["experts_per_token"], p["expert_dim"], p["vocab_size"],
                               p["num_layers"])
    attn = d * 3 * h * hd + h * hd * d
    router = d * e
    norms = 2 * d
    experts = e * 3 * d * f
    per_layer = attn + router + norms + experts
    active_layer = attn + router + k * 3 * d * f
    return {
        "total": n * per_layer + 2 * v * d + d,
        "experts": n * experts,
        "attention": n * attn,
        "embedding_and_head": 2 * v * d,
        "active_non_embedding": n * active_layer + v * d,
    }


def activation_bytes_per_example(p: dict) -> int:
    """Rough bytes one example keeps for the backward pass (bf16 compute, no recomputation):
    per token and layer the k sorted expert rows in and out (2·k·D), their gate/up/SwiGLU
    outputs (3·k·F), q/k/v and the attention output (4·H·d_head), all bf16, plus ~6 fp32
    residual-stream tensors (norms, residual sums); per token the fp32 logits, their softmax
    and gradient (3·V·4)."""
    d, k, f, h, hd = (p["embed_dim"], p["experts_per_token"], p["expert_dim"], p["num_heads"],
                      p["head_dim"])
    per_token_layer = 2 * (2 * k * d + 3 * k * f + 4 * h * hd) + 4 * 6 * d
    return p["seq"] * (p["num_layers"] * per_token_layer + 3 * p["vocab_size"] * 4)


def analytic_flops(p: dict, tokens: int) -> dict:
    counts = param_counts(p)
    dense = 6 * counts["active_non_embedding"] * tokens
    attention = 12 * p["num_layers"] * p["seq"] * p["num_heads"] * p["head_dim"] * tokens
    return {"per_step": dense + attention, "weights_6N": dense, "attention_12LSHd": attention,
            "per_token": (dense + attention) / tokens}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="h200", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fit-first", action="store_true",
                    help="run Fit before the hand-written loop in each round")
    ap.add_argument("--budget", type=float, default=225.0,
                    help="seconds for the whole run; each part gets its share")
    ap.add_argument("--precision", default="bf16-mixed")
    ap.add_argument("--remat", default="none", choices=["none", "dots", "full"])
    ap.add_argument("--ragged-lowering", default="auto", choices=["auto", "default", "triton"])
    ap.add_argument("--no-probe", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.budget

    import flax
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight import callbacks, nn
    from jaxlight._fit._cache import configure as configure_compilation_cache
    from jaxlight.analysis._flops import device_peak_entry, device_peak_flops

    # The persistent compilation cache from the start (Fit would turn it on only at its first
    # fit), so that round 2's hand-written step loads too.
    cache_dir = configure_compilation_cache()

    p = dict(PRESETS[args.preset])
    for key, value in (("batch", args.batch), ("seq", args.seq), ("num_layers", args.layers)):
        if value is not None:
            p[key] = value
    device = jax.devices()[0]
    compute_dtype = callbacks.MixedPrecision(args.precision).compute_dtype
    name = re.sub(r"[^A-Za-z0-9]+", "_", device.device_kind).strip("_").lower()
    out = args.out or os.path.join(RESULTS, f"moe_mfu_{args.preset}_{name}.json")
    counts = param_counts(p)
    report = {
        "benchmark": "moe_mfu", "preset": args.preset, "shape": dict(p),
        "reference": "Qwen3-30B-A3B: width 2048, 48 layers, 32 q / 4 kv heads of 128, "
                     "128 experts top-8 of width 768, vocab 151936",
        "parameters": counts, "device": device.device_kind, "platform": device.platform,
        "jax": jax.__version__, "flax": flax.__version__, "precision": args.precision,
        "remat": args.remat, "peak_flops_per_device": device_peak_flops(device),
        "peak_flops_entry": device_peak_entry(device), "target_peak_entry": PEAK_NAME,
        "compilation_cache": cache_dir, "status": "started",
    }
    log(f"{device.device_kind}, jax {jax.__version__}, preset {args.preset}: "
        f"{counts['total'] / 1e9:.2f} B parameters, {counts['active_non_embedding'] / 1e9:.3f} B "
        "active non-embedding")

    def save(status):
        report["status"] = status
        report["elapsed_s"] = time.perf_counter() - start
        stats = device.memory_stats() or {}
        report["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        report["bytes_limit"] = stats.get("bytes_limit")
        write_result(f"moe_mfu_{args.preset}_{name}", report, out)

    def share(parts_left):
        return max(5.0, (deadline - time.perf_counter()) / max(1, parts_left))

    # -- probe: one expert matmul, ragged vs plain ----------------------------------------------
    # At one example's rows (seq · k), not the whole batch's: a dense lowering's temporaries
    # grow with the rows (its input gradient is (rows, E · D)), so the probe stays small.
    a, d, f, e = p["seq"] * p["experts_per_token"], p["embed_dim"], p["expert_dim"], \
        p["num_experts"]

    def probe(lowering):
        key = jax.random.key(0)
        x = jax.random.normal(key, (a, d), compute_dtype)
        w = jax.random.normal(key, (e, d, f), compute_dtype) * 0.02
        sizes = jnp_sizes(a, e)

        def ragged(x, w):
            return jax.lax.ragged_dot(x, w, sizes).astype(np.float32).sum()

        def plain(x, w):
            return (x @ w[0]).astype(np.float32).sum()

        row = {}
        for label, fn in (("ragged_dot", ragged), ("plain_matmul", plain)):
            if label == "plain_matmul" and lowering != "default":
                continue
            with lowering_context(lowering):
                t0 = time.perf_counter()
                step = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(x, w).compile()
                compile_s = time.perf_counter() - t0
            mem = step.memory_analysis()
            jax.block_until_ready(step(x, w))
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(step(x, w))
                times.append(time.perf_counter() - t0)
            sec = float(np.median(times))
            flops = 6 * a * d * f  # forward + both gradients of an (a, d) x (d, f) matmul
            row[label] = {"seconds": sec, "compile_s": compile_s,
                          "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
                          "effective_tflops": flops / sec / 1e12}
        temp = row["ragged_dot"]["temp_bytes"]
        row["dense_materialized"] = temp is not None and temp >= a * e * f * 2 // 2
        return row

    def jnp_sizes(rows, groups):
        base = np.full(groups, rows // groups, np.int32)
        base[: rows % groups] += 1
        return jax.numpy.asarray(base)

    def lowering_context(lowering):
        flag = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
        if lowering == "triton":
            if not hasattr(jax.config, flag):
                raise RuntimeError(f"this jax ({jax.__version__}) has no {flag}")
            return _Flag(jax, flag)
        return _Null()

    lowering = "default" if args.ragged_lowering == "auto" else args.ragged_lowering
    parts_left = 1 + 2 * args.rounds
    if not args.no_probe:
        probes = {}
        tries = ["default", "triton"] if args.ragged_lowering == "auto" and \
            device.platform == "gpu" else [lowering]
        for choice in tries:
            log(f"probe: ragged_dot ({a}, {d}) x ({e}, {d}, {f}), lowering {choice}")
            try:
                probes[choice] = probe(choice)
                log(f"probe {choice}: {probes[choice]}")
            except Exception as err:  # a lowering this jax or GPU does not have
                probes[choice] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
                log(f"probe {choice} failed: {probes[choice]['error']}")
        report["ragged_dot"] = probes
        ok = {k: v for k, v in probes.items() if "error" not in v}
        if args.ragged_lowering == "auto" and ok:
            lowering = min(ok, key=lambda k: ok[k]["ragged_dot"]["seconds"])
        if lowering in ok and ok[lowering]["dense_materialized"] and args.batch is None:
            # A dense lowering's temporaries grow with the rows: keep the largest batch whose
            # state (18 B/param) + per example (3 matmuls' probe temporaries + activations)
            # stays under 85% of what JAX may take (without a figure: an eighth of the batch).
            temp = ok[lowering]["ragged_dot"]["temp_bytes"]
            limit = (device.memory_stats() or {}).get("bytes_limit")
            state = 18 * counts["total"]
            per_example = 3 * temp + activation_bytes_per_example(p)
            reduced = max(1, p["batch"] // 8)
            if limit:
                reduced = max([b for b in range(1, p["batch"] + 1)
                               if state + b * per_example <= 0.85 * limit] or [1])
            report["batch_reduced_for_dense_ragged_dot"] = {
                "from": p["batch"], "to": reduced, "state_bytes": state,
                "per_example_bytes": per_example, "bytes_limit": limit}
            p["batch"] = reduced
            log(f"ragged_dot materializes densely: batch reduced to {p['batch']}")
        parts_left -= 1
        save("probe done")
    report["ragged_lowering"] = lowering
    report["shape"] = dict(p)

    # -- the model --------------------------------------------------------------------------
    batch, seq = p["batch"], p["seq"]
    tokens = batch * seq
    flops = analytic_flops(p, tokens)
    report.update(global_batch=batch, seq_len=seq, tokens_per_step=tokens,
                  flops_analytic=flops, estimated_bytes={
                      "state_18_per_param": 18 * counts["total"],
                      "activations": batch * activation_bytes_per_example(p)})
    config = nn.MoEConfig(
        vocab_size=p["vocab_size"], embed_dim=p["embed_dim"], num_layers=p["num_layers"],
        num_heads=p["num_heads"], head_dim=p["head_dim"], tie_embeddings=False,
        num_experts=p["num_experts"], experts_per_token=p["experts_per_token"],
        expert_dim=p["expert_dim"], remat=args.remat, router="softmax_topk", renormalize=True,
        aux_loss_weight=0.001)

    class MoELM(jl.TrainModule):
        def configure_model(self, rngs):
            return nn.MoETransformerLM(config, rngs=rngs)

        def configure_optimizers(self):
            return optax.adamw(3e-4, weight_decay=0.1)

        def training_step(self, model, batch):
            logits, aux = model(batch["tokens"][:, :-1], return_aux=True)
            return nn.lm_loss(logits, batch["tokens"][:, 1:]) + aux["loss"]

    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, p["vocab_size"], size=(batch, seq + 1)).astype(
        np.int32)} for _ in range(4)]

    def loader():
        i = 0
        while True:
            yield batches[i % len(batches)]
            i += 1

    def hand_round(part_deadline):
        module = MoELM()
        model = module.configure_model(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        del model
        tx = module.configure_optimizers()
        opt_state = jax.jit(tx.init)(params)

        def step(params, opt_state, batch):
            def loss_fn(q):
                if compute_dtype != np.float32:
                    q = jax.tree.map(lambda x: x.astype(compute_dtype), q)
                return module.training_step(nnx.merge(graphdef, q, rest), batch).astype(
                    np.float32)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        t0 = time.perf_counter()
        with lowering_context(lowering):
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
                params, opt_state, batches[0]).compile()
        info = {"compile_s": time.perf_counter() - t0}
        mem = compiled.memory_analysis()
        if mem is not None:
            info["compiled_bytes"] = {k: getattr(mem, k, None) for k in (
                "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "alias_size_in_bytes")}
        try:
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            info["xla_cost_flops_per_step"] = None if not cost else cost.get("flops")
        except Exception as err:  # not every backend reports it
            info["xla_cost_flops_per_step"] = f"unavailable: {type(err).__name__}"
        stamps, prev, loss = [], None, None
        for i in range(args.steps):
            params, opt_state, loss = compiled(params, opt_state, batches[i % len(batches)])
            if prev is not None:
                prev.block_until_ready()  # two steps in flight, as Fit keeps
            prev = loss
            stamps.append(time.perf_counter())
            if time.perf_counter() > part_deadline and i + 1 >= args.warmup + 3:
                break
        info["final_loss"] = float(prev)
        stamps.append(time.perf_counter())
        info["steps"] = len(stamps) - 1
        return stamps, info

    def fit_round(part_deadline):
        stamps = []

        def on_end(fit, *_):
            stamps.append(time.perf_counter())
            if time.perf_counter() > part_deadline and len(stamps) >= args.warmup + 3:
                fit.request_stop("moe_mfu: this part's time share is spent")

        fit = jl.Fit("single", max_steps=args.steps, precision=args.precision,
                     callbacks=[callbacks.LambdaCallback(on_train_batch_end=on_end)],
                     log_every_n_steps=max(1, args.steps // 3), enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, logger=False)
        with lowering_context(lowering):
            fit.fit(MoELM(), loader())
        return stamps, {"compile_s": dict(fit.compile_times), "steps": len(stamps),
                        "final_loss": float(fit.callback_metrics.get("loss", float("nan")))
                        if hasattr(fit, "callback_metrics") else None}

    def median_step(stamps):
        diffs = np.diff(stamps[args.warmup:])
        return float(np.median(diffs)) if len(diffs) else None

    rounds = []
    report["rounds"] = rounds
    for r in range(args.rounds):
        row = {}
        rounds.append(row)
        parts = (("hand", hand_round), ("fit", fit_round))
        for label, fn in (parts[::-1] if args.fit_first else parts):
            part_deadline = time.perf_counter() + share(parts_left)
            row[f"{label}_bytes_in_use_before"] = (device.memory_stats() or {}).get(
                "bytes_in_use")
            log(f"round {r + 1} {label}: up to {args.steps} steps, "
                f"{part_deadline - time.perf_counter():.0f} s")
            try:
                stamps, info = fn(part_deadline)
                row[f"{label}_step_s"] = median_step(stamps)
                stats = device.memory_stats() or {}
                info["peak_bytes_in_use_so_far"] = stats.get("peak_bytes_in_use")
                row[label] = info
                log(f"round {r + 1} {label}: {row[f'{label}_step_s']} s/step, {info}")
            except Exception as err:
                row[label] = {"error": f"{type(err).__name__}: {str(err)[:1000]}"}
                log(f"round {r + 1} {label} failed: {row[label]['error']}")
            parts_left -= 1
            if row.get("fit_step_s") and row.get("hand_step_s"):
                row["ratio"] = row["fit_step_s"] / row["hand_step_s"]
                # The same module, batches and steps: the same loss unless one stopped early.
                if row["fit"]["steps"] == row["hand"]["steps"] and row["fit"]["final_loss"]:
                    row["final_loss_fit_minus_hand"] = (row["fit"]["final_loss"]
                                                        - row["hand"]["final_loss"])
            gc.collect()  # the finished part's state (Fit's holds reference cycles) goes now
            summarize(report, rounds, flops, tokens, np)
            save(f"round {r + 1} {label} done")
    summarize(report, rounds, flops, tokens, np)
    save("done")


def summarize(report, rounds, flops, tokens, np):
    """Medians over the rounds so far: step time, tokens/s, MFU (analytic FLOPs), Fit/hand."""
    for label in ("fit", "hand"):
        steps = [r[f"{label}_step_s"] for r in rounds if r.get(f"{label}_step_s")]
        if not steps:
            continue
        step_s = float(np.median(steps))
        peak = report["peak_flops_per_device"]
        report[f"{label}_median_step_s"] = step_s
        report[f"{label}_tokens_per_s"] = tokens / step_s
        report[f"{label}_achieved_flops_per_s"] = flops["per_step"] / step_s
        report[f"{label}_mfu"] = None if peak is None else flops["per_step"] / step_s / peak
    for key in ("median_step_s", "tokens_per_s", "mfu"):  # mfu.py's names: Fit's figures
        report[key] = report.get(f"fit_{key}")
    ratios = [r["ratio"] for r in rounds if r.get("ratio")]
    report["median_fit_over_hand"] = float(np.median(ratios)) if ratios else None
    xla = [r["hand"].get("xla_cost_flops_per_step") for r in rounds
           if isinstance(r.get("hand"), dict) and "xla_cost_flops_per_step" in r["hand"]]
    report["xla_cost_flops_per_step"] = xla[0] if xla else None


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Flag:
    """Sets a boolean jax config flag for the duration of a `with` block."""

    def __init__(self, jax, name):
        self.jax, self.name = jax, name

    def __enter__(self):
        self.old = getattr(self.jax.config, self.name)
        self.jax.config.update(self.name, True)
        return self

    def __exit__(self, *exc):
        self.jax.config.update(self.name, self.old)
        return False


if __name__ == "__main__":
    main()
