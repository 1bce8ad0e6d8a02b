"""GPipe over stages of any shape: the seeds' 784→512→256→10 MLP as `jaxlight.nn.Stages`.

Four measurements on 8 simulated CPU devices:

1. equivalence: 10 training steps (AdamW) of the MLP in 3 stages under GPipe(3, 4) (mesh
   data 2 × pipe 3, 6 devices) and in 4 stages (a parameter-free log-softmax stage added)
   under Hybrid({"data": 2, "pipe": 4}, microbatches=4), each against SingleDevice running the
   same `Stages` model: the largest relative loss difference and parameter difference.
2. memory: per pipeline device, the parameter bytes its stages own, the bytes it holds (the
   packed row: its stages' parameters, zero-padded to the largest stage) and its Adam slots;
   and (`activation_memory`) the compiled step's per-device temporaries, arguments and
   outputs (`memory_analysis`) for SingleDevice and each pipeline layout, with and without the
   strategy's remat, at a global batch of 512.
3. staged_lm: `jaxlight.nn.StagedTransformerLM` (embedding and head inside the pipeline, 4
   stages) under GPipe(4, 4) on data 2 × pipe 4 against SingleDevice (10 steps), beside
   `TransformerLM` under the same GPipe: permute bytes against 2(m + p − 1)·b·W·β (W: length
   × vocab for the staged model, length × width for the stack), parameter bytes and compiled
   temporaries per device.
4. schedule: for m = 1..16 at p = 3 and p = 4, the trip counts of the compiled step's
   collective-permutes (expected m + p − 1 each, forward and backward), the permute bytes per
   step and device against 2(m + p − 1)·b·W·β (W: the widest stage output, the buffer every
   boundary is padded to), and a measured bubble. The microbatch size b is fixed (global batch
   m·b, so that every m from 1 to 16 divides it), each of the m + p − 1 iterations costs the
   same γ and the step time follows T(m) = α + γ·(m + p − 1) (α: optimizer and loss); α and γ
   are fitted by least squares over the m values and the measured bubble is the share of the
   schedule's time beyond its m useful iterations, (T(m) − α − γ·m)/(T(m) − α). Steps are
   timed round robin over m (`--rounds` rounds of `--timing-steps` steps each); each m's
   time is its fastest step (other load only adds time), and the rows report the median of
   the rounds' fastest steps and their spread beside it. On the two shared cores of the
   project's machine the timings are noise (other sessions' load); the committed figures come
   from an unloaded 16-core host (`cpus` in the JSON).
   Simulated devices share the host's cores, so an idle stage computes its branch on an
   empty buffer instead of idling: each iteration still costs the same, as on chips.

    python benchmarks/pipeline_stages.py     # everything: results/pipeline_stages.json
    python benchmarks/pipeline_stages.py --only schedule --microbatches 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import setup_devices, write_result  # noqa: E402

if "jax" not in sys.modules:  # (pipeline_interleaved.py imports this module after jax)
    setup_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import nn, strategies  # noqa: E402
from jaxlight.nn._pipeline import bubble_fraction  # noqa: E402
from jaxlight.nn._stages import stage_bytes  # noqa: E402
from jaxlight.strategies._pipelined import schedule_stats  # noqa: E402

DIMS = (784, 512, 256, 10)


class SeedMLP(jl.TrainModule):
    """The seeds' pipeline example: 784→512→256→10 with ReLU, one Linear per stage."""

    def __init__(self, stages: int = 3, balance: bool = False, packed: bool = True):
        super().__init__()
        self.stages, self.balance, self.packed = stages, balance, packed

    def configure_model(self, rngs):
        d = DIMS
        parts = [nnx.Sequential(nnx.Linear(d[0], d[1], rngs=rngs), nnx.relu),
                 nnx.Sequential(nnx.Linear(d[1], d[2], rngs=rngs), nnx.relu),
                 nnx.Linear(d[2], d[3], rngs=rngs)]
        if self.stages == 4:
            parts.append(nnx.Sequential(jax.nn.log_softmax))
        return nn.Stages(parts, balance=self.balance, packed=self.packed)

    def configure_optimizers(self):
        return optax.adamw(1e-3)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def batches(steps, batch, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.normal(size=(batch, DIMS[0])).astype(np.float32),
             "y": rng.integers(0, DIMS[-1], size=(batch,)).astype(np.int32)}
            for _ in range(steps)]


