"""Each pipeline schedule's bubble measured from step times: GPipe, 1F1B and ZB-H1 side by side.

`GPipe(2, m, schedule=s, mpmd=True)` (a program per device) on this host's two cores, two
stages of equal cost (`pipeline_mpmd.EqualStages`: elementwise layers, each simulated device
single-threaded under that benchmark's XLA flags so that the two devices compute at once), a
fixed microbatch size, m microbatches. The three schedules' steps are timed round robin
(`pipeline_stages.time_round_robin`: one step in flight, each step waited for whole), so load
on the shared machine reaches every schedule and m alike.

Per schedule, the step time is fitted by least squares to T(m) = α + γ·n(m), n(m) the schedule's
textbook length in units of one microbatch's whole pass through a stage
(`_mpmd_schedule.makespan(s, p, m) / passes`: m + p − 1 for GPipe and 1F1B, whose passes are F
and B; (3m + p − 1 + max(0, p − m)) / 3 for ZB-H1, whose backward pass is split into B and W),
and the measured bubble of each m is the share of the step beyond its useful work m·γ,
(T − α − m·γ) / (T − α), against the textbook bubble (`_mpmd_schedule.bubble`). The textbook
assumes passes of equal cost (F = B for GPipe and 1F1B; F = B = W for ZB-H1), which elementwise
stages nearly are; the report gives each fit's residuals, the precision the bubble inherits.
GPipe's own figure in the same run is the precision the others are compared with (beside the
committed SPMD GPipe one, `pipeline_stages` at p = 4).

    python benchmarks/pipeline_bubble.py       # results/pipeline_bubble.json
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from pipeline_mpmd import EqualStages  # noqa: E402  (sets the devices and XLA flags first)

# isort: split

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _common import gpipe_precision, write_result  # noqa: E402
from pipeline_stages import bubble_summary, time_round_robin  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import strategies  # noqa: E402
from jaxlight.strategies._mpmd_schedule import bubble, makespan  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
#: Passes per microbatch and stage in each schedule's textbook unit (F, B; F, B, W).
PASSES = {"gpipe": 2, "1f1b": 2, "zb-h1": 3}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per round")
    parser.add_argument("--microbatch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=64)
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
            fit.fit(EqualStages(p, args.width, args.depth), data)
            fits[(s, m)] = (fit, fit.strategy.put_batch(data[0],
                                                        fit.session.train_batch_shardings))
            rows[s].append({"microbatches": m, "bubble_fraction_theory": bubble(s, p, m),
                            "textbook_units": makespan(s, p, m) / PASSES[s]})
    times = time_round_robin(fits, args.rounds, args.steps, whole=True)
    report = {"jax": jax.__version__, "cpus": os.cpu_count(), "stages": p,
              "microbatch_size": b, "width": args.width, "depth": args.depth,
              "rounds": args.rounds, "steps_per_round": args.steps,
              "gpipe_precision_pipeline_stages_p4": gpipe_precision(), "schedules": {}}
    for s in SCHEDULES:
        for r in rows[s]:
            r.update(times[(s, r["microbatches"])])
        units = {r["microbatches"]: r["textbook_units"] for r in rows[s]}
        report["schedules"][s] = {**bubble_summary(rows[s], p, lambda m, u=units: u[m]),
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
