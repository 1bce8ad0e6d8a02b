"""`jaxlight launch`: start N local processes of one command as a multi-process JAX job.

    jaxlight launch --nprocs 2 --devices-per-proc 4 -- python train.py --max-steps 100
    jaxlight launch --nprocs 2 -- jaxlight fit digits    # `python`, `x.py`, `jaxlight`: this
                                                         # Python and its jaxlight
    jaxlight launch --nnodes 2 --node-rank 0 --coordinator 10.0.0.1 --port 29500 --nprocs 8 \\
        -- python train.py                               # the same on the second node, rank 1

Each process gets torchrun's variables (`MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`,
`LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`), which `jaxlight.distributed.initialize()` (called
by `Fit`) turns into `jax.distributed.initialize(...)`. With `--devices-per-proc K` each process
runs on K simulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=K`,
`JAX_PLATFORMS=cpu`) and the processes talk through gloo: a multi-host job on one machine.

Output lines are prefixed with the rank (`[rank1] ...`). When a process fails the others are
stopped (SIGTERM, then SIGKILL after `--grace` seconds) and the launcher exits with the failed
process's status (128 + signal for a signal). SIGINT or SIGTERM to the launcher is passed on to
every process (a preemption notice: they may checkpoint); a second one kills them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from jaxlight._errors import ConfigurationError
from jaxlight.distributed import check_port_free

__all__ = ["child_env", "free_port", "main"]

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_USAGE = ("jaxlight launch --nprocs N [--devices-per-proc K] [--port P] [--timeout S] "
          "[--nnodes M --node-rank R --coordinator HOST] -- COMMAND [ARGS...]")


def free_port() -> int:
    """A TCP port that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def child_env(
    rank: int,
    nprocs: int,
    port: int,
    *,
    coordinator: str = "127.0.0.1",
    devices_per_proc: int | None = None,
    timeout: float | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of local process `rank` (0 ... nprocs - 1) on node `node_rank`.

    Example:
        >>> env = child_env(1, 2, 29500, devices_per_proc=4, base={})
        >>> env["RANK"], env["WORLD_SIZE"], env["XLA_FLAGS"]
        ('1', '2', '--xla_force_host_platform_device_count=4')
    """
    env = dict(os.environ if base is None else base)
    env.update({
        "MASTER_ADDR": coordinator,
        "MASTER_PORT": str(port),
        "RANK": str(node_rank * nprocs + rank),
        "WORLD_SIZE": str(nnodes * nprocs),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "GROUP_RANK": str(node_rank),
        "NNODES": str(nnodes),
        "PYTHONUNBUFFERED": "1",  # lines reach the prefixer as they are printed
    })
    env.pop("JAXLIGHT_DISTRIBUTED", None)
    if timeout is not None:
        env["JAXLIGHT_TIMEOUT"] = f"{timeout:g}"
    if devices_per_proc is not None:
        flags = " ".join(re.sub(rf"{_DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).split())
        env["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={devices_per_proc}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    return env


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigurationError(f"jaxlight launch: {message}. Usage: {_USAGE}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jaxlight launch", usage=_USAGE, allow_abbrev=False,
                description="Start N local processes of COMMAND as one multi-process JAX job.")
    p.add_argument("--nprocs", type=int, default=1, help="processes on this node (default 1)")
    p.add_argument("--devices-per-proc", type=int, default=None, metavar="K",
                   help="simulate K CPU devices per process, with gloo collectives (default: "
                        "the real devices)")
    p.add_argument("--port", type=int, default=None,
                   help="coordinator port (default: a free port; required with --nnodes > 1)")
    p.add_argument("--coordinator", default="127.0.0.1",
                   help="address of node 0, where rank 0's coordinator listens")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds for all processes to connect and to notice a dead one "
                        "(JAXLIGHT_TIMEOUT; default 300)")
    p.add_argument("--grace", type=float, default=3.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping processes (default 3)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command each process runs (after `--`)")
    return p


def _check(args: argparse.Namespace, command: list[str]) -> None:
    def bad(message: str):
        raise ConfigurationError(f"jaxlight launch: {message}. Usage: {_USAGE}")

    if not command:
        bad("no command given; put it after `--`, e.g. `jaxlight launch --nprocs 2 -- python "
            "train.py`")
    if args.nprocs < 1:
        bad(f"--nprocs must be at least 1, got {args.nprocs}")
    if args.devices_per_proc is not None and args.devices_per_proc < 1:
        bad(f"--devices-per-proc must be at least 1, got {args.devices_per_proc}")
    if args.nnodes < 1:
        bad(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        bad(f"--node-rank {args.node_rank} is not in 0 ... {args.nnodes - 1} (--nnodes "
            f"{args.nnodes})")
    if args.nnodes > 1 and args.port is None:
        bad("--port is required with --nnodes > 1 (every node must use the same port)")
    if args.port is not None and not 0 < args.port < 65536:
        bad(f"--port {args.port} is not in 1 ... 65535")
    if args.timeout is not None and args.timeout <= 0:
        bad(f"--timeout must be positive, got {args.timeout}")
    if args.grace < 0:
        bad(f"--grace must be at least 0, got {args.grace}")


def _pump(stream, rank: int, out, lock: threading.Lock) -> None:
    """Copies one child stream to `out`, each line prefixed with the rank.

    A carriage return ends a line too, so that a progress bar redrawing itself with `\r`
    (tqdm) shows up as it goes, in place, rather than as one long line at the end.
    """
    prefix = f"[rank{rank}] ".encode()
    target = getattr(out, "buffer", None)
    pending = b""
    while True:
        chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
        if not chunk:
            break
        pending += chunk
        parts = re.split(rb"(\r\n|\r|\n)", pending)
        pending = parts.pop()  # an unfinished line waits for more
        text = b"".join(prefix + parts[i] + parts[i + 1] for i in range(0, len(parts), 2))
        if text:
            _write(out, target, text, lock)
    if pending:
        _write(out, target, prefix + pending + b"\n", lock)
    stream.close()


def _write(out, target, data: bytes, lock: threading.Lock) -> None:
    with lock:
        if target is not None:
            target.write(data)
            target.flush()
        else:
            out.write(data.decode(errors="replace"))
            out.flush()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _status(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `jaxlight launch`; returns the exit status (the first failed process's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[:argv.index("--")] if "--" in argv else argv
    if any(a in ("-h", "--help") for a in own):
        _parser().print_help()
        return 0
    args = _parser().parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    _check(args, command)
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    elif command[0] in ("python", "python3"):
        # The interpreter that runs the launcher has jaxlight; a bare `python` on PATH may not.
        command = [sys.executable, *command[1:]]
    elif command[0] == "jaxlight":
        command = [sys.executable, "-m", "jaxlight._cli", *command[1:]]
    port = args.port if args.port is not None else free_port()
    if args.node_rank == 0:
        check_port_free(port, f"coordinator port {port} (--port)")

    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for rank in range(args.nprocs):
        env = child_env(rank, args.nprocs, port, coordinator=args.coordinator,
                        devices_per_proc=args.devices_per_proc, timeout=args.timeout,
                        nnodes=args.nnodes, node_rank=args.node_rank)
        try:
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as err:
            for p in procs:
                _signal_group(p, signal.SIGKILL)
            raise ConfigurationError(
                f"jaxlight launch: cannot start {command[0]!r}: {err.strerror}."
            ) from None
        procs.append(proc)
        global_rank = args.node_rank * args.nprocs + rank
        for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, global_rank, out, lock), daemon=True)
            t.start()
            pumps.append(t)

    signals_seen: list[int] = []

    def forward(signum, frame):
        del frame
        signals_seen.append(signum)
        sig = signal.SIGKILL if len(signals_seen) > 1 else signal.SIGTERM
        for p in procs:
            if p.poll() is None:
                _signal_group(p, sig)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, forward)
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed is None:
                failed = bad[0]
                running = [r for r, c in enumerate(codes) if c is None]
                _stop(procs, running, args.grace, lock, failed, args.node_rank * args.nprocs)
                continue
            if all(c is not None for c in codes):
                break
            time.sleep(0.05)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for t in pumps:
            t.join(timeout=5)
    if failed is None:
        return 0
    code = failed[1]
    return 128 - code if code < 0 else code


def _stop(procs, running, grace, lock, failed, offset) -> None:
    rank, code = failed
    others = ", ".join(str(offset + r) for r in running)
    stopping = f"; stopping rank{'s' if len(running) > 1 else ''} {others}" if running else ""
    with lock:
        print(f"jaxlight launch: rank {offset + rank} failed ({_status(code)}){stopping}.",
              file=sys.stderr, flush=True)
    for r in running:
        _signal_group(procs[r], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(procs[r].poll() is None for r in running):
        time.sleep(0.05)
    for r in running:
        if procs[r].poll() is None:
            _signal_group(procs[r], signal.SIGKILL)
    for r in running:
        procs[r].wait()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigurationError as err:
        print(f"jaxlight: error: {err}", file=sys.stderr)
        sys.exit(2)