def fit_seed_mlp(strategy, stages, steps, batch, balance=False, packed=True):
    """Trains `SeedMLP(stages, balance, packed)` for `steps` steps of `batch` examples:
    (fit, module, losses, parameters as numpy, the batches)."""
    losses = []
    log = jl.callbacks.LambdaCallback(
        on_log=lambda fit, module, metrics, step: losses.append(metrics["loss"]))
    fit = jl.Fit(strategy=strategy, max_steps=steps, log_every_n_steps=1, callbacks=[log],
                 enable_progress_bar=False, enable_model_summary=False, logger=False)
    module = SeedMLP(stages, balance, packed)
    data = batches(steps, batch)
    fit.fit(module, data)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return fit, module, np.asarray(losses), params, data


def _pipe_index(mesh, device) -> int:
    return int(np.argwhere(mesh.devices == device)[0][mesh.axis_names.index("pipe")])


def memory(fit, module, p) -> dict:
    """Per pipeline device: own parameter bytes, held parameter bytes, held Adam slot bytes."""
    mesh = fit.strategy.mesh
    packed = {d: fit.state.params[f"packed_{d}"] for d in module.model.dtypes}
    mu = {d: fit.state.opt_state[0].mu[f"packed_{d}"] for d in module.model.dtypes}
    nu = {d: fit.state.opt_state[0].nu[f"packed_{d}"] for d in module.model.dtypes}
    held = [0] * p
    slots = [0] * p
    seen = set()
    for d, x in packed.items():
        for shard in x.addressable_shards:
            s = _pipe_index(mesh, shard.device)
            if (d, s) in seen:  # the data replicas hold the same row
                continue
            seen.add((d, s))
            held[s] += shard.data.nbytes
        for tree in (mu[d], nu[d]):
            done = set()
            for shard in tree.addressable_shards:
                s = _pipe_index(mesh, shard.device)
                if s not in done:
                    done.add(s)
                    slots[s] += shard.data.nbytes
    theory = stage_bytes(module.model, module.model.num_stages // p)
    own = theory["own"]
    return {
        "own_param_bytes_per_device": own,
        "held_param_bytes_per_device": held,
        "held_theory": theory["held"],
        "adam_slot_bytes_per_device": slots,
        "padding_bytes_per_device": [h - o for h, o in zip(held, own, strict=True)],
        "held_over_own_largest_stage": max(held) / max(own),
        "ok": all(h == theory["held"] for h in held) and max(held) - max(own) < 128 * 4 * 2,
    }


def balanced(args) -> dict:
    """`Stages(balance=True)` against the padded rows, the 3-stage MLP under GPipe(3, 4) on
    data 2 × pipe 3 (10 steps each, batch `--batch`): loss against SingleDevice, parameter and
    Adam bytes held per device (from the shards), compiled memory and collectives per device."""
    out = {"jax": jax.__version__, "cpus": os.cpu_count(), "runs": {}}
    _, _, ref, _, _ = fit_seed_mlp(strategies.SingleDevice(), 3, args.steps, args.batch)
    for name, balance in (("padded rows", False), ("balance=True", True)):
        fit, module, losses, _, _ = fit_seed_mlp(
            strategies.GPipe(3, 4, devices=jax.devices()[:6]), 3, args.steps, args.batch,
            balance=balance)
        ma = fit.compiled_train_step.memory_analysis()
        packed = fit.state.params["packed_float32"]
        mu = fit.state.opt_state[0].mu["packed_float32"]
        stats = schedule_stats(fit.compiled_train_step.as_text())
        out["runs"][name] = {
            "max_loss_rel_diff_vs_single": float(np.max(np.abs(losses - ref) / np.abs(ref))),
            "own_param_bytes_per_stage": module.model.own_parameter_bytes(),
            "held_param_bytes_per_device": sorted({s.data.nbytes
                                                   for s in packed.addressable_shards}),
            "held_adam_mu_bytes_per_device": sorted({s.data.nbytes
                                                     for s in mu.addressable_shards}),
            "argument_bytes_per_device": int(ma.argument_size_in_bytes),
            "temp_bytes_per_device": int(ma.temp_size_in_bytes),
            "collective_permute_bytes": stats["collective_permute_bytes"],
            "other_collectives": stats["other_collectives"],
        }
    return out


def equivalence(args) -> dict:
    out = {"steps": args.steps, "global_batch": args.batch, "tolerance": 1e-5, "runs": {}}
    for stages, name, strategy in (
        (3, "GPipe(stages=3, microbatches=4), data 2 x pipe 3",
         strategies.GPipe(3, 4, devices=jax.devices()[:6])),
        (4, "Hybrid(data 2 x pipe 4, microbatches=4), 4 stages",
         strategies.Hybrid({"data": 2, "pipe": 4}, microbatches=4)),
    ):
        _, _, ref_losses, ref_params, _ = fit_seed_mlp(strategies.SingleDevice(), stages,
                                                       args.steps, args.batch)
        fit, module, losses, params, _ = fit_seed_mlp(strategy, stages, args.steps, args.batch)
        loss_rel = float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses)))
        param_abs = max(float(np.max(np.abs(a - b))) for a, b in
                        zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True))
        out["runs"][name] = {
            "stages": stages,
            "mesh": dict(fit.strategy.mesh.shape),
            "max_loss_rel_diff": loss_rel,
            "max_param_abs_diff": param_abs,
            "final_loss": float(losses[-1]), "single_final_loss": float(ref_losses[-1]),
            "compiles": fit.compile_counts.get("train"),
            "ok": loss_rel <= 1e-5,  # the target; Adam amplifies rounding in the parameters
            "params_ok": param_abs <= 1e-4,
            "memory": memory(fit, module, fit.strategy.stages),
        }
    return out


