"""The `jaxlight` console script: dispatches commands and turns user errors into
`jaxlight: error: ...` with exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jaxlight import recipes
from jaxlight._cli._devices import _devices_command, _prescan_devices, simulate_cpu_devices
from jaxlight._cli._options import COMMANDS
from jaxlight._cli._run import run
from jaxlight._errors import ConfigurationError, JaxlightError, suggest
from jaxlight._launch import main as launch_main


def _top_help() -> str:
    lines = ["usage: jaxlight <command> [recipe] [options]", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    lines += ["", "recipes (jaxlight fit <recipe> --help lists every option and its default):"]
    for name in recipes.names():
        try:
            summary = recipes.get(name).summary
        except Exception as err:  # a recipe whose dependencies are missing still gets listed
            summary = f"(unavailable: {err})"
        lines.append(f"  {name:<9} {summary}")
    return "\n".join(lines)



def main(argv: Sequence[str] | None = None) -> int:
    """The `jaxlight` console script. Returns the exit status (2: bad input, 1: failed run)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(_top_help())
            return 0 if argv else 2
        command, rest = argv[0], argv[1:]
        if command == "launch":
            return launch_main(rest) or 0
        if command not in COMMANDS:
            raise ConfigurationError(
                f"unknown command {command!r}; valid commands are {list(COMMANDS)}."
                f"{suggest(command, COMMANDS)}"
            )
        n = _prescan_devices(rest)
        if n is not None:
            simulate_cpu_devices(n)
        if command == "devices":
            _devices_command(rest)
            return 0
        if not rest or rest[0].startswith("-"):
            if rest and rest[0] in ("-h", "--help"):
                print(_top_help())
                return 0
            raise ConfigurationError(
                f"jaxlight {command} needs a recipe: jaxlight {command} <recipe> [options]; "
                f"recipes are {recipes.names()}."
            )
        run(command, rest[0], rest[1:])
        return 0
    except ConfigurationError as err:
        print(f"jaxlight: error: {err}", file=sys.stderr)
        return 2
    except JaxlightError as err:
        print(f"jaxlight: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
