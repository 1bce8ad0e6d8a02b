"""Framework overhead: Fit against a hand-written `jax.jit` loop, alternated in one run.

Both loops train the same model on the same NumPy batches with the same optimizer, keep the same
bound of two steps in flight (dispatch t, then wait for t-1), and take a timestamp per step; the
figure is the median step time (steady state, first steps dropped) of each, and the ratio
Fit / hand-written per round, over alternating rounds. Final parameters are compared too.

    python benchmarks/overhead.py                     # 1 and 8 simulated devices, dp and fsdp
    python benchmarks/overhead.py --devices 8 --strategy dp --steps 200 --rounds 5
    python benchmarks/overhead.py --log               # Fit's step also self.logs (on_epoch)
    python benchmarks/overhead.py --accumulate 4      # accumulate_grad_batches=4 (Lightning's
                                                      # meaning) against a hand-written scan
                                                      # over 4 stacked batches

With `--accumulate K` one optimizer step takes K loader batches: Fit gets
`accumulate_grad_batches=K`; the hand-written loop interleaves K batches on the host into one
array (each device's rows hold its share of all K), puts it on the devices split along the batch
axis, and its jitted step scans each device's K microbatches inside `shard_map` (gradients
summed in fp32, no collective in the loop) followed by one all-reduce, divided by K times the
replicas: the same work and the same single gradient collective per optimizer step as Fit.
    python benchmarks/overhead.py --ema 0.999         # EMAWeightAveraging vs a hand-written EMA
    python benchmarks/overhead.py --swa 1e-4          # StochasticWeightAveraging(1e-4, 1, 2) vs a
                                                      # hand-written SWA (SWALR + epoch-start mean)

The hand-written loop `jax.device_put`s each batch before calling its step, as hand-written
loops usually do. Fit, reading an in-memory ArrayLoader in its own thread (its default), hands
the NumPy batch to the compiled step, whose call places it: about 0.3 ms less host time per
step. `--hand-host-arrays` gives the hand-written loop that too (the figure then compares the
loops without that difference).

Prints JSON; writes benchmarks/results/overhead.json (when run for every configuration).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
#: The optimizer's learning rate (adamw) and, with --swa, SWA's annealing epochs.
LR, SWA_ANNEAL = 1e-3, 2


def hlo_ops(text: str) -> collections.Counter:
    """Instruction counts of an optimized HLO module, and its collectives (kind and shapes)."""
    from jaxlight.analysis._hlo import collectives

    ops = collections.Counter(m.group(1) for m in re.finditer(
        r"=\s*\S+\s+([a-z][a-z0-9\-]*)\(", text))
    ops["collectives"] = sorted((c.kind, str(c.shapes)) for c in collectives(text))
    return ops


def run_one(args) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxlight as jl
    from jaxlight import callbacks, strategies

    class MLP(nnx.Module):
        def __init__(self, d, h, rngs):
            self.l1 = nnx.Linear(d, h, rngs=rngs)
            self.l2 = nnx.Linear(h, h, rngs=rngs)
            self.l3 = nnx.Linear(h, 10, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    class Module(jl.TrainModule):
        def __init__(self, log=False):
            super().__init__()
            self.log_values = log

        def configure_model(self, rngs):
            return MLP(args.din, args.hidden, rngs)

        def configure_optimizers(self):
            return optax.adamw(LR)

        def training_step(self, model, batch):
            logits = model(batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            if self.log_values:
                # The logging path (--log): a step value, an on-device epoch mean, the bar.
                self.log("train_loss", loss, prog_bar=True, on_epoch=True)
            return loss

    rng = np.random.default_rng(0)
    k = args.accumulate
    n = args.batch * args.epoch_steps * k  # epoch_steps optimizer steps per epoch
    data = {"x": rng.normal(size=(n, args.din)).astype(np.float32),
            "y": rng.integers(0, 10, n).astype(np.int32)}

    def make_strategy():
        if args.devices == 1:
            return strategies.SingleDevice()
        if args.strategy == "fsdp":
            # The layout a hand-written GSPMD loop gets (XLA gathers per layer), so the ratio
            # measures the framework, not a different algorithm; FSDP()'s default gathers
            # once per step with an explicit reduce-scatter (see benchmarks/sharding.py).
            return strategies.FSDP(min_shard_size=0, reshard_after_forward=True)
        return strategies.DataParallel()

    # -- Fit ---------------------------------------------------------------------------------
    def train_with_fit(max_steps, at_end, extra=()):
        """A fresh Fit of `max_steps` steps, `at_end` its on_train_batch_end: (fit, final
        parameters of the model, as trained or averaged)."""
        module = Module(log=args.log)
        fit = jl.Fit(make_strategy(), max_steps=max_steps,
                     callbacks=[callbacks.LambdaCallback(on_train_batch_end=at_end), *extra],
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     enable_checkpointing=False,
                     log_every_n_steps=args.log_every, accumulate_grad_batches=k,
                     prefetch_batches=args.prefetch_batches)
        fit.fit(module, jl.data.ArrayLoader(data, args.batch, seed=0))
        return fit, jax.device_get(nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))

    def averaging_callbacks():
        """Fit's weight-averaging callbacks (--ema, --swa): the hand loop averages the same."""
        extra = [] if args.ema is None else [callbacks.EMAWeightAveraging(decay=args.ema)]
        if args.swa is not None:
            extra.append(callbacks.StochasticWeightAveraging(
                args.swa, swa_epoch_start=1, annealing_epochs=SWA_ANNEAL))
        return extra

    def fit_round():
        stamps = []
        fit, params = train_with_fit(
            args.steps, lambda f, m, o, b, i: stamps.append(
                (time.perf_counter(), time.process_time())), averaging_callbacks())
        return stamps, params, fit

    # -- hand-written ----------------------------------------------------------------------
    def hand_loop(fit):
        """The hand-written loop, compiled for `fit`'s mesh and shardings: `(run, result)`,
        `run(n, stamps)` trains n more steps (a timestamp each), `result()` its parameters."""
        module = Module()
        model = module.configure_model(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = nnx.to_pure_dict(params)
        tx = module.configure_optimizers()
        mesh = fit.strategy.mesh
        param_sh = fit.session.shardings.params
        opt_sh = fit.session.shardings.opt_state
        if args.ema is not None or args.swa is not None:  # the average around the optimizer's
            opt_sh = opt_sh.inner
        batch_spec = PartitionSpec("data" if args.strategy == "dp" else "fsdp") \
            if args.devices > 1 else PartitionSpec()
        # K loader batches as one input of K * batch rows, row j of batch i at row j*K + i, so
        # that each device's contiguous rows hold its share of every one of the K batches.
        batch_sh = NamedSharding(mesh, batch_spec)
        axis = None if args.devices == 1 else ("data" if args.strategy == "dp" else "fsdp")
        params = jax.device_put(params, param_sh)
        opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
        # --ema: the hand-written average, as torch's AveragedModel + get_ema_avg_fn (the first
        # update copies), sharded like the parameters and donated with them.
        averaging = args.ema is not None or args.swa is not None
        ema = jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=param_sh)(params) \
            if averaging else None
        # --swa: SWALR's cosine rate per epoch (from epoch 0, annealing over SWA_ANNEAL epochs)
        # by scaling the updates, and the equal-weight mean of the parameters each epoch starts
        # from (the first update copies).
        steps_per_epoch = len(jl.data.ArrayLoader(data, args.batch, seed=0)) // k

        def step(params, opt_state, ema, batch):
            def loss_fn(p):
                return module.training_step(nnx.merge(graphdef, p, rest), batch)

            if k == 1:
                loss, grads = jax.value_and_grad(loss_fn)(params)
            else:
                # Each device scans its own rows' K microbatches (no collective inside the
                # loop), then one fp32 all-reduce of the summed gradients: what Fit compiles.
                def local(p, rows):
                    n = jax.tree.leaves(rows)[0].shape[0]
                    micro = jax.tree.map(
                        lambda x: jnp.swapaxes(x.reshape(n // k, k, *x.shape[1:]), 0, 1), rows)

                    def body(acc, one):
                        loss, g = jax.value_and_grad(
                            lambda q: module.training_step(nnx.merge(graphdef, q, rest), one))(p)
                        return jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc, g), loss

                    zeros = jax.tree.map(lambda q: jnp.zeros(q.shape, jnp.float32), p)
                    acc, losses = jax.lax.scan(body, zeros, micro)
                    loss = losses.mean()
                    if axis is not None:
                        acc = jax.lax.psum(acc, axis)
                        loss = jax.lax.pmean(loss, axis)
                    return acc, loss

                if axis is None:
                    acc, loss = local(params, batch)
                else:
                    acc, loss = jax.shard_map(
                        local, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec(axis)),
                        out_specs=(PartitionSpec(), PartitionSpec()), axis_names=frozenset({axis}),
                        check_vma=False)(params, batch)
                replicas = 1 if axis is None else args.devices
                grads = jax.tree.map(lambda g, p: (g / (k * replicas)).astype(p.dtype), acc,
                                     params)
            updates, opt_state = tx.update(grads, opt_state, params)
            if args.swa is not None:
                count = ema[1]
                t = jnp.clip((count // steps_per_epoch) / SWA_ANNEAL, 0.0, 1.0)
                alpha = jnp.where(t >= 1.0, 1.0, (1 - jnp.cos(jnp.pi * t)) / 2)
                scale = (args.swa * alpha + LR * (1 - alpha)) / LR
                updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
                do, n_avg = count % steps_per_epoch == 0, ema[2]
                average = jax.tree.map(
                    lambda a, p: jnp.where(do, jnp.where(n_avg == 0, p, a + (p - a) / (n_avg + 1)),
                                           a), ema[0], params)
                ema = (average, count + 1, n_avg + do)
            params = optax.apply_updates(params, updates)
            if args.ema is not None:
                first = ema[1] == 0
                ema = (jax.tree.map(lambda a, c: jnp.where(first, c, args.ema * a
                                                           + (1 - args.ema) * c),
                                    ema[0], params), ema[1] + 1)
            return params, opt_state, ema, loss

        scalar_sh = NamedSharding(mesh, PartitionSpec())
        if args.swa is not None:
            ema_sh = (param_sh, scalar_sh, scalar_sh)
            ema = (ema, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
        else:
            ema_sh = None if ema is None else (param_sh, scalar_sh)
            ema = None if ema is None else (ema, jnp.zeros((), jnp.int32))
        step = jax.jit(step, in_shardings=(param_sh, opt_sh, ema_sh, batch_sh),
                       out_shardings=(param_sh, opt_sh, ema_sh,
                                      NamedSharding(mesh, PartitionSpec())),
                       donate_argnums=(0, 1, 2))
        loader = jl.data.ArrayLoader(data, args.batch, seed=0)
        it = iter(loader)
        carry = [params, opt_state, ema]

        def next_batch():
            nonlocal it
            try:
                return next(it)
            except StopIteration:
                it = iter(loader)
                return next(it)

        def run(n, stamps):
            params, opt_state, ema = carry
            prev = None
            for _ in range(n):
                batch = next_batch()
                if k > 1:
                    group = [batch] + [next_batch() for _ in range(k - 1)]
                    batch = jax.tree.map(
                        lambda *xs: np.stack(xs, axis=1).reshape(-1, *xs[0].shape[1:]), *group)
                # jax.device_put first, as hand-written loops usually do; --hand-host-arrays
                # hands the host arrays to the step, which places them (as Fit does).
                batch = batch if args.hand_host_arrays else jax.device_put(batch, batch_sh)
                params, opt_state, ema, loss = step(params, opt_state, ema, batch)
                if prev is not None:
                    prev.block_until_ready()
                prev = loss
                stamps.append((time.perf_counter(), time.process_time()))
            prev.block_until_ready()
            carry[:] = [params, opt_state, ema]

        def result():
            params, _, ema = carry
            return jax.device_get(params if ema is None else ema[0])

        def hlo_text():
            """The hand-written step as XLA compiled it (lowered from the carry's shapes)."""
            abstract = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), carry)
            batch = next_batch()
            if k > 1:
                batch = jax.tree.map(lambda x: np.concatenate([x] * k), batch)
            return step.lower(*abstract, batch).compile().as_text()

        return run, result, hlo_text

    def hand_round(fit):
        run, result, hlo_text = hand_loop(fit)
        stamps = []
        run(args.steps, stamps)
        return stamps, result(), hlo_text

    # -- interleaved: one Fit paused every `chunk` steps for as many hand-written steps -------
    def interleaved_round():
        """Fit and the hand-written loop take turns every `args.interleave` steps in one
        process (a callback drains Fit's step and runs the hand-written chunk), so that both
        see the same machine within a fraction of a second: `(fit_chunks, hand_chunks, fit,
        fit_params, hand_params)`, each chunk its list of timestamps."""
        chunk = args.interleave
        fit_chunks, hand_chunks, current, hand = [], [], [], []

        def at_end(f, module, outputs, batch, batch_idx):
            current.append((time.perf_counter(), time.process_time()))
            if f.global_step % chunk:
                return
            jax.block_until_ready(outputs.metrics)  # Fit's steps are done: the devices are idle
            if not hand:
                hand.extend(hand_loop(f))
            fit_chunks.append(list(current))
            current.clear()
            stamps = []
            hand[0](chunk, stamps)
            hand_chunks.append(stamps)

        fit, params = train_with_fit(args.steps * args.rounds, at_end, averaging_callbacks())
        return fit_chunks, hand_chunks, fit, params, hand[1](), hand[2]

    def median_step(stamps, skip=args.warmup):
        d = np.diff([wall for wall, _ in stamps[skip:]])
        return float(np.median(d))

    def cpu_per_step(stamps, skip=args.warmup):
        # CPU seconds of the whole process (every thread: the loop, XLA's, the prefetcher's)
        # per step in the steady state: what the loop costs, unlike wall time not inflated by
        # waiting for a core another program holds.
        cpu = [c for _, c in stamps[skip:]]
        return (cpu[-1] - cpu[0]) / (len(cpu) - 1)

    rounds = []
    fit_params = hand_params = None
    if args.interleave:
        fit_chunks, hand_chunks, fit, fit_params, hand_params, hand_hlo = interleaved_round()
        # The first chunk pair compiles the hand-written step: dropped as warm-up. In every
        # chunk the first step starts with nothing in flight: its interval is dropped too.
        for f_stamps, h_stamps in list(zip(fit_chunks, hand_chunks, strict=True))[1:]:
            rounds.append({"fit_ms": median_step(f_stamps, 1) * 1e3,
                           "hand_ms": median_step(h_stamps, 1) * 1e3,
                           "fit_cpu_ms": cpu_per_step(f_stamps, 1) * 1e3,
                           "hand_cpu_ms": cpu_per_step(h_stamps, 1) * 1e3})
    for _ in range(0 if args.interleave else args.rounds):
        f_stamps, fit_params, fit = fit_round()
        h_stamps, hand_params, hand_hlo = hand_round(fit)
        rounds.append({"fit_ms": median_step(f_stamps) * 1e3,
                       "hand_ms": median_step(h_stamps) * 1e3,
                       "fit_cpu_ms": cpu_per_step(f_stamps) * 1e3,
                       "hand_cpu_ms": cpu_per_step(h_stamps) * 1e3})
    for r in rounds:
        r["ratio"] = r["fit_ms"] / r["hand_ms"]
        r["cpu_ratio"] = r["fit_cpu_ms"] / r["hand_cpu_ms"]
    rel = max(
        float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b)))
        for a, b in zip(jax.tree.leaves(fit_params), jax.tree.leaves(hand_params), strict=True)
    )
    ratios = [r["ratio"] for r in rounds]
    fit_ops, hand_ops = hlo_ops(fit.session.compiled_train_step.as_text()), hlo_ops(hand_hlo())
    return {
        "devices": args.devices,
        "strategy": fit.strategy.name,
        "steps": args.steps,
        "batch": args.batch,
        "hidden": args.hidden,
        "self_log": args.log,
        "accumulate_grad_batches": k,
        "interleave": args.interleave,
        "epoch_steps": args.epoch_steps,
        "prefetch_batches": args.prefetch_batches,
        "hand_host_arrays": args.hand_host_arrays,
        "ema_decay": args.ema,
        "swa_lrs": args.swa,
        "median_fit_ms": float(np.median([r["fit_ms"] for r in rounds])),
        "median_hand_ms": float(np.median([r["hand_ms"] for r in rounds])),
        "median_ratio": float(np.median(ratios)),
        # The same ratio in CPU seconds per step (all threads): robust to other programs'
        # load on a shared machine, where the wall-clock ratio of one round ranges 0.6-1.4.
        "median_cpu_ratio": float(np.median([r["cpu_ratio"] for r in rounds])),
        "target_ratio": 1.02,
        "ratio_met": bool(np.median(ratios) <= 1.02),
        "final_params_max_rel_err": rel,
        "params_agree_1e-6": bool(rel <= 1e-6),
        # The device work, read from the two compiled programs: the instructions whose counts
        # differ (Fit's step also counts its steps), and whether the collectives are the same.
        "hlo_op_counts_differing": {op: {"fit": fit_ops[op], "hand": hand_ops[op]}
                                    for op in sorted(set(fit_ops) | set(hand_ops))
                                    if fit_ops[op] != hand_ops[op] and op != "collectives"},
        "collectives_equal": fit_ops["collectives"] == hand_ops["collectives"],
        "rounds": rounds,
        "platform": jax.devices()[0].platform,
        "device_kind": jax.devices()[0].device_kind,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=None, help="simulated CPU devices (one run)")
    p.add_argument("--strategy", choices=["dp", "fsdp"], default="dp")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--din", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--log", action="store_true",
                   help="Fit's training_step also calls self.log(..., on_epoch=True, prog_bar)")
    p.add_argument("--accumulate", type=int, default=1,
                   help="loader batches per optimizer step (Fit's accumulate_grad_batches)")
    p.add_argument("--ema", type=float, default=None,
                   help="Fit runs callbacks.EMAWeightAveraging(decay); the hand loop the same EMA")
    p.add_argument("--swa", type=float, default=None,
                   help="Fit runs callbacks.StochasticWeightAveraging(swa_lrs, 1, 2); the hand "
                        "loop the same SWA")
    p.add_argument("--prefetch-batches", type=int, default=None,
                   help="Fit's prefetch_batches (its default: 0 for this in-memory ArrayLoader, "
                        "read in the loop's thread as the hand-written loop does; 2: a reading "
                        "thread)")
    p.add_argument("--hand-host-arrays", action="store_true",
                   help="the hand-written loop passes the host (NumPy) batch to its jitted step "
                        "instead of jax.device_put-ing it first")
    p.add_argument("--epoch-steps", type=int, default=8,
                   help="optimizer steps per epoch (the dataset's size); Fit's epoch ends wait "
                        "for the last step, the hand-written loop has no epochs")
    p.add_argument("--interleave", type=int, default=0,
                   help="one Fit of steps x rounds steps, paused every N steps for N "
                        "hand-written steps (the figure per chunk pair); 0: alternate whole "
                        "rounds, each with its own Fit")
    p.add_argument("--out", default=os.path.join(HERE, "results", "overhead.json"))
    args = p.parse_args(argv)
    if args.devices is not None:
        print(json.dumps(run_one(args)))
        return
    results = []
    for devices, strategy in ((1, "dp"), (8, "dp"), (8, "fsdp")):
        cmd = [sys.executable, os.path.abspath(__file__), "--devices", str(devices),
               "--strategy", strategy, "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--batch", str(args.batch), "--din", str(args.din), "--hidden", str(args.hidden),
               "--warmup", str(args.warmup), "--log-every", str(args.log_every),
               "--epoch-steps", str(args.epoch_steps)]
        cmd += ([] if args.prefetch_batches is None
                else ["--prefetch-batches", str(args.prefetch_batches)])
        cmd += ["--log"] if args.log else []
        cmd += ["--accumulate", str(args.accumulate), "--interleave", str(args.interleave)]
        cmd += ["--hand-host-arrays"] if args.hand_host_arrays else []
        cmd += ["--ema", str(args.ema)] if args.ema is not None else []
        cmd += ["--swa", str(args.swa)] if args.swa is not None else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            results.append({"devices": devices, "strategy": strategy,
                            "error": out.stderr.strip().splitlines()[-1:]})
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {"benchmark": "overhead", "results": results}
    if args.log and args.out == os.path.join(HERE, "results", "overhead.json"):
        args.out = os.path.join(HERE, "results", "overhead_log.json")
    if args.accumulate > 1 and args.out == os.path.join(HERE, "results", "overhead.json"):
        args.out = os.path.join(HERE, "results", "overhead_accumulate.json")
    if args.ema is not None and args.out == os.path.join(HERE, "results", "overhead.json"):
        args.out = os.path.join(HERE, "results", "overhead_ema.json")
    if args.swa is not None and args.out == os.path.join(HERE, "results", "overhead.json"):
        args.out = os.path.join(HERE, "results", "overhead_swa.json")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