def activation_memory(args) -> dict:
    """Per-device bytes of the compiled step (`memory_analysis`) for each layout of the MLP,
    with and without the strategy's remat: temporaries (activations kept for the backward
    pass, gradients, the schedule's buffers), arguments (parameters, optimizer state, batch)."""
    layouts = (
        (3, "SingleDevice", lambda remat: strategies.SingleDevice()),
        (3, "GPipe(stages=3, microbatches=4), data 2 x pipe 3",
         lambda remat: strategies.GPipe(3, 4, remat=remat, devices=jax.devices()[:6])),
        (4, "Hybrid(data 2 x pipe 4, microbatches=4), 4 stages",
         lambda remat: strategies.Hybrid({"data": 2, "pipe": 4}, microbatches=4, remat=remat)),
    )
    out = {"global_batch": args.memory_batch, "layouts": {}}
    for stages, name, make in layouts:
        for remat in ((False,) if name == "SingleDevice" else (False, True)):
            fit, *_ = fit_seed_mlp(make(remat), stages, 1, args.memory_batch)
            ma = fit.compiled_train_step.memory_analysis()
            out["layouts"][f"{name}, remat={remat}"] = {
                "temp_bytes_per_device": int(ma.temp_size_in_bytes),
                "argument_bytes_per_device": int(ma.argument_size_in_bytes),
                "output_bytes_per_device": int(ma.output_size_in_bytes),
            }
    return out


class LM(jl.TrainModule):
    """Next-token prediction with `TransformerLM` (embedding and head outside the pipeline) or
    `StagedTransformerLM` (inside it: embedding, 2 × 2 blocks, head = 4 stages)."""

    CONFIG = dict(vocab_size=512, embed_dim=64, num_layers=4, num_heads=4,
                  tie_embeddings=False)

    def __init__(self, staged: bool):
        super().__init__()
        self.staged = staged

    def configure_model(self, rngs):
        config = nn.TransformerConfig(**self.CONFIG)
        if self.staged:
            return nn.StagedTransformerLM(config, layers_per_stage=2, rngs=rngs)
        return nn.TransformerLM(config, rngs=rngs)

    def configure_optimizers(self):
        return optax.adamw(1e-3)

    def training_step(self, model, batch):
        tokens = batch["tokens"]
        return nn.lm_loss(model(tokens[:, :-1]), tokens[:, 1:])


