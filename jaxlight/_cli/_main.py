"""The `jaxlight` console script: dispatches commands and turns user errors into
`jaxlight: error: ...` with exit status 2."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

import jax

from jaxlight import recipes
from jaxlight._cli import _help
from jaxlight._cli._argv import config_target, requested_devices
from jaxlight._cli._devices import devices_command, simulate_cpu_devices
from jaxlight._cli._generate import generate_command
from jaxlight._cli._help import COMMANDS
from jaxlight._cli._run import run
from jaxlight._errors import (
    ConfigurationError,
    DistributedError,
    JaxlightError,
    TrainingStopped,
    suggest,
)
from jaxlight.distributed._launch import main as launch_main


def _top_help() -> str:
    summaries = {}
    for name in recipes.names():
        try:
            summaries[name] = recipes.get(name).summary
        except Exception as err:  # a recipe whose dependencies are missing still gets listed
            summaries[name] = f"(unavailable: {err})"
    return _help.top_help(summaries)


def _version() -> str:
    return f"jaxlight {sys.modules['jaxlight'].__version__} (jax {jax.__version__})"


def main(argv: Sequence[str] | None = None) -> int:
    """The `jaxlight` console script. Returns the exit status: 2 for bad input (every
    `JaxlightError` except the two below, printed as `jaxlight: error: ...`), 1 for a run that
    failed (`DistributedError`, `TrainingStopped`), 141 when stdout's reader went away."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--devices N` writes XLA_FLAGS for this process's JAX; called in a process that goes on
    # (a test, a notebook), main leaves the variable as it found it for the processes started
    # after it (a leftover device count gave them other devices and other numbers).
    flags = os.environ.get("XLA_FLAGS")
    try:
        status = _dispatch(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        _help.quiet_stdout()
        return 128 + signal.SIGPIPE  # what a Unix tool killed by SIGPIPE reports
    except (DistributedError, TrainingStopped) as err:
        print(f"jaxlight: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except JaxlightError as err:
        print(f"jaxlight: error: {err}", file=sys.stderr)
        return 2
    finally:
        if flags is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = flags


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_top_help())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version", "version"):
        print(_version())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "launch":
        return launch_main(rest) or 0
    if command not in COMMANDS:
        raise ConfigurationError(
            f"unknown command {command!r}; valid commands are {list(COMMANDS)} (or --version, "
            f"--help).{suggest(command, [*COMMANDS, '--version'])}"
        )
    # A saved config replays on its devices (run commands).
    n = requested_devices(rest, configs=command not in ("devices", "generate"))
    if n is not None:
        simulate_cpu_devices(n)
    if command == "devices":
        devices_command(rest)
        return 0
    if command == "generate":
        generate_command(rest)
        return 0
    if not rest or rest[0].startswith("-"):
        if rest and rest[0] in ("-h", "--help"):
            print(_top_help())
            return 0
        target = config_target(rest)  # LightningCLI's subclass mode: the config names it
        if target is None:
            raise ConfigurationError(
                f"jaxlight {command} needs a recipe: jaxlight {command} <recipe> [options]; "
                f"recipes are {recipes.names()}. Your own module: jaxlight {command} "
                "PATH.py:Module --data PATH.py:Data [options], or a --config file whose model: "
                "section names it (class_path and init_args)."
            )
        rest = [target, *rest]
    run(command, rest[0], rest[1:])
    return 0
