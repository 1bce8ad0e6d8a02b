"""Tokens/s and MFU of the `gpt` recipe on whatever accelerator is present, and Fit's overhead.

The model is the `gpt` recipe's (`jaxlight.recipes.gpt`) at a size preset, trained in
bf16-mixed on random bytes (throughput does not depend on the text); FLOPs per step and MFU come
from `callbacks.ThroughputMonitor` (the compiled step's FLOPs with loop bodies counted per
iteration, over the device's peak from its table). With `--compare-hand`, the same model,
optimizer and batches also run in a hand-written `jax.jit` loop (bf16 casts inside, donation,
the same two-steps-in-flight bound), alternated with Fit, and the median step-time ratio is
reported.

    python benchmarks/mfu.py --preset 125m --compare-hand           # on one GPU
    python benchmarks/mfu.py --preset 1b --batch 8 --remat none --compare-hand
    python benchmarks/mfu.py --preset tiny --steps 20 --batch 16    # CPU smoke run (no MFU)

`benchmarks/gpu.sh` runs the accelerator set in one go. `--remat` and `--attention` override
the preset's model (the 1b preset recomputes whole blocks, which a large batch on an 80 GB GPU
needs; at batch 8 nothing needs recomputing, and MFU counts model FLOPs only, so recomputation
is pure loss). Writes benchmarks/results/mfu_<preset>_<device>.json.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, write_result  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="125m", choices=["tiny", "125m", "1b"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=None, help="global batch (default: preset's)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: preset's)")
    p.add_argument("--strategy", default="single")
    p.add_argument("--precision", default="bf16-mixed")
    p.add_argument("--remat", default=None, choices=["none", "dots", "full"],
                   help="override the preset's rematerialization")
    p.add_argument("--attention", default=None, choices=["auto", "xla", "cudnn"],
                   help="override the attention kernel (default: the preset's, 'auto')")
    p.add_argument("--peak-flops", type=float, default=None, help="per device, overrides table")
    p.add_argument("--compare-hand", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile-dir", default=None,
                   help="trace steps warmup+1..warmup+2 of the last Fit round with the Profiler "
                        "callback into this directory (its host timing goes into the JSON)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import flax
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight import callbacks
    from jaxlight.nn._layers import attention_implementation
    from jaxlight.recipes import gpt

    preset = gpt.PRESETS[args.preset]["config"]
    config = gpt.Config()
    for section_name, values in preset.items():
        for key, value in values.items():
            setattr(getattr(config, section_name), key, value)
    if args.remat is not None:
        config.model.remat = args.remat
    if args.attention is not None:
        config.model.attention = args.attention
    # The dtype the step computes in (bfloat16 under "bf16-mixed"), from the precision policy.
    compute_dtype = callbacks.MixedPrecision(args.precision).compute_dtype
    batch = args.batch or config.data.batch_size
    seq = args.seq or config.data.seq_len
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 256, size=(batch, seq + 1)).astype(np.int32)}
               for _ in range(4)]

    def loader():
        i = 0
        while True:
            yield batches[i % len(batches)]
            i += 1

    def fit_round(profiler=None):
        module = gpt.make_module(config, max_steps=args.steps)
        monitor = callbacks.ThroughputMonitor(peak_flops_per_device=args.peak_flops)
        stamps = []
        rec = callbacks.LambdaCallback(
            on_train_batch_end=lambda f, m, o, b, i: stamps.append(time.perf_counter()))
        extra = [profiler] if profiler is not None else []
        fit = jl.Fit(args.strategy, max_steps=args.steps, precision=args.precision,
                     callbacks=[monitor, rec, *extra], log_every_n_steps=max(1, args.steps // 3),
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     enable_checkpointing=False)
        fit.fit(module, loader())
        params = jax.device_get(nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
        return fit, monitor, stamps, params, module

    def hand_round(module):
        """The same step by hand: bf16 compute, fp32 master weights, donated state."""
        model = module.configure_model(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        tx = module.configure_optimizers()
        opt_state = tx.init(params)

        def step(params, opt_state, batch):
            def loss_fn(p):
                if compute_dtype != jax.numpy.float32:
                    p = jax.tree.map(lambda x: x.astype(compute_dtype), p)
                return module.training_step(nnx.merge(graphdef, p, rest), batch)[0].astype(
                    jax.numpy.float32)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(step, donate_argnums=(0, 1))
        stamps, prev = [], None
        for i in range(args.steps):
            params, opt_state, loss = step(params, opt_state, batches[i % len(batches)])
            if prev is not None:
                prev.block_until_ready()
            prev = loss
            stamps.append(time.perf_counter())
        prev.block_until_ready()
        return stamps

    def median_step(stamps):
        return float(np.median(np.diff(stamps[args.warmup:])))

    rounds = []
    fit = monitor = profiler = None
    for _ in range(args.rounds if args.compare_hand else 1):
        fit, monitor, f_stamps, _, module = fit_round()
        row = {"fit_step_s": median_step(f_stamps)}
        if args.compare_hand:
            row["hand_step_s"] = median_step(hand_round(module))
            row["ratio"] = row["fit_step_s"] / row["hand_step_s"]
        rounds.append(row)
    if args.profile_dir:
        # One more Fit round, traced: traced steps wait for the device, so it is not timed.
        profiler = callbacks.Profiler(start_step=args.warmup + 1, num_steps=2,
                                      logdir=args.profile_dir)
        fit_round(profiler)
    device = jax.devices()[0]
    step_s = float(np.median([r["fit_step_s"] for r in rounds]))
    tokens = batch * seq
    flops = monitor.flops_per_step
    peak = args.peak_flops
    if peak is None:
        from jaxlight.analysis._flops import device_peak_flops

        peak = device_peak_flops(device)
    n_dev = len(fit.strategy.mesh.devices.flat)
    c = config.model
    # What the step's attention ran: the model's choice for its compute dtype and head width.
    attention = attention_implementation(c.attention, jax.default_backend(), compute_dtype,
                                         gpt.transformer_config(c).resolved_head_dim)
    stats = device.memory_stats() or {}
    report = {
        "benchmark": "mfu",
        "preset": args.preset,
        "parameters": gpt.num_parameters(config.model),
        "device": device.device_kind,
        "platform": device.platform,
        "devices": n_dev,
        "strategy": fit.strategy.name,
        "precision": args.precision,
        "remat": c.remat,
        "attention": attention,
        "jax": jax.__version__,
        "flax": flax.__version__,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "global_batch": batch,
        "seq_len": seq,
        "median_step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "flops_per_step": flops,
        "compiled_flops_per_step": (None if monitor.flop_count is None
                                    else monitor.flop_count.flops * n_dev),
        "achieved_flops_per_s": None if flops is None else flops / step_s,
        "peak_flops_per_device": peak,
        "mfu": None if (flops is None or peak is None) else flops / step_s / (peak * n_dev),
        "monitor_summary": monitor.summary,
        "rounds": rounds,
        "target_mfu_1b": 0.45,
        "target_overhead": 1.02,
    }
    if profiler is not None:
        report["profile"] = {"trace_dir": profiler.trace_dir, "host_timing": profiler.step_timings,
                             "compile_times": profiler.compile_times}
    if args.compare_hand:
        report["median_overhead_ratio"] = float(np.median([r["ratio"] for r in rounds]))
    name = re.sub(r"[^A-Za-z0-9]+", "_", device.device_kind).strip("_").lower()
    write_result(f"mfu_{args.preset}_{name}", report,
                 args.out or os.path.join(RESULTS, f"mfu_{args.preset}_{name}.json"))


if __name__ == "__main__":
    main()