def staged_lm(args) -> dict:
    """StagedTransformerLM under GPipe(4, 4) on data 2 × pipe 4 against SingleDevice (10
    steps), and against TransformerLM under the same GPipe: permute bytes, parameter bytes and
    compiled memory per device."""
    length, batch = 32, 32
    rng = np.random.default_rng(0)
    data = [{"tokens": rng.integers(0, LM.CONFIG["vocab_size"], size=(batch, length + 1))
             .astype(np.int32)} for _ in range(args.steps)]

    def run(strategy, staged):
        losses = []
        log = jl.callbacks.LambdaCallback(
            on_log=lambda fit, module, metrics, step: losses.append(metrics["loss"]))
        fit = jl.Fit(strategy=strategy, max_steps=args.steps, log_every_n_steps=1,
                     callbacks=[log], enable_progress_bar=False, enable_model_summary=False,
                     logger=False)
        module = LM(staged)
        fit.fit(module, data)
        return fit, module, np.asarray(losses)

    _, _, ref = run(strategies.SingleDevice(), True)
    out = {"config": LM.CONFIG, "length": length, "global_batch": batch, "steps": args.steps,
           "layouts": {}}
    for name, staged in (("StagedTransformerLM", True), ("TransformerLM", False)):
        fit, module, losses = run(strategies.GPipe(4, 4), staged)
        stats = schedule_stats(fit.compiled_train_step.as_text())
        ma = fit.compiled_train_step.memory_analysis()
        row = {
            "strategy": "GPipe(4, 4), data 2 x pipe 4",
            "schedule_iterations": stats["iterations"],
            "collective_permute_bytes": stats["collective_permute_bytes"],
            "other_collectives": stats["other_collectives"],
            "param_bytes_per_device": fit.strategy.bytes_per_device(
                fit.state.params, jax.tree.map(lambda a: a.sharding, fit.state.params)),
            "temp_bytes_per_device": int(ma.temp_size_in_bytes),
            "argument_bytes_per_device": int(ma.argument_size_in_bytes),
        }
        b = batch // (4 * 2)
        if staged:
            row["max_loss_rel_diff_vs_single"] = float(np.max(np.abs(losses - ref) / ref))
            row["ok"] = row["max_loss_rel_diff_vs_single"] <= 1e-5
            row["own_param_bytes_per_stage"] = module.model.own_parameter_bytes()
            # The widest boundary: the head's logits, length × vocab per example.
            row["expected_permute_bytes"] = 2 * (4 + 4 - 1) * b * length * \
                LM.CONFIG["vocab_size"] * 4
        else:
            row["expected_permute_bytes"] = 2 * (4 + 4 - 1) * b * length * \
                LM.CONFIG["embed_dim"] * 4
        row["permute_bytes_ok"] = row["collective_permute_bytes"] == row["expected_permute_bytes"]
        out["layouts"][name] = row
    return out


def _time_steps(fit, batch, steps, whole: bool = False) -> list[float]:
    """Seconds per step of the compiled train step, one step in flight (exact timings).

    One SPMD program finishes all at once, so its metrics are ready when the step is; `whole`
    waits for the new state too (a program per device returns the loss before the backward
    pass and the optimizer have run: `GPipe(mpmd=True)`)."""
    compiled = fit.compiled_train_step
    state = fit.session.state
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics) if whole else metrics)
        times.append(time.perf_counter() - start)
    fit.session.state = state  # the previous state was donated
    return times


def fit_bubble(rows, p, iterations=None) -> tuple[float, float]:
    """Least squares T(m) = α + γ·iterations(m); fills each row's measured bubble.

    `iterations(m)` defaults to the GPipe schedule's m + p − 1 (an interleaved schedule
    passes its own); a row's useful iterations are `row["useful_iterations"]` (default m).
    Each row's step time is `row["step_seconds"]`; the rows also get the time's relative
    deviation from the fitted line (`fit_rel_residual`: the timing precision the bubble
    figure inherits, amplified by T/(T − α)).
    """
    iterations = iterations or (lambda m: m + p - 1)
    x = np.array([iterations(r["microbatches"]) for r in rows], dtype=float)
    t = np.array([r["step_seconds"] for r in rows])
    (alpha, gamma), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), t, rcond=None)
    for r, xi, ti in zip(rows, x, t, strict=True):
        useful = r.get("useful_iterations", r["microbatches"])
        r["step_seconds_fit"] = float(alpha + gamma * xi)
        r["fit_rel_residual"] = float((ti - r["step_seconds_fit"]) / r["step_seconds_fit"])
        r["bubble_fraction_measured"] = float((ti - alpha - gamma * useful) / (ti - alpha))
        r["bubble_abs_error"] = abs(r["bubble_fraction_measured"] - r["bubble_fraction_theory"])
    return float(alpha), float(gamma)


