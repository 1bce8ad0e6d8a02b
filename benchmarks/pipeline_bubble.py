"""Each pipeline schedule's bubble measured from step times: GPipe, 1F1B and ZB-H1 side by side.

`GPipe(2, m, schedule=s, mpmd=True)` (a program per device) on this host's two cores, two
stages of equal cost, a fixed microbatch size, m microbatches. Each simulated device is meant
to run its executables on one thread (`pipeline_mpmd`'s XLA flags), so that the two devices
compute at once; `pass_costs` gives every pass's CPU time beside its wall time, which shows
whether it did (CPU time above wall time: other threads of the process, the XLA:CPU intra-op
pool's, ran beside it; measured 1.3-1.9× in some runs, 1.0 in others). The three
schedules' steps are timed round robin (`pipeline_stages.time_round_robin`: one step in
flight, each step waited for whole), so load on the shared machine reaches every schedule and
m alike.

The stages (`DenseStages`, the default): behind a learned scale (so that the first stage's
input has a gradient and every stage has an input-gradient pass), each stage is `depth` dense
layers y = tanh(x @ W) with square W of `width`, one parameter per layer. A layer's forward
pass F is x @ W, its input gradient B is g @ Wᵀ and its weight gradient W is xᵀ @ g (g = dy ·
tanh′): one equal matmul each, the elementwise parts small beside them. The textbook's
premise, passes of equal cost, is therefore checked rather than assumed: `pass_costs` times
every stage executable of one step alone, as the runtime dispatches it (inputs ready, output
waited for; wall and the process's CPU time), and the JSON gives the medians per device and
kind, F, B and W under ZB-H1 and the fused backward pass B + W under GPipe and 1F1B, with the
F:B:W ratio. (`--model elementwise --depth 64`: the former stages, `pipeline_mpmd.EqualStages`,
elementwise layers, whose passes are far from equal: on the second device F 4.6, B 16.4 and W
1.6 ms, and the first stage, whose input has no gradient, runs its whole backward as one W
pass of 20 ms.)

Per schedule, the step time is fitted by least squares to T(m) = α + γ·n(m), n(m) the
schedule's textbook length in units of one microbatch's whole pass through a stage (F + B + W
= 3 unit passes; `_mpmd_schedule.timeline` with unit costs, divided by 3): under GPipe and
1F1B the backward pass is B and W fused, a pass of 2 units, so the makespan is 3(m + p − 1)
units and n(m) = m + p − 1, bubble (p − 1)/(m + p − 1); under ZB-H1, F = B = W = 1 unit,
makespan 3m + p − 1 + max(0, p − m) (`_mpmd_schedule.makespan`), bubble (p − 1)/(3m + p − 1)
for m ≥ p. The measured bubble of each m is the share of the step beyond its useful work
m·γ, (T − α − m·γ) / (T − α), against the textbook bubble (`_mpmd_schedule.bubble`). GPipe's
own figure in the same run is the precision the others are compared with (beside the
committed SPMD GPipe one, `pipeline_stages` at p = 4). Beside the textbook fit, each schedule
is also fitted to the makespan its timeline gives with the measured pass costs
(`predicted_from_pass_costs`): where the textbook fit misses, this says whether unequal passes
are the cause.

    python benchmarks/pipeline_bubble.py       # results/pipeline_bubble.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from pipeline_mpmd import EqualStages  # noqa: E402  (sets the devices and XLA flags first)

# isort: split

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import gpipe_precision, write_result  # noqa: E402
from flax import nnx  # noqa: E402
from pipeline_stages import bubble_summary, fit_bubble, time_round_robin  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import nn, strategies  # noqa: E402
from jaxlight.strategies._mpmd_schedule import bubble, timeline  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
#: Each schedule's passes in the textbook's unit (F = B = W = 1; GPipe's and 1F1B's backward
#: pass is B and W fused).
UNIT_COSTS = {"gpipe": {"F": 1, "B": 2}, "1f1b": {"F": 1, "B": 2},
              "zb-h1": {"F": 1, "B": 1, "W": 1}}


class _Dense(nnx.Module):
    """`depth` layers y = tanh(x @ W), W square, one parameter each (a stacked parameter's
    per-layer slices would add a full-size gradient per layer to the weight-gradient pass)."""

    def __init__(self, width: int, depth: int, rngs):
        self.kernels = nnx.List([nnx.Param(jax.random.normal(rngs.params(), (width, width))
                                           / width ** 0.5) for _ in range(depth)])

    def __call__(self, x):
        for kernel in self.kernels:
            x = jnp.tanh(x @ kernel[...])
        return x


class _Scaled(nnx.Module):
    def __init__(self, stages, width: int):
        self.scale = nnx.Param(jnp.ones((width,)))
        self.body = nn.Stages(stages, packed=False)

    def __call__(self, x):
        return self.body(x * self.scale[...])


class DenseStages(jl.TrainModule):
    """p stages of `depth` square dense layers behind a learned scale, a squared loss: every
    stage has F, B and W passes of one matmul per layer each."""

    def __init__(self, stages: int, width: int, depth: int):
        super().__init__()
        self.stages, self.width, self.depth = stages, width, depth

    def configure_model(self, rngs):
        return _Scaled([_Dense(self.width, self.depth, rngs) for _ in range(self.stages)],
                       self.width)

    def configure_optimizers(self):
        return optax.sgd(1e-3)

    def training_step(self, model, batch):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


MODELS = {"dense": DenseStages, "elementwise": EqualStages}


def textbook_units(schedule: str, p: int, m: int, costs: dict | None = None) -> float:
    """The schedule's makespan (`timeline`) with pass costs `costs` (default: the textbook's
    unit passes), in units of one microbatch's whole pass through a stage."""
    costs = costs or UNIT_COSTS[schedule]
    end = max(end for _, end in timeline(schedule, p, m, lambda kind: costs[kind]).values())
    return end / sum(costs.values())


