"""Tensor parallelism with and without collective matmul: step time and collectives.

For each tensor-parallel degree in --tp, a `jaxlight.nn.TransformerLM` trains under
`TensorParallel(tp)` and `TensorParallel(tp, overlap=True)` (`data` over the remaining devices)
on 8 simulated CPU devices, in alternating rounds. Reported per configuration:

- the median step time (steady state: the first --warmup steps of each round dropped) and the
  train-step compile time;
- the compiled step's collectives per kind (`jaxlight.analysis._hlo`: executions per step, with loop
  trip counts, and ring traffic bytes per device), and those of the dense layers: all-reduces
  within tp groups whose origin is a matmul (synchronous) against the rings' collective-permutes
  (overlap), which should move the same bytes;
- the largest loss difference between the two trajectories.

Simulated CPU devices run every collective synchronously on the same host cores, so the
overlap cannot show here; the step-time ratio measures the rings' extra per-hop work (n partial
matmuls, dynamic slices). The overlap pays on GPUs and TPUs, whose collective-permutes run
asynchronously beside the matmuls.

    python benchmarks/tp_overlap.py                 # tp 2, 4, 8; writes results/tp_overlap.json
    python benchmarks/tp_overlap.py --tp 2 --steps 20 --rounds 1 --out /tmp/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import nn, strategies  # noqa: E402
from jaxlight.analysis import _hlo  # noqa: E402
from jaxlight.callbacks import Callback  # noqa: E402

NOTE = ("8 simulated CPU devices share the host's cores and run collectives synchronously: "
        "no communication can overlap with compute here, so the step-time ratio only shows the "
        "cost of the rings' extra per-hop ops. Collective counts and bytes are what an "
        "accelerator would execute; the overlap itself needs asynchronous collective-permutes "
        "(GPU/TPU).")


class LM(jl.TrainModule):
    """Next-token prediction with jaxlight.nn.TransformerLM (untied head: column-parallel)."""

    def __init__(self, vocab: int, embed: int, layers: int, heads: int, mlp: int):
        super().__init__()
        self.config = nn.TransformerConfig(vocab_size=vocab, embed_dim=embed, num_layers=layers,
                                           num_heads=heads, mlp_dim=mlp, tie_embeddings=False)

    def configure_model(self, rngs):
        return nn.TransformerLM(self.config, rngs=rngs)

    def configure_optimizers(self):
        return optax.adamw(1e-3)

    def training_step(self, model, batch):
        logits = model(batch["tokens"][:, :-1])
        return nn.lm_loss(logits, batch["tokens"][:, 1:])


class Recorder(Callback):
    """Host timestamps after each dispatched step, and the logged losses."""

    def __init__(self):
        self.stamps: list[float] = []
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        self.stamps.append(time.perf_counter())

    def on_log(self, fit, module, metrics, step):
        if "loss" in metrics:
            self.losses[step] = float(metrics["loss"])


def batches(args, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    start = rng.integers(0, args.vocab, size=(args.steps, args.batch, 1))
    stride = rng.integers(1, 4, size=(args.steps, args.batch, 1))
    tokens = (start + stride * np.arange(args.length + 1)) % args.vocab
    return [{"tokens": t.astype(np.int32)} for t in tokens]


def dense_collectives(text: str, tp: int, act_bytes: int) -> dict:
    """The dense layers' communication: tp-group all-reduces of activations that come from a
    matmul (synchronous path) and the rings' collective-permutes (overlap)."""
    found = _hlo.collectives(text)
    all_reduce_count, all_reduce_traffic = 0, 0.0
    for c in found:
        if c.kind == "all-reduce" and c.group_size == tp and "dot_general" in c.op_name:
            n_act = sum(1 for dt, dims in c.shapes
                        if dt == "f32" and 4 * int(np.prod(dims)) == act_bytes)
            all_reduce_count += n_act * c.executions
            all_reduce_traffic += n_act * c.executions * 2 * (tp - 1) / tp * act_bytes
    permutes = [c for c in found if c.kind == "collective-permute" and "ppermute" in c.op_name]
    other = [c for c in found if c.kind in ("all-gather", "reduce-scatter", "all-reduce")
             and c.group_size == tp and "dot_general" in c.op_name]
    return {
        "activation_all_reduces": all_reduce_count,
        "activation_all_reduce_traffic_bytes": all_reduce_traffic,
        "collective_permutes": sum(c.executions for c in permutes),
        "collective_permute_traffic_bytes": sum(c.total_traffic_bytes for c in permutes),
        "tp_collectives_from_matmuls": sum(c.executions for c in other),
    }


def run_config(args, tp: int, overlap: bool, data: list) -> dict:
    recorder = Recorder()
    module = LM(args.vocab, args.embed, args.layers, args.heads, args.mlp)
    fit = jl.Fit(strategies.TensorParallel(tp, overlap=overlap), max_steps=args.steps,
                 log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                 logger=False, callbacks=[recorder])
    fit.fit(module, data)
    step_s = float(np.median(np.diff(recorder.stamps[args.warmup:])))
    return {"step_ms": step_s * 1e3, "compile_s": fit.compile_times.get("train"),
            "losses": [recorder.losses[s] for s in sorted(recorder.losses)],
            "hlo": fit.compiled_train_step.as_text(), "mesh": dict(fit.strategy.mesh.shape)}


def measure(args, tp: int) -> dict:
    data = batches(args)
    rounds = []
    for _ in range(args.rounds):
        off = run_config(args, tp, False, data)
        on = run_config(args, tp, True, data)
        rounds.append((off, on))
    act_bytes = (args.batch // (8 // tp)) * args.length * args.embed * 4
    out = {"tp": tp, "mesh": rounds[0][0]["mesh"]}
    for label, idx in (("sync", 0), ("overlap", 1)):
        runs = [r[idx] for r in rounds]
        text = runs[0]["hlo"]
        out[label] = {
            "median_step_ms": float(np.median([r["step_ms"] for r in runs])),
            "step_ms_per_round": [r["step_ms"] for r in runs],
            "compile_s": float(np.median([r["compile_s"] for r in runs])),
            "collectives_per_step": _hlo.summarize(_hlo.collectives(text)),
            "dense_layers": dense_collectives(text, tp, act_bytes),
        }
    out["step_time_ratio_overlap_over_sync"] = (out["overlap"]["median_step_ms"]
                                                / out["sync"]["median_step_ms"])
    sync_d, over_d = out["sync"]["dense_layers"], out["overlap"]["dense_layers"]
    out["dense_bytes_ratio_permute_over_all_reduce"] = (
        over_d["collective_permute_traffic_bytes"]
        / max(sync_d["activation_all_reduce_traffic_bytes"], 1.0))
    out["max_abs_loss_diff"] = max(
        abs(a - b) for off, on in rounds for a, b in zip(off["losses"], on["losses"], strict=True))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--mlp", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default=os.path.join(HERE, "results", "tp_overlap.json"))
    args = p.parse_args(argv)
    results = [measure(args, tp) for tp in args.tp]
    report = {
        "benchmark": "tp_overlap",
        "note": NOTE,
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