def bubble_summary(rows, p, iterations=None) -> dict:
    """`fit_bubble` over `rows`, and what the JSON reports of it: the fitted line and the
    largest bubble error and timing residual over the rows."""
    alpha, gamma = fit_bubble(rows, p, iterations)
    return {"fit_alpha_s": alpha, "fit_gamma_s_per_iteration": gamma,
            "max_bubble_abs_error": max(r["bubble_abs_error"] for r in rows),
            "max_fit_rel_residual": max(abs(r["fit_rel_residual"]) for r in rows)}


def time_round_robin(fits: dict, rounds: int, steps, whole: bool = False) -> dict:
    """Step seconds per configuration, timed round robin (one step in flight): each round
    times `steps` steps of every configuration in turn (after one untimed warm step), so that
    a change of load on a shared machine reaches every configuration alike (`steps` a number,
    or a function of the key: more steps for the short ones). Returns per key the fastest
    step (other load only adds time) and the median of the rounds' fastest steps."""
    count = steps if callable(steps) else lambda key: steps
    per_round: dict = {key: [] for key in fits}
    for _ in range(rounds):
        for key in fits:
            per_round[key].append(min(_time_steps(*fits[key], count(key) + 1, whole)[1:]))
    return {key: {"step_seconds": min(v), "step_seconds_median": statistics.median(v),
                  "round_spread": (max(v) - min(v)) / min(v)} for key, v in per_round.items()}


def schedule(args, p) -> dict:
    stages = p  # one stage per device, no data axis: b = B / m
    devices = jax.devices()[:p]
    rows, fits = [], {}
    for m in args.microbatches:
        b = args.microbatch_size
        fit, _, _, _, data = fit_seed_mlp(strategies.GPipe(p, m, devices=devices), stages, 1, m * b)
        fits[m] = (fit, fit.strategy.put_batch(data[0], fit.session.train_batch_shardings))
        stats = schedule_stats(fit.compiled_train_step.as_text())
        width = DIMS[1]  # the widest stage output: 512
        expected = 2 * (m + p - 1) * b * width * 4
        rows.append({
            "microbatches": m,
            "microbatch_size": b,
            "schedule_iterations": stats["iterations"],
            "expected_iterations": m + p - 1,
            "iterations_ok": stats["iterations"] == [m + p - 1] * 2,
            "collective_permute_bytes": stats["collective_permute_bytes"],
            "expected_permute_bytes": expected,
            "permute_bytes_ok": stats["collective_permute_bytes"] == expected,
            "other_collectives": stats["other_collectives"],
            "bubble_fraction_theory": bubble_fraction(p, m),
        })
    times = time_round_robin(fits, args.rounds, args.timing_steps)
    for r in rows:
        r.update(times[r["microbatches"]])
    return {"stages": p, "microbatch_size": args.microbatch_size, "rounds": args.rounds,
            "steps_per_round": args.timing_steps, **bubble_summary(rows, p), "rows": rows}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["equivalence", "memory", "balanced", "staged_lm",
                                           "schedule"], nargs="*", default=None)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=48, help="global batch (equivalence)")
    parser.add_argument("--memory-batch", type=int, default=512,
                        help="global batch of the activation-memory compiles")
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(range(1, 17)))
    parser.add_argument("--stages", type=int, nargs="+", default=[3, 4],
                        help="pipeline sizes of the schedule measurement")
    parser.add_argument("--microbatch-size", type=int, default=64,
                        help="examples per microbatch in the timed steps (global batch m·b)")
    parser.add_argument("--timing-steps", type=int, default=3, help="steps per m and round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    parts = args.only or ["equivalence", "memory", "balanced", "staged_lm", "schedule"]
    result = {"jax": jax.__version__, "devices": jax.device_count(),
              "platform": jax.devices()[0].platform, "cpus": os.cpu_count(),
              "model": {"dims": DIMS}}
    if "equivalence" in parts:
        result["equivalence"] = equivalence(args)
    if "memory" in parts:
        result["activation_memory"] = activation_memory(args)
    if "balanced" in parts:
        result["balanced"] = balanced(args)
    if "staged_lm" in parts:
        result["staged_lm"] = staged_lm(args)
    if "schedule" in parts:
        result["schedule"] = {f"p={p}": schedule(args, p) for p in args.stages}
    if args.only is None or args.out:
        write_result("pipeline_stages", result, args.out)
    else:
        import json

        print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
