"""Multi-process costs on one machine: connecting, agreeing, training steps, noticing a dead peer.

Runs real processes on 127.0.0.1 (gloo, simulated CPU devices), the way `jaxlight launch` does:

- `import_and_connect_s`: `import jaxlight` and `jaxlight.distributed.initialize()` (connect and
  version check) in each process, the slower of the two;
- `all_gather_json_ms`, `agree_stop_ms`: median host-side agreement through the coordinator's
  key-value store (what Fit pays per log interval for stop agreement);
- `step_ms`: median DataParallel step time of an MLP, 2 processes x 4 devices against 1 process x
  8 devices, with stop agreement every step (`log_every_n_steps=1`) and every 50 steps;
- `bare_allreduce_ms`: a plain jitted sum of hidden^2 floats over all devices (no jaxlight): the
  cost of one cross-process collective, the floor under the step time;
- `launcher_stop_s`: from a process's SIGKILL to `jaxlight launch` exiting (grace 1 s);
- `heartbeat_stop_s`: without a launcher, from the SIGKILL to the survivor's exit (timeout 5 s).

    python benchmarks/distributed.py                 # everything; writes results/distributed.json
    python benchmarks/distributed.py --steps 200 --hidden 512

Prints JSON. Timings on a shared 2-core machine are noisy; compare figures from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)


def _module(hidden: int):
    import optax
    from flax import nnx

    import jaxlight as jl

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(64, hidden, rngs=rngs)
            self.l2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.l3 = nnx.Linear(hidden, 10, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    class Module(jl.TrainModule):
        def configure_model(self, rngs):
            return MLP(rngs)

        def configure_optimizers(self):
            return optax.adam(1e-3)

        def training_step(self, model, batch):
            logits = model(batch["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return Module()


def _train_step_ms(args, log_every: int) -> float:
    import numpy as np

    import jaxlight as jl

    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    data = {"x": rng.normal(size=(n, 64)).astype(np.float32),
            "y": rng.integers(0, 10, size=n).astype(np.int32)}
    stamps: list[float] = []
    cb = jl.callbacks.LambdaCallback(
        on_train_batch_end=lambda fit, module, out, batch, idx: stamps.append(time.perf_counter()))
    fit = jl.Fit("dp", max_steps=args.steps, log_every_n_steps=log_every, callbacks=[cb],
                 enable_progress_bar=False, enable_model_summary=False, logger=False)
    fit.fit(_module(args.hidden), jl.data.ArrayLoader(data, args.batch, shuffle=False))
    gaps = np.diff(stamps[args.steps // 5:]) * 1e3  # steady state: first fifth dropped
    return float(np.median(gaps))


def _allreduce_ms(n: int) -> float:
    """A bare jitted sum over every device of n floats per device: the collective floor."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("d")),
        np.ones((jax.local_device_count(), n), np.float32))
    f = jax.jit(lambda x: x.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec()))
    f(x).block_until_ready()
    times = []
    for _ in range(30):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append((time.perf_counter() - t) * 1e3)
    return float(np.median(times))


def worker(args) -> None:
    """One process of the job (or the single 8-device process): measures and prints JSON."""
    started = time.perf_counter()
    import jaxlight as jl

    config = jl.distributed.initialize()
    connect = time.perf_counter() - started
    out = {"process": config.process_id, "processes": config.num_processes}
    if config.num_processes > 1:
        out["import_and_connect_s"] = connect
        for name, fn in (("all_gather_json_ms", lambda: jl.distributed.all_gather_json("b", 1)),
                         ("agree_stop_ms", lambda: jl.distributed.agree_stop(None))):
            times = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
            out[name] = statistics.median(times)
    out["bare_allreduce_ms"] = _allreduce_ms(args.hidden * args.hidden)
    out["step_ms_log_every_1"] = _train_step_ms(args, 1)
    out["step_ms_log_every_50"] = _train_step_ms(args, 50)
    print("RESULT " + json.dumps(out), flush=True)


def _results(text: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in text.splitlines()
            if line.startswith("RESULT ")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=50, help="agreement calls timed")
    parser.add_argument("--out", default=None, help="JSON path (default results/distributed.json)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from _common import write_result

    from tests.distributed._launch_util import run_launcher, run_processes

    me = [os.path.abspath(__file__), "--worker", "--steps", str(args.steps), "--batch",
          str(args.batch), "--hidden", str(args.hidden), "--rounds", str(args.rounds)]
    report: dict = {"config": vars(args) | {"machine_cores": os.cpu_count()}}

    multi = run_processes(me[0], me[1:], nprocs=2, devices_per_proc=4, timeout=600)
    assert all(r.returncode == 0 for r in multi), "\n".join(r.output[-3000:] for r in multi)
    per_rank = [_results(r.stdout)[0] for r in multi]
    report["two_processes_x4"] = {k: max(p[k] for p in per_rank) for k in per_rank[0]
                                  if k not in ("process", "processes")}

    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "WORLD_SIZE")}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO)
    single = subprocess.run([sys.executable, *me], env=env, capture_output=True, text=True,
                            timeout=600, check=True)
    report["one_process_x8"] = {k: v for k, v in _results(single.stdout)[0].items()
                                if k not in ("process", "processes")}

    scenarios = os.path.join(REPO, "tests", "distributed", "_scenarios.py")
    with tempfile.TemporaryDirectory() as tmp:
        done, _ = run_launcher(["--nprocs", "2", "--devices-per-proc", "1", "--timeout", "10",
                                "--grace", "1", "--", "python", scenarios, tmp, "die"],
                               timeout=120)
        ended = time.time()
        died = float(re.search(r"dies at ([0-9.]+)", done.stdout).group(1))
        report["launcher_stop_s"] = round(ended - died, 2)
        report["launcher_exit_status"] = done.returncode
        r0, r1 = run_processes(scenarios, [tmp, "die"], devices_per_proc=1, dist_timeout=5,
                               timeout=120)
        report["heartbeat_timeout_s"] = 5
        report["heartbeat_stop_s"] = round(r0.seconds - r1.seconds, 2)
        report["heartbeat_survivor_status"] = r0.returncode
    write_result("distributed", report, args.out)


if __name__ == "__main__":
    main()
