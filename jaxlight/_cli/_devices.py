"""Devices on the command line: `--devices N` (simulated CPU devices), joining a multi-process
job, and the `jaxlight devices` command."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence

import jax
import numpy as np

from jaxlight import distributed, strategies
from jaxlight._cli._build import build_strategy
from jaxlight._cli._help import COMMANDS
from jaxlight._cli._options import Parser, normalize_argv, unknown_option_error
from jaxlight._errors import ConfigurationError

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def simulate_cpu_devices(n: int) -> None:
    """Asks XLA for `n` CPU devices; effective only before JAX initializes its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(re.sub(rf"{_DEVICE_FLAG}=\S+", "", flags).split())
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()


def join_job(devices: int | None) -> None:
    """Joins a multi-process run when the environment describes one (the launcher's, SLURM...;
    a no-op alone) and checks the `--devices` count, before anything else starts JAX."""
    distributed.initialize()
    if devices is not None:
        check_device_count(devices)


def parse_command(parser: Parser, argv: Sequence[str]):
    """A small command's options (`jaxlight devices`, `generate`: `--devices` among them,
    `--mesh_shape` as `--mesh-shape`), and the job joined."""
    args, unknown = parser.parse_known_args(normalize_argv(argv))
    if unknown:
        unknown_option_error(parser, unknown)
    join_job(args.devices)
    return args


def check_device_count(n: int) -> None:
    local = jax.local_device_count()
    if local != n:
        platform = jax.devices()[0].platform
        if platform == "cpu":
            hint = ("JAX had already started in this process (XLA_FLAGS is read once); run the "
                    "command in a fresh process")
        else:
            hint = (f"--devices simulates CPU devices only; on {platform} choose devices with "
                    "CUDA_VISIBLE_DEVICES (or drop --devices)")
        raise ConfigurationError(
            f"--devices {n} asked for {n} devices per process but this process has {local} "
            f"{platform} devices: {hint}."
        )


def _print_devices(strategy_name: str, mesh_shape: str | None) -> None:
    devices = jax.devices()
    print(f"jaxlight {sys.modules['jaxlight'].__version__}, jax {jax.__version__}, backend "
          f"{jax.default_backend()}")
    print(f"process {jax.process_index()} of {jax.process_count()}; "
          f"{jax.local_device_count()} local devices, {jax.device_count()} global")
    print("devices:")
    for d in devices:
        print(f"  id {d.id:<3} {d.device_kind:<16} {d.platform:<5} process {d.process_index}"
              f"{'  (local)' if d.process_index == jax.process_index() else ''}")
    strategy = build_strategy(strategy_name, mesh_shape)
    if isinstance(strategy, strategies.Auto):
        print("strategy auto: the layout is chosen from the model and the first batch when fit "
              "starts (see docs/strategies.md); try --strategy dp, fsdp, or a --mesh-shape")
        return
    strategy.setup(None)
    info = strategy.describe()
    print(f"strategy {strategy.name} ({type(strategy).__name__}): mesh {info.get('mesh')}, "
          f"data-parallel degree {strategy.data_parallel_size}")
    mesh = getattr(strategy, "mesh", None)
    if mesh is not None and hasattr(mesh, "devices"):
        ids = np.vectorize(lambda d: d.id)(np.asarray(mesh.devices))
        print(f"device ids on mesh axes {tuple(mesh.axis_names)}:")
        for line in np.array2string(ids).splitlines():
            print(f"  {line}")



def describe_devices() -> str:
    return (f"{jax.device_count()} {jax.devices()[0].platform} devices, "
            f"process {jax.process_index()} of {jax.process_count()}")



def devices_command(argv: Sequence[str]) -> None:
    parser = Parser(prog="jaxlight devices", description=COMMANDS["devices"],
                     allow_abbrev=False)
    parser.add_argument("--strategy", default="auto", help="strategy whose mesh to show "
                        "(default: auto)")
    parser.add_argument("--mesh-shape", default=None, help="mesh for strategies.Hybrid "
                        "(default: none)")
    parser.add_argument("--devices", type=int, default=None,
                        help="simulate this many CPU devices (default: as XLA_FLAGS says)")
    args = parse_command(parser, argv)
    _print_devices(args.strategy, args.mesh_shape)
