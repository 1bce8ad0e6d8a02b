"""Run a Python script as N real processes of one jax.distributed job on 127.0.0.1.

Reusable by any test that needs several processes (loggers, checkpoints, ...):

    from tests.distributed._launch_util import run_processes

    results = run_processes("tests/distributed/_train_script.py", ["dp", out_dir], nprocs=2,
                            devices_per_proc=4, timeout=120)
    assert all(r.returncode == 0 for r in results), results[0].output

Each process gets the variables `jaxlight launch` sets (`MASTER_ADDR=127.0.0.1`, a free
`MASTER_PORT`, `RANK`, `WORLD_SIZE`, ...), K simulated CPU devices (gloo collectives) and the
repository on `PYTHONPATH`, so `import tests.models` works in the script. A run that exceeds
`timeout` is killed whole and reported with every process's output, so a hang cannot stall CI.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence

from jaxlight.distributed._launch import child_env, free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class ProcessResult:
    """What one process did: its rank, exit status (negative: killed by that signal), output."""

    rank: int
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def output(self) -> str:
        return f"--- rank {self.rank} (status {self.returncode}) ---\n{self.stdout}{self.stderr}"


def _command(script: str, args: Sequence[str]) -> list[str]:
    if os.path.exists(script):
        return [sys.executable, script, *map(str, args)]
    return [sys.executable, "-c", script, *map(str, args)]


def run_processes(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nprocs: int = 2,
    devices_per_proc: int = 4,
    timeout: float = 120.0,
    dist_timeout: float | None = 30.0,
    ranks: Sequence[int] | None = None,
    world_size: int | None = None,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
    cwd: str | os.PathLike | None = None,
    kill_rank_after: tuple[int, float] | None = None,
) -> list[ProcessResult]:
    """Runs `script` (a path, or Python source) in `nprocs` processes; returns them by rank.

    Args:
        script: a .py file or Python source code; `args` follow it on the command line.
        nprocs: processes to start (ranks 0 ... nprocs - 1 unless `ranks` says otherwise).
        devices_per_proc: simulated CPU devices per process.
        timeout: wall-clock limit for the whole run; past it every process is killed and
            `TimeoutError` carries their output.
        dist_timeout: `JAXLIGHT_TIMEOUT` (seconds to connect and agree) for the processes.
        ranks, world_size: start only these ranks of a job of `world_size` processes (to test
            processes that never arrive).
        port: the coordinator port (default: a free one).
        env, rank_env: extra variables for every process / for one rank.
        cwd: working directory of the processes (default: a fresh temporary directory).
        kill_rank_after: (rank, seconds): SIGKILL that rank this long after the start.
    """
    script = os.fspath(script)
    ranks = list(range(nprocs)) if ranks is None else list(ranks)
    world = len(ranks) if world_size is None else world_size
    port = free_port() if port is None else port
    made_cwd = cwd is None
    cwd = os.fspath(cwd) if cwd is not None else tempfile.mkdtemp(prefix="jaxlight-dist-")
    with contextlib.ExitStack() as stack:
        if made_cwd:  # registered first, so it runs last: after every process is gone
            stack.callback(shutil.rmtree, cwd, ignore_errors=True)
        procs, files, started = [], [], time.monotonic()
        stack.callback(_kill_all, procs)  # also on KeyboardInterrupt: never leak processes
        for rank in ranks:
            e = child_env(rank, world, port, devices_per_proc=devices_per_proc,
                          timeout=dist_timeout)
            e["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, e.get("PYTHONPATH")) if p)
            e.setdefault("WANDB_MODE", "offline")
            e.update(env or {})
            e.update((rank_env or {}).get(rank, {}))
            out = stack.enter_context(tempfile.TemporaryFile())
            err = stack.enter_context(tempfile.TemporaryFile())
            files.append((out, err))
            procs.append(subprocess.Popen(_command(script, args), env=e, cwd=cwd, stdout=out,
                                          stderr=err, start_new_session=True))
        ended, timed_out = _wait(procs, ranks, started, timeout, kill_rank_after)
        results = []
        for i, (rank, p, (out, err)) in enumerate(zip(ranks, procs, files, strict=True)):
            out.seek(0)
            err.seek(0)
            results.append(ProcessResult(rank, p.wait(), out.read().decode(errors="replace"),
                                         err.read().decode(errors="replace"),
                                         ended.get(i, time.monotonic() - started)))
    if timed_out:
        raise TimeoutError(f"processes still running after {timeout:g} s (killed):\n"
                           + "\n".join(r.output for r in results))
    return results


def _kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _wait(procs, ranks, started, timeout, kill_rank_after) -> tuple[dict[int, float], bool]:
    """Polls until every process ended (or kills them all at `timeout`); seconds per process."""
    ended: dict[int, float] = {}
    killed = False
    while len(ended) < len(procs):
        now = time.monotonic() - started
        for i, p in enumerate(procs):
            if i not in ended and p.poll() is not None:
                ended[i] = now
        if kill_rank_after and not killed and now >= kill_rank_after[1]:
            victim = procs[ranks.index(kill_rank_after[0])]
            if victim.poll() is None:
                os.killpg(victim.pid, signal.SIGKILL)
            killed = True
        if now > timeout:
            _kill_all(procs)
            return ended, True
        time.sleep(0.05)
    return ended, False


def run_launcher(argv: Sequence[str], *, timeout: float = 120.0, cwd=None,
                 env: Mapping[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """Runs `jaxlight launch ARGV` (the console script's code path); returns it and its seconds."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, e.get("PYTHONPATH")) if p)
    e.update(env or {})
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "jaxlight._cli", "launch", *argv], env=e,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started
