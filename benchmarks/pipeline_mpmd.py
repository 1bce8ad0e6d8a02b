"""GPipe(mpmd=True): the seeds' 784→512→256→10 MLP with each device holding only its own stage.

`jaxlight.nn.Stages(..., packed=False)` under `GPipe(stages, microbatches, mpmd=True)`: a
program per device (`jaxlight.strategies._mpmd_runtime`). Five measurements on simulated CPU
devices:

1. memory: per pipeline device, the parameter, Adam mu and Adam nu bytes it holds (read from
   the live arrays' devices) against its stage's own bytes, for 3 and 4 stages (the fourth a
   parameter-free log-softmax); beside them what SPMD GPipe holds per device for the same MLP
   (`Stages` packed rows, and `balance=True`).
2. equivalence: 10 AdamW steps against SingleDevice running the same model (3 and 4 stages).
3. copies: the device-to-device copies of one step (`MpmdProgram.transfers`) against theory,
   2·m·(p − 1) boundary copies of b·w·4 bytes (w the boundary's own width: no padding) and
   the labels' B·4 bytes from the first device (where the batch arrives) to the loss beside
   the last stage, and the scalar copies beside them.
4. device_memory: per device, the step's arguments and its peak of live values plus a
   segment's temporaries (`MpmdProgram.device_bytes`), at a global batch of 4096, with and
   without `remat`.
5. timed_bubble: the bubble measured from step times at p = 2 on this host's two cores, with
   two stages of equal cost (elementwise layers, single-threaded per device under this
   benchmark's XLA flags: an XLA:CPU matmul uses both cores whatever the flags), m = 1..16,
   timed round robin and fitted as `pipeline_stages` fits SPMD GPipe (T = α + γ·(m + p − 1)),
   each step waited for whole (its new state, not only its loss, which a program per device
   returns before the backward pass has run).
6. schedule: for m = 1..16 at p = 3 and 4, the step's timeline built from the compiled program
   itself (`MpmdProgram.simulate`: every device runs its executables in the order the host
   dispatches them, each as soon as its inputs exist) with unit-cost stage calls: makespan
   against 2(m + p − 1) and the bubble against (p − 1)/(m + p − 1), exactly. Beside it the step
   time measured on this host, the serial time of its segments, and the makespan the same
   simulation predicts from the measured segment costs. Simulated devices share the host's
   cores (two here, and one XLA:CPU matmul already uses both), so the measured overlap is the
   host's, not the schedule's; `cpus` is in the JSON.

    python benchmarks/pipeline_mpmd.py            # everything: results/pipeline_mpmd.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import gpipe_precision, setup_devices, write_result  # noqa: E402

setup_devices(8)
# Each simulated device runs its ops on one thread, so that two devices compute at once on two
# cores (the timed section below; the other sections count bytes and do not depend on it).
os.environ["XLA_FLAGS"] += (" --xla_cpu_multi_thread_eigen=false"
                            " --xla_disable_hlo_passes=cpu-parallel-task-assigner")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from pipeline_stages import DIMS, bubble_summary, fit_seed_mlp, time_round_robin  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import nn, strategies  # noqa: E402
from jaxlight.nn._pipeline import bubble_fraction  # noqa: E402


def _by_device(tree, devices) -> list[int]:
    per = dict.fromkeys(devices, 0)
    for leaf in jax.tree.leaves(tree):
        (device,) = leaf.sharding.device_set
        per[device] += leaf.nbytes
    return list(per.values())


def memory_and_equivalence(args) -> dict:
    out = {}
    for p in (3, 4):
        _, _, ref, ref_params, _ = fit_seed_mlp(strategies.SingleDevice(), p, args.steps,
                                                args.batch, packed=False)
        fit, module, losses, params, _ = fit_seed_mlp(strategies.GPipe(p, 4, mpmd=True), p,
                                                      args.steps, args.batch, packed=False)
        devices = fit.strategy.pipeline_devices
        own = module.model.own_parameter_bytes()
        adam = fit.state.opt_state[0]
        row = {
            "strategy": f"GPipe({p}, 4, mpmd=True)",
            "own_param_bytes_per_stage": own,
            "held_param_bytes_per_device": _by_device(fit.state.params, devices),
            "held_adam_mu_bytes_per_device": _by_device(adam.mu, devices),
            "held_adam_nu_bytes_per_device": _by_device(adam.nu, devices),
            "max_loss_rel_diff_vs_single": float(np.max(np.abs(losses - ref) / np.abs(ref))),
            "max_param_abs_diff_vs_single": max(float(np.max(np.abs(a - b)))
                                                for a, b in zip(jax.tree.leaves(params),
                                                                jax.tree.leaves(ref_params),
                                                                strict=True)),
            "compiles": fit.compile_counts.get("train"),
        }
        row["bytes_ok"] = (row["held_param_bytes_per_device"] == own
                           and row["held_adam_mu_bytes_per_device"] == own
                           and row["held_adam_nu_bytes_per_device"] == own)
        row["equivalence_ok"] = row["max_loss_rel_diff_vs_single"] <= 1e-5
        for name, balance in (("spmd_packed_rows", False), ("spmd_balance", True)):
            spmd, *_ = fit_seed_mlp(strategies.GPipe(p, 4, devices=jax.devices()[:p]), p, 1,
                                    args.batch, balance=balance)
            packed = spmd.state.params["packed_float32"]
            row[f"{name}_param_bytes_per_device"] = sorted(
                {s.data.nbytes for s in packed.addressable_shards})
        out[f"{p} stages"] = row
    return out


def copies(args) -> dict:
    p, m = 3, 4
    fit, *_ = fit_seed_mlp(strategies.GPipe(p, m, mpmd=True), p, 1, args.batch, packed=False)
    program = fit.compiled_train_step
    b = args.batch // m
    boundary = [(s, s + 1, b * DIMS[s + 1] * 4) for s in range(p - 1)]
    labels = (0, p - 1, args.batch * 4)  # from the first device, where the batch arrives
    expected = sorted([*boundary, *((t, s, n) for s, t, n in boundary)] * m + [labels])
    found = program.transfers()
    big = sorted((c.source, c.target, c.nbytes) for c in found if c.nbytes > 8)
    return {
        "stages": p, "microbatches": m, "microbatch_size": b,
        "boundary_copies": len(big), "expected_boundary_copies": 2 * m * (p - 1) + 1,
        "boundary_copy_bytes": sum(n for *_, n in big),
        "expected_boundary_copy_bytes": sum(n for *_, n in expected),
        "scalar_copies": len(found) - len(big),
        "scalar_copy_bytes": sum(c.nbytes for c in found if c.nbytes <= 8),
        "ok": big == expected,
        "spmd_gpipe_permute_bytes_same_batch": 2 * (m + p - 1) * b * DIMS[1] * 4,
    }


def device_memory(args) -> dict:
    out = {}
    for remat in (False, True):
        fit, *_ = fit_seed_mlp(strategies.GPipe(3, 4, mpmd=True, remat=remat), 3, 1,
                               args.memory_batch, packed=False)
        out[f"remat={remat}"] = fit.compiled_train_step.device_bytes()
    return {"global_batch": args.memory_batch, "per_device": out}


def _step_seconds(program, state, batch, steps):
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = program(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
    return state, min(times)


def schedule(args, p) -> dict:
    rows = []
    for m in args.microbatches:
        b = args.microbatch_size
        fit, *_, data = fit_seed_mlp(strategies.GPipe(p, m, mpmd=True), p, 1, m * b,
                                     packed=False)
        program = fit.compiled_train_step
        unit = program.simulate(lambda seg: float(seg.stage is not None))
        stage_segments = [sum(1 for s in program.segments if s.stage is not None
                              and s.device == d) for d in range(p)]
        row = {
            "microbatches": m,
            "segments": len(program.segments),
            "executables": len(program._executables),
            "stage_calls_per_device": stage_segments,
            "unit_makespan": unit["makespan"],
            "expected_makespan": 2 * (m + p - 1),
            "bubble_fraction_schedule": 1 - max(unit["busy"]) / unit["makespan"],
            "bubble_fraction_theory": bubble_fraction(p, m),
        }
        row["schedule_ok"] = (unit["makespan"] == row["expected_makespan"]
                              and abs(row["bubble_fraction_schedule"]
                                      - row["bubble_fraction_theory"]) < 1e-12
                              and stage_segments == [2 * m] * p)
        if args.time:
            batch = fit.strategy.put_batch(data[0], fit.session.train_batch_shardings)
            state, measured = _step_seconds(program, fit.session.state, batch, args.timing_steps)
            _, costs = program.segment_seconds(state, batch)
            cost = {id(seg): t for seg, (_, _, t) in zip(program.segments, costs, strict=True)}
            predicted = program.simulate(lambda seg: cost[id(seg)])
            row.update(step_seconds=measured, serial_seconds=sum(t for *_, t in costs),
                       predicted_seconds=predicted["makespan"])
        rows.append(row)
    return {"stages": p, "microbatch_size": args.microbatch_size,
            "all_schedule_ok": all(r["schedule_ok"] for r in rows), "rows": rows}


class _Elementwise(nnx.Module):
    """A stage of `depth` elementwise layers over `width` features: single-threaded per
    device under this benchmark's flags (an XLA:CPU matmul is not), so that two devices
    compute at once on two cores."""

    def __init__(self, width: int, depth: int, rngs):
        self.w = nnx.Param(1.0 + 0.01 * jax.random.normal(rngs.params(), (width,)))
        self.depth = depth

    def __call__(self, x):
        for _ in range(self.depth):
            x = jnp.tanh(x * self.w[...]) + 0.5 * x
        return x


class EqualStages(jl.TrainModule):
    """p stages of equal cost, a squared loss: the bubble's theory holds for equal stages."""

    def __init__(self, stages: int, width: int, depth: int):
        super().__init__()
        self.stages, self.width, self.depth = stages, width, depth

    def configure_model(self, rngs):
        return nn.Stages([_Elementwise(self.width, self.depth, rngs)
                          for _ in range(self.stages)], packed=False)

    def configure_optimizers(self):
        return optax.sgd(1e-3)

    def training_step(self, model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def timed_bubble(args) -> dict:
    """The measured bubble of the program per device, at p = 2 on this host's two cores: step
    times T(m) of equal elementwise stages for m = 1..16 (microbatch size fixed), timed round
    robin, fitted to T = α + γ·(m + p − 1) as `pipeline_stages` does for SPMD GPipe."""
    p, b, width = 2, args.timed_microbatch_size, args.timed_width
    rows, fits = [], {}
    rng = np.random.default_rng(0)
    for m in args.microbatches:
        data = [{"x": rng.normal(size=(m * b, width)).astype(np.float32),
                 "y": rng.normal(size=(m * b, width)).astype(np.float32)}]
        fit = jl.Fit(strategy=strategies.GPipe(p, m, mpmd=True), max_steps=1,
                     enable_progress_bar=False, enable_model_summary=False, logger=False)
        fit.fit(EqualStages(p, width, args.timed_depth), data)
        fits[m] = (fit, fit.strategy.put_batch(data[0], fit.session.train_batch_shardings))
        rows.append({"microbatches": m, "bubble_fraction_theory": bubble_fraction(p, m)})
    times = time_round_robin(fits, args.rounds, args.timed_steps, whole=True)
    for r in rows:
        r.update(times[r["microbatches"]])
    summary = bubble_summary(rows, p)
    bound = gpipe_precision()
    return {"gpipe_precision_pipeline_stages_p4": bound,
            "within_gpipe_precision": (None if bound is None
                                       else summary["max_bubble_abs_error"] <= bound),
            "stages": p, "microbatch_size": b, "width": width, "depth": args.timed_depth,
            "rounds": args.rounds, "steps_per_round": args.timed_steps, **summary,
            "rows": rows}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--memory-batch", type=int, default=4096)
    parser.add_argument("--microbatch-size", type=int, default=128)
    parser.add_argument("--microbatches", type=int, nargs="*", default=list(range(1, 17)))
    parser.add_argument("--timing-steps", type=int, default=10)
    parser.add_argument("--no-time", dest="time", action="store_false")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--timed-steps", type=int, default=2)
    parser.add_argument("--timed-microbatch-size", type=int, default=128)
    parser.add_argument("--timed-width", type=int, default=256)
    parser.add_argument("--timed-depth", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)  # m < p warns by design
    report = {"jax": jax.__version__, "cpus": os.cpu_count(),
              "memory": memory_and_equivalence(args), "copies": copies(args),
              "device_memory": device_memory(args),
              "schedule": {f"p={p}": schedule(args, p) for p in (3, 4)}}
    if args.time:
        report["timed_bubble"] = timed_bubble(args)
    write_result("pipeline_mpmd", report, args.out)
    return report


if __name__ == "__main__":
    main()