def pass_costs(fit, batch, calls: int) -> dict:
    """Per device and kind, the median wall and CPU seconds of the step's stage executables,
    each timed alone as the runtime dispatches it (its inputs waited for first, its outputs
    after), over `calls` steps: the segment's own glue (a microbatch's loss, the gradient sum)
    included, as it runs. `other`: the segments without a stage call (optimizer updates)."""
    program = fit.compiled_train_step
    found: dict = {}

    def timed(seg, executable):
        key = (seg.device, seg.call.kind if seg.stage is not None else "other")

        def run(*args):
            jax.block_until_ready(args)
            wall, cpu = time.perf_counter(), time.process_time()
            out = jax.block_until_ready(executable(*args))
            found.setdefault(key, []).append((time.perf_counter() - wall,
                                              time.process_time() - cpu))
            return out
        return run

    executables = [seg.executable for seg in program.segments]
    state = fit.session.state
    try:
        for seg in program.segments:
            seg.executable = timed(seg, seg.executable)
        for _ in range(calls):
            state, metrics = program(state, batch)
            jax.block_until_ready((state, metrics))
    finally:
        for seg, executable in zip(program.segments, executables, strict=True):
            seg.executable = executable
    fit.session.state = state  # the previous state was donated
    out: dict = {}
    for (device, kind), times in sorted(found.items()):
        out.setdefault(f"device_{device}", {})[kind] = {
            "wall_s": statistics.median(t for t, _ in times),
            "cpu_s": statistics.median(c for _, c in times), "calls": len(times)}
    return out


def _kind_costs(costs: dict, measure: str) -> dict:
    """Per kind, the mean over devices of the median `measure` (stage passes only)."""
    kinds = {k for per in costs.values() for k in per if k != "other"}
    return {k: float(np.mean([per[k][measure] for per in costs.values() if k in per]))
            for k in sorted(kinds)}


def _cost_summary(costs: dict, args) -> dict:
    """The pass costs per schedule and m, and their ratios (CPU seconds, medians over m):
    ZB-H1's F : B : W and GPipe's and 1F1B's F : fused backward."""
    ratios = {}
    for s in SCHEDULES:
        per_m = [_kind_costs(costs[(s, m)], "cpu_s") for m in args.microbatches]
        ratios[s] = {k: statistics.median(c[k] / c["F"] for c in per_m) for k in per_m[0]}
    return {"calls": args.cost_calls, "f_b_w_cpu_ratio": ratios,
            "per_schedule": {s: {f"m={m}": costs[(s, m)] for m in args.microbatches}
                             for s in SCHEDULES}}


