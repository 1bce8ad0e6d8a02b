"""Config files of the command line: reading YAML or JSON, with a message naming the file, line
and reason when one does not parse."""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

from jaxlight._errors import ConfigurationError


def load_config_file(path: str) -> dict[str, Any]:
    """Reads a YAML or JSON options file; a syntax error names the file, line and reason."""
    if not os.path.isfile(path):
        raise ConfigurationError(f"--config {path}: no such file (looked in {os.getcwd()}).")
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigurationError(
                f"config file {path}, line {err.lineno}, column {err.colno}: {err.msg} "
                "(it is read as JSON because of its .json suffix)."
            ) from None
    else:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            reason = getattr(err, "problem", None) or str(err)
            context = getattr(err, "context", None)
            raise ConfigurationError(
                f"config file {path}{where}: {reason}"
                + (f" ({context})" if context else "") + " (read as YAML)."
            ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigurationError(
            f"config file {path}: the top level is a {type(data).__name__}; it must be a mapping "
            "such as `max_steps: 100` / `model: {hidden: 128}`."
        )
    return data
