"""Start-up of the command line before and after it moved onto jsonargparse (LightningCLI's form).

Measures, each in a fresh process, for the old CLI (jaxlight at `--base-commit`, the last commit
with the hand-written parser, extracted with `git archive`) and the new one (this checkout):

- `help_s`: wall time of `jaxlight --help` (python -m jaxlight._cli --help);
- `recipe_first_step_s`: process start to the end of the first training step of
  `jaxlight fit digits --max-steps 2` (the README's command, the same path in both);
- `target_first_step_s`: the same for the user's own module (the docs' `mymodel.py`): the old
  CLI's dashed form (`--max-steps 2`), and on the new CLI LightningCLI's form
  (`--trainer.max_steps 2 --seed_everything 0`, parsed by jsonargparse).

Old and new alternate within each round, so a drift of the shared machine hits both alike;
medians over `--rounds` are reported with new / old ratios (target: ≤ 1.05), of wall time and
of CPU seconds (`*_cpu_s`: user + system of the process, less sensitive than wall time to other
work on a shared machine; the first step's excludes the interpreter's start). The persistent
compilation cache is off in every run (JAXLIGHT_COMPILATION_CACHE=off), one CPU device.

    python benchmarks/cli_startup.py [--rounds 3] [--base-commit 3d0f632]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STARTUP = os.path.join(HERE, "startup.py")  # its --child mode times the first step

MYMODEL = '''
import optax
from flax import nnx

import jaxlight as jl
from jaxlight.recipes.digits import DataConfig, load_digits


class Classifier(jl.TrainModule):
    def __init__(self, hidden: int = 128, lr: float = 3e-3):
        super().__init__()
        self.hidden, self.lr = hidden, lr

    def configure_model(self, rngs):
        return nnx.Sequential(nnx.Linear(64, self.hidden, rngs=rngs), nnx.relu,
                              nnx.Linear(self.hidden, 10, rngs=rngs))

    def configure_optimizers(self):
        return optax.adam(self.lr)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


class Digits(jl.DataModule):
    def __init__(self, batch_size: int = 64):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage):
        self.splits = load_digits(DataConfig())

    def train_dataloader(self):
        return jl.data.ArrayLoader(self.splits["train"], self.batch_size, shuffle=True)
'''

COMMON = ["--enable-progress-bar", "false", "--logger", "none"]
COMMANDS = {
    "recipe_first_step_s": {"old": ["fit", "digits", "--max-steps", "2", *COMMON],
                            "new": ["fit", "digits", "--max-steps", "2", *COMMON]},
    "target_first_step_s": {
        "old": ["fit", "mymodel.py:Classifier", "--data", "mymodel.py:Digits", "--max-steps",
                "2", "--seed", "0", *COMMON],
        "new": ["fit", "mymodel.py:Classifier", "--data", "mymodel.py:Digits",
                "--trainer.max_steps", "2", "--seed_everything", "0",
                "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"]},
}


def _env(root: str, extra: dict | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": root, "JAXLIGHT_COMPILATION_CACHE": "off",
           "WANDB_MODE": "offline", **(extra or {})}
    env.pop("XLA_FLAGS", None)
    return env


def cpu_key(key: str) -> str:
    """`help_s` -> `help_cpu_s`: the CPU seconds beside a wall time."""
    return key.removesuffix("_s") + "_cpu_s"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def help_time(root: str, workdir: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `jaxlight --help`."""
    cpu0, t0 = _children_cpu(), time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "jaxlight._cli", "--help"], cwd=workdir,
                         env=_env(root), capture_output=True, text=True, timeout=300)
    dt, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if out.returncode:
        raise RuntimeError(f"--help failed ({out.returncode}): {out.stderr[-2000:]}")
    return dt, cpu


def first_step(root: str, workdir: str, args: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process) from process start to the first step's end."""
    env = _env(root, {"JAXLIGHT_STARTUP_T0": repr(time.time())})
    out = subprocess.run([sys.executable, STARTUP, "--child", *args], cwd=workdir, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [x for x in out.stdout.splitlines() if x.startswith("STARTUP ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{args} failed ({out.returncode}): {out.stderr[-2000:]}")
    marks = json.loads(lines[-1][len("STARTUP "):])
    if marks.get("status") not in (0, None):
        raise RuntimeError(f"{args} exited {marks.get('status')}: {out.stderr[-2000:]}")
    return marks["first_step_s"], marks["first_step_cpu_s"]


def extract(commit: str, dest: str) -> str:
    """jaxlight at `commit`, extracted into `dest` (the package only)."""
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "jaxlight"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--base-commit", default="3d0f632")
    p.add_argument("--out", default=os.path.join(HERE, "results", "cli_startup.json"))
    args = p.parse_args(argv)
    roots = {}
    keys = [k for name in ("help_s", *COMMANDS) for k in (name, cpu_key(name))]
    runs: dict[str, dict[str, list[float]]] = {
        side: {k: [] for k in keys} for side in ("old", "new")}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "old"))
        roots["old"] = extract(args.base_commit, os.path.join(tmp, "old"))
        roots["new"] = ROOT
        work = os.path.join(tmp, "work")
        os.makedirs(work)
        with open(os.path.join(work, "mymodel.py"), "w") as f:
            f.write(MYMODEL)
        for i in range(args.rounds):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            for side in order:
                wall, cpu = help_time(roots[side], work)
                runs[side]["help_s"].append(wall)
                runs[side]["help_cpu_s"].append(cpu)
            for key, commands in COMMANDS.items():
                for side in order:
                    wall, cpu = first_step(roots[side], work, commands[side])
                    runs[side][key].append(wall)
                    runs[side][cpu_key(key)].append(cpu)
            print(f"round {i}: " + "; ".join(
                f"{side} " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in runs[side].items())
                for side in ("old", "new")), file=sys.stderr, flush=True)
        shutil.rmtree(os.path.join(tmp, "old"), ignore_errors=True)
    medians = {side: {k: round(statistics.median(v), 3) for k, v in r.items()}
               for side, r in runs.items()}
    ratios = {k: round(medians["new"][k] / medians["old"][k], 3) for k in medians["new"]}
    report = {
        "what": "jaxlight --help and process start to the first training step, old CLI "
                f"({args.base_commit}) vs new (jsonargparse), alternating",
        "commands": COMMANDS,
        "devices": "1 CPU device (XLA_FLAGS unset), compilation cache off",
        "rounds": args.rounds,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "median": medians,
        "new_over_old": ratios,
        "target": 1.05,
        "met_wall": all(r <= 1.05 for k, r in ratios.items() if "_cpu_" not in k),
        "met_cpu": all(r <= 1.05 for k, r in ratios.items() if "_cpu_" in k),
        "runs": runs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