def _predicted(s: str, p: int, rows: list) -> dict:
    """The step times against the schedule's timeline with its measured pass costs (CPU
    seconds, each kind's median over m) instead of unit passes: T = α + β·makespan (β = 1
    when each device runs its passes as fast as alone), useful work β·m·(F + B + W), and the
    bubble that timeline gives. Where the textbook fit misses, this says whether the passes'
    costs explain it."""
    costs = {k: statistics.median(r["pass_cpu_s"][k] for r in rows) for k in rows[0]["pass_cpu_s"]}
    shadow = []
    for r in rows:
        m = r["microbatches"]
        span = textbook_units(s, p, m, costs) * sum(costs.values())
        shadow.append({"microbatches": m, "step_seconds": r["step_seconds"],
                       "predicted_makespan_s": span,
                       "useful_iterations": m * sum(costs.values()),
                       "bubble_fraction_theory": 1 - m * sum(costs.values()) / span})
    spans = {r["microbatches"]: r["predicted_makespan_s"] for r in shadow}
    alpha, beta = fit_bubble(shadow, p, lambda m: spans[m])
    return {"pass_cpu_s": costs, "fit_alpha_s": alpha, "fit_beta": beta,
            "max_fit_rel_residual": max(abs(r["fit_rel_residual"]) for r in shadow),
            "max_bubble_abs_error": max(r["bubble_abs_error"] for r in shadow),
            "rows": [{k: r[k] for k in ("microbatches", "predicted_makespan_s",
                                        "bubble_fraction_theory", "bubble_fraction_measured",
                                        "fit_rel_residual")} for r in shadow]}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="dense")
    parser.add_argument("--microbatches", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=2,
                        help="timed steps per round at m ≥ 8 (8·steps/m below)")
    parser.add_argument("--microbatch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--cost-calls", type=int, default=3,
                        help="steps of each program whose passes are timed alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)  # m < p warns by design
    p, b = 2, args.microbatch_size
    rng = np.random.default_rng(0)
    fits, rows = {}, {s: [] for s in SCHEDULES}
    for m in args.microbatches:
        data = [{"x": rng.normal(size=(m * b, args.width)).astype(np.float32),
                 "y": rng.normal(size=(m * b, args.width)).astype(np.float32)}]
        for s in SCHEDULES:
            fit = jl.Fit(strategy=strategies.GPipe(p, m, schedule=s, mpmd=True), max_steps=1,
                         enable_progress_bar=False, enable_model_summary=False, logger=False,
                         enable_checkpointing=False)
            fit.fit(MODELS[args.model](p, args.width, args.depth), data)
            fits[(s, m)] = (fit, fit.strategy.put_batch(data[0],
                                                        fit.session.train_batch_shardings))
            rows[s].append({"microbatches": m, "bubble_fraction_theory": bubble(s, p, m),
                            "textbook_units": textbook_units(s, p, m)})
    # Every program's passes timed alone first (`--cost-calls` steps each), then the steps.
    costs = {key: pass_costs(*fit, args.cost_calls) for key, fit in fits.items()}
    # Short steps (small m) timed more often: the same time per configuration and round.
    steps = {m: max(args.steps, -(-args.steps * 8 // m)) for m in args.microbatches}
    times = time_round_robin(fits, args.rounds, lambda key: steps[key[1]], whole=True)
    report = {"jax": jax.__version__, "cpus": os.cpu_count(), "model": args.model,
              "stages": p, "microbatch_size": b, "width": args.width, "depth": args.depth,
              "rounds": args.rounds, "steps_per_round": {f"m={m}": n for m, n in steps.items()},
              "gpipe_precision_pipeline_stages_p4": gpipe_precision(),
              "pass_costs": _cost_summary(costs, args), "schedules": {}}
    for s in SCHEDULES:
        for r in rows[s]:
            r.update(times[(s, r["microbatches"])])
            r["pass_cpu_s"] = _kind_costs(costs[(s, r["microbatches"])], "cpu_s")
        units = {r["microbatches"]: r["textbook_units"] for r in rows[s]}
        report["schedules"][s] = {**bubble_summary(rows[s], p, lambda m, u=units: u[m]),
                                  "predicted_from_pass_costs": _predicted(s, p, rows[s]),
                                  "rows": rows[s]}
    gpipe = report["schedules"]["gpipe"]["max_bubble_abs_error"]
    for s in SCHEDULES:
        run = report["schedules"][s]
        run["within_gpipe_precision_same_run"] = run["max_bubble_abs_error"] <= max(
            gpipe, report["gpipe_precision_pipeline_stages_p4"] or 0.0)
    write_result("pipeline_bubble", report, args.out)
    return report


if __name__ == "__main__":
    main()
