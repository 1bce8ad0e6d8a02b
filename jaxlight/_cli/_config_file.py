"""Config files of the command line: reading YAML or JSON, and splitting a file into run options
and config-section overrides (recipe settings, or a user target's `model:`/`data:` arguments)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import yaml

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.recipes._base import fields, flatten


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


def _line_of(path: str, key: str) -> str:
    """', line N' of the first line mentioning `key` in a config file (best effort)."""
    try:
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if re.search(rf"(^|[\s{{\"',]){re.escape(key)}[\"']?\s*:", line):
                    return f", line {i}"
    except OSError:
        pass
    return ""


def split_file_options(path: str, data: dict[str, Any], recipe, config, run_names: set[str]
                       ) -> tuple[dict, dict]:
    """Splits a config file into run options (keys in `run_names`) and config overrides."""
    sections = {d.split(".")[0] for d in fields(type(config))}
    known_fields = fields(type(config))
    run, cfg = {}, {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in run_names:
            run[name] = value
        elif name in sections and isinstance(value, dict):
            for dotted, v in flatten(value, f"{name}.").items():
                if dotted not in known_fields:
                    leaf = dotted.split(".")[-1]
                    raise ConfigurationError(
                        f"config file {path}{_line_of(path, leaf)}: unknown field {dotted!r} of "
                        f"recipe {recipe.name!r}.{suggest(dotted, known_fields)} Valid fields: "
                        f"{', '.join(known_fields)}."
                    )
                cfg[dotted] = v
        elif "." in name and name in known_fields:
            cfg[name] = value
        else:
            valid = sorted(run_names | sections)
            example = f" (sections hold mappings, e.g. `{sorted(sections)[0]}: {{...}}`)" \
                if sections else ""
            raise ConfigurationError(
                f"config file {path}{_line_of(path, str(key))}: unknown key {key!r}."
                f"{suggest(name, valid)} Valid top-level keys: {', '.join(valid)}{example}."
            )
    return run, cfg

