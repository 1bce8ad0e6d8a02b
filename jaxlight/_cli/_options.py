"""The small argparse parser of `jaxlight devices` and `jaxlight generate`
(run commands are read by the one jsonargparse parser, `_lightning_form`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from jaxlight._errors import ConfigurationError, suggest


class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigurationError instead of exiting, so messages stay ours."""

    def error(self, message: str):
        raise ConfigurationError(f"{self.prog}: {message}")


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Accepts `--mesh_shape` as well as `--mesh-shape`."""
    out = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token[2:].partition("=")
            token = f"--{name.replace('_', '-')}{eq}{value}"
        out.append(token)
    return out


def unknown_option_error(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    options = sorted(s for a in parser._actions for s in a.option_strings if s.startswith("--"))
    bad = next((u for u in unknown if u.startswith("-")), unknown[0])
    name = bad.split("=")[0]
    if not name.startswith("-"):
        raise ConfigurationError(
            f"{parser.prog}: unexpected argument {bad!r}; options take the form --name value "
            f"(valid options: {', '.join(options)})."
        )
    raise ConfigurationError(
        f"{parser.prog}: unknown option {name!r}.{suggest(name, options)} Valid options: "
        f"{', '.join(options)}. See {parser.prog} --help."
    )
