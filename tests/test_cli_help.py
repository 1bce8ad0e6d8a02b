"""`jaxlight`, `jaxlight -h` and `jaxlight --help` print the top-level help from
`jaxlight._cli._help` without importing JAX; the text is the one the real command line builds
(`jaxlight._cli._main`), commands and recipes included, so the two cannot drift apart."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxlight import recipes
from jaxlight._cli import _help, _main
from jaxlight._cli._help import COMMANDS

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: What the console script `jaxlight` (`jaxlight._cli:main`) runs, in a fresh interpreter.
CONSOLE_SCRIPT = ("import json, sys; from jaxlight._cli import main; status = main(); "
                  "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'jax')), "
                  "file=sys.stderr); sys.exit(status)")


def _section(text: str, title: str) -> list[str]:
    """The names listed under `title` (`commands:`, `recipes ...:`) of a help text."""
    lines = text.split("\n\n")
    block = next(b for b in lines if b.startswith(title))
    return [re.match(r"  (\S+)", line).group(1) for line in block.splitlines()[1:]]


def test_the_static_help_lists_every_command_and_recipe_of_the_parser():
    assert _section(_help.TOP_HELP, "commands:") == list(COMMANDS)
    assert _section(_help.TOP_HELP, "recipes") == recipes.names()


def test_the_static_help_is_the_text_the_parser_prints():
    assert _main._top_help() == _help.TOP_HELP


def _console(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-c", CONSOLE_SCRIPT, *argv], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("argv", "status"), [(["--help"], 0), (["-h"], 0), ([], 2)])
def test_jaxlight_help_in_a_fresh_process_imports_no_jax(argv, status):
    out = _console(*argv)
    assert out.returncode == status, out.stderr
    assert out.stdout == _help.TOP_HELP + "\n"
    assert out.stderr.strip().splitlines()[-1] == "[]", out.stderr  # no jax module loaded


@pytest.mark.slow  # fresh processes
def test_other_commands_still_reach_the_real_parser():
    out = _console("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("jaxlight ") and "(jax " in out.stdout
