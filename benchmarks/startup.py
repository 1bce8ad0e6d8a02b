"""Start-up time: process start to the end of the first training step of `jaxlight fit digits`.

Each measurement is its own process (the command-line entry point, in a fresh interpreter):

- `off`: the persistent compilation cache turned off (`--compilation-cache off`), as before it
  existed;
- `cold`: the cache on, in a fresh empty directory (the first run on a machine);
- `warm`: a second process on the directory the cold run filled (every later run).

The three run in turn for `--rounds` rounds and the medians are reported, so that a drift of
the shared machine hits all three alike. "First step" is the end of step 1 on the device: a
callback blocks on its metrics once. The report splits it into the interpreter plus
`import jaxlight`, the init and train compiles (`Fit.compile_times`; init includes running the
initializer) and the rest (data, set-up).

    python benchmarks/startup.py [--rounds 5] [--max-steps 2]

`--imports` measures instead what comes before any of that, for jaxlight at `--base-commit`
(extracted with `git archive`, as benchmarks/cli_startup.py does) and this checkout, old and new
alternating within each round, each measurement a fresh process (medians over `--rounds`,
new / old ratios, and the CPU seconds of each process beside its wall time):

- `help_s`: `jaxlight --help` through the console script's entry point (`jaxlight._cli:main`),
  process start to exit;
- `import_bare_s`: `import jaxlight`, timed inside the process;
- `import_fit_s`: what a plain fit needs: `import jaxlight; jaxlight.Fit; jaxlight.TrainModule;
  jaxlight.callbacks`, timed inside the process (the callbacks a fit builds by default,
  `ModelSummary`, `TQDMProgressBar` and `CSVLogger`, included);
- `jax_flax_optax_s`: `import jax, flax.nnx, optax` alone: the floor under the last one.

    python benchmarks/startup.py --imports [--rounds 5] [--base-commit 46aaf76]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
T0_ENV = "JAXLIGHT_STARTUP_T0"


def child(cli_args: list[str]) -> None:
    """Runs `jaxlight <cli_args>` in this process and prints the timings as one JSON line."""
    t0 = float(os.environ[T0_ENV])
    import jaxlight as jl
    from jaxlight import _cli
    from jaxlight.callbacks import LambdaCallback

    marks = {"import_s": time.time() - t0}
    fits = []

    def first_step(fit, module, outputs, batch, batch_idx):
        if "first_step_s" not in marks:
            import jax

            jax.block_until_ready(outputs.metrics)
            marks["first_step_s"] = time.time() - t0
            # CPU seconds of this process (every thread) to here: less sensitive than wall time
            # to other work on a shared machine (the interpreter's start is not in it).
            marks["first_step_cpu_s"] = time.process_time()
            marks["compile_times"] = dict(fit.compile_times)

    # Wrap the class's own __init__: every module that imported Fit builds this class.
    init = jl.Fit.__init__

    @functools.wraps(init)
    def timed_init(self, *args, callbacks=(), **kwargs):
        init(self, *args, callbacks=[*callbacks, LambdaCallback(
            on_train_batch_end=first_step)], **kwargs)
        fits.append(self)

    jl.Fit.__init__ = timed_init
    status = _cli.main(cli_args)
    marks["exit_s"] = time.time() - t0
    marks["status"] = status
    marks["cache_dir"] = fits[0].compilation_cache_dir if fits else None
    print("STARTUP " + json.dumps(marks), flush=True)


def measure(cache: str, workdir: str, max_steps: int) -> dict:
    args = ["fit", "digits", "--max-steps", str(max_steps), "--compilation-cache", cache]
    env = {**os.environ, "PYTHONPATH": ROOT, T0_ENV: repr(time.time())}
    env.pop("XLA_FLAGS", None)  # the one CPU device `jaxlight fit digits` sees here
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *args],
                         cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("STARTUP ")]
    if out.returncode or not lines:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    r = json.loads(lines[-1][len("STARTUP "):])
    ct = r.pop("compile_times")
    r["init_compile_s"] = ct.get("init", 0.0)
    r["train_compile_s"] = ct.get("train", 0.0)
    r["other_s"] = (r["first_step_s"] - r["import_s"] - r["init_compile_s"]
                    - r["train_compile_s"])
    return r


#: --imports: what each measurement runs (`python -c CODE ARGS`); the timed ones print seconds.
IMPORTS = {
    "help_s": ("import sys; from jaxlight._cli import main; sys.exit(main())", ["--help"]),
    "import_bare_s": ("import time; t = time.perf_counter(); import jaxlight; "
                      "print(time.perf_counter() - t)", []),
    "import_fit_s": ("import time; t = time.perf_counter(); import jaxlight; jaxlight.Fit; "
                     "jaxlight.TrainModule; cbs = jaxlight.callbacks; cbs.ModelSummary; "
                     "cbs.TQDMProgressBar; cbs.CSVLogger; print(time.perf_counter() - t)", []),
    "jax_flax_optax_s": ("import time; t = time.perf_counter(); import jax, flax.nnx, optax; "
                         "print(time.perf_counter() - t)", []),
}
#: --imports: whether `import jaxlight` alone loaded JAX (a fresh process per side).
LOADS_JAX = "import sys, jaxlight; print(int('jax' in sys.modules))"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def import_time(root: str, key: str) -> tuple[float, float]:
    """(seconds, CPU seconds of the process) of one `IMPORTS` measurement on jaxlight at `root`:
    the wall time of the whole process for `help_s`, else the time the code printed."""
    code, args = IMPORTS[key]
    env = {**os.environ, "PYTHONPATH": root}
    env.pop("XLA_FLAGS", None)
    cpu0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=tempfile.gettempdir(),
                         capture_output=True, text=True, timeout=300)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if out.returncode:
        raise RuntimeError(f"{key} failed ({out.returncode}): {out.stderr[-2000:]}")
    return (wall if key == "help_s" else float(out.stdout.split()[-1])), cpu


def imports_main(args) -> None:
    """`--imports`: help and import times, jaxlight at `args.base_commit` against this checkout."""
    from cli_startup import extract  # the benchmarks folder is this script's; only --imports

    keys = [k for name in IMPORTS for k in (name, name.removesuffix("_s") + "_cpu_s")]
    runs = {side: {k: [] for k in keys} for side in ("old", "new")}
    load = {side: [] for side in ("old", "new")}
    loads_jax = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "old"))
        roots = {"old": extract(args.base_commit, os.path.join(tmp, "old")), "new": ROOT}
        for side, root in roots.items():
            out = subprocess.run([sys.executable, "-c", LOADS_JAX], capture_output=True,
                                 text=True, env={**os.environ, "PYTHONPATH": root}, check=True,
                                 cwd=tempfile.gettempdir())
            loads_jax[side] = bool(int(out.stdout.split()[-1]))
        for i in range(args.rounds):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for key in IMPORTS:
                for side in order:
                    load[side].append(os.getloadavg()[0])
                    seconds, cpu = import_time(roots[side], key)
                    runs[side][key].append(seconds)
                    runs[side][key.removesuffix("_s") + "_cpu_s"].append(cpu)
            print(f"round {i}: " + "; ".join(
                f"{side} " + ", ".join(f"{k} {runs[side][k][-1]:.2f}" for k in IMPORTS)
                for side in ("old", "new")) + f" (load {os.getloadavg()[0]:.2f})",
                file=sys.stderr, flush=True)
    medians = {side: {k: round(statistics.median(v), 3) for k, v in r.items()}
               for side, r in runs.items()}
    report = {
        "what": "jaxlight --help, import jaxlight, and a plain fit's imports: jaxlight at "
                f"{args.base_commit} (old) vs this checkout (new, lazy public names), "
                "alternating, a fresh process each",
        "commands": {k: f"python -c {code!r} {' '.join(a)}".rstrip()
                     for k, (code, a) in IMPORTS.items()},
        "rounds": args.rounds,
        "cpu_cores": os.cpu_count(),
        # the 1-minute load average as each measurement started: the wall times scale with it
        # on a machine shared with other work
        "loadavg_median": {side: round(statistics.median(v), 2) for side, v in load.items()},
        "import_jaxlight_loads_jax": loads_jax,
        "median": medians,
        "new_over_old": {k: round(medians["new"][k] / medians["old"][k], 3)
                         for k in medians["new"]},
        "targets_s": {"help_s": 0.5, "import_fit_s": 1.1},
        "runs": runs,
        "loadavg": load,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k not in ("runs", "loadavg")},
                     indent=2))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=2)
    p.add_argument("--imports", action="store_true",
                   help="help and import times, old (--base-commit) vs new")
    p.add_argument("--base-commit", default="46aaf76", help="--imports: the old jaxlight")
    p.add_argument("--out", default=None, help="default: benchmarks/results/startup.json, "
                   "startup_imports.json with --imports")
    args = p.parse_args(argv)
    if args.imports:
        args.out = args.out or os.path.join(HERE, "results", "startup_imports.json")
        imports_main(args)
        return
    args.out = args.out or os.path.join(HERE, "results", "startup.json")
    runs: dict[str, list[dict]] = {"off": [], "cold": [], "warm": []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            cache = os.path.join(tmp, f"cache{i}")
            runs["off"].append(measure("off", tmp, args.max_steps))
            runs["cold"].append(measure(cache, tmp, args.max_steps))
            runs["warm"].append(measure(cache, tmp, args.max_steps))
            entries = len([n for n in os.listdir(cache) if not n.startswith(".")])
            print(f"round {i}: " + ", ".join(
                f"{k} {v[-1]['first_step_s']:.2f} s" for k, v in runs.items())
                + f" ({entries} cache files)", file=sys.stderr, flush=True)
    keys = ("first_step_s", "first_step_cpu_s", "import_s", "init_compile_s", "train_compile_s",
            "other_s", "exit_s")
    medians = {mode: {k: round(statistics.median(r[k] for r in rs), 3) for k in keys}
               for mode, rs in runs.items()}
    report = {
        "command": f"jaxlight fit digits --max-steps {args.max_steps} --compilation-cache ...",
        "devices": "1 CPU device (this machine, XLA_FLAGS unset)",
        "rounds": args.rounds,
        "cpu_cores": os.cpu_count(),
        # 1/5/15-minute load averages before and after: the wall times scale with them on a
        # machine shared with other work
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "median": medians,
        "warm_first_step_s": medians["warm"]["first_step_s"],
        "warm_target_s": 2.0,
        "warm_met": medians["warm"]["first_step_s"] < 2.0,
        "cold_over_off": round(medians["cold"]["first_step_s"]
                               / medians["off"]["first_step_s"], 3),
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        main()
