"""The command line, read once before the parser: jaxlight's own options taken out, the
earlier forms renamed, and each config file loaded (a syntax error named with its file, line
and column), then handed to the one parser (`_lightning_form`) under its keys.

jaxlight's earlier dashed options and config-file keys are read as keys of that parser:
`jaxlight fit digits --max-steps 20 --strategy dp` is `--trainer.max_steps 20
--trainer.strategy dp`, one table (`ALIASES`) mapping each earlier name to its key. Two take a
value in call form that becomes LightningCLI's: `--logger csv,wandb(project='x')` is
`--trainer.logger` with those logger classes, and `--callbacks
"EarlyStopping(monitor='val_loss')"` (or a class by where it lives, `PATH.py:Name(...)`, also
after `--trainer.callbacks+=`) appends to `--trainer.callbacks`, each as `class_path`/
`init_args`. A config file in the earlier form (`max_steps: 100` at the top level, `model:
{class_path: model.py:Net, hidden: 64}`) is read the same way; Lightning's keys get their
jaxlight meaning (`_lightning_keys`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from jaxlight import callbacks
from jaxlight._cli import _lightning_keys
from jaxlight._cli._build import callback_calls, logger_calls
from jaxlight._cli._lightning_keys import Notes
from jaxlight._cli._target import class_path_spec, register
from jaxlight._errors import ConfigurationError

#: Every earlier option (dashes, as it was spelled) and its key in the one parser.
ALIASES: dict[str, str] = {
    **{name: f"trainer.{name.replace('-', '_')}" for name in (
        "strategy", "precision", "accumulate-grad-batches", "gradient-clip-val",
        "gradient-clip-algorithm", "max-steps", "max-epochs", "val-check-interval",
        "check-val-every-n-epoch", "limit-train-batches", "limit-val-batches",
        "num-sanity-val-steps", "log-every-n-steps", "enable-progress-bar",
        "enable-model-summary", "default-root-dir", "compilation-cache", "fast-dev-run",
        "logger", "callbacks")},
    "seed": "seed_everything",
    "ckpt-path": "ckpt_path",
    "print-config": "print_config",
    "mesh-shape": "mesh_shape",
    "checkpoint-every-n-steps": "checkpoint_every_n_steps",
    "checkpoint-monitor": "checkpoint_monitor",
    "checkpoint-mode": "checkpoint_mode",
}

#: Earlier config-file keys that named jaxlight's own command-line settings, not parser keys.
_FILE_EXTRAS = ("preset",)


def new_key(name: str) -> str | None:
    """The parser key of an earlier option name (`max-steps`, `max_steps`), or None."""
    return ALIASES.get(name.replace("_", "-"))


def _logger_value(text: str) -> Any:
    """`--logger csv,wandb(project='x')` as `--trainer.logger`'s value."""
    if text.strip().lower() in ("", "none", "false", "off"):
        return False
    return [_as_class(cls, kwargs) for cls, kwargs in logger_calls(text)]


def _as_class(cls: type, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    if getattr(callbacks, cls.__name__, None) is cls:
        path = f"jaxlight.callbacks.{cls.__name__}"
    else:  # the user's class: importable under its file's name (`sampler.ImageSampler`)
        path = f"{register(cls).__name__}.{cls.__qualname__}"
    out: dict[str, Any] = {"class_path": path}
    if kwargs:
        out["init_args"] = dict(kwargs)
    return out


def callback_values(text: str) -> list[dict[str, Any]]:
    """`--callbacks "EarlyStopping(monitor='val_loss'), x.py:Mine(n=2)"` as `class_path`s."""
    return [_as_class(cls, kwargs) for cls, kwargs in callback_calls(text)]


def option(key: str, value: str) -> list[tuple[str, Any]]:
    """An earlier option (its parser `key`, from `new_key`) and its value as the parser's
    options: `--logger` becomes `--trainer.logger`'s classes, `--callbacks` appends to
    `--trainer.callbacks+`, each as `class_path`/`init_args`."""
    if key == "trainer.logger":
        return [(f"--{key}", _logger_value(value))]
    if key == "trainer.callbacks":
        return [("--trainer.callbacks+", v) for v in callback_values(value)]
    return [(f"--{key}", value)]


HELP = ("jaxlight's own options:\n"
        "  --data PATH.py:NAME      your module's data (a DataModule, or a function returning "
        "one)\n"
        "  --preset NAME            a recipe's named defaults\n"
        "  --output FILE.npz        predict: save the predictions\n"
        "  --save_config_kwargs M   LightningCLI's save_config_kwargs, e.g. "
        "'{\"overwrite\": true}'\n"
        "  --save_config_callback null   save no config.yaml (LightningCLI's "
        "save_config_callback=None)\n\n"
        "jaxlight's earlier options, read as these keys:\n"
        + "".join(f"  --{old} = --{new}\n" for old, new in ALIASES.items())
        + "--logger takes csv,wandb,tensorboard or none (call form for arguments, e.g. "
        "\"wandb(project='demo')\");\n--callbacks \"EarlyStopping(monitor='val_loss'), "
        "file.py:Mine(n=2)\" appends to --trainer.callbacks.\n")


def _section_class(name: str, value: Mapping[str, Any], extras: dict[str, Any]) -> dict:
    """A `model:`/`data:` section naming its class: the class as `extras`' `target`/`data`,
    and the arguments, under `init_args` (LightningCLI's subclass mode) or beside
    `class_path` (jaxlight's earlier form)."""
    value = dict(value)
    extras["target" if name == "model" else "data"] = class_path_spec(str(value.pop("class_path")))
    if "init_args" not in value:
        return value
    init_args = value.pop("init_args") or {}
    if value or not isinstance(init_args, Mapping):
        raise ConfigurationError(
            f"config file: {name}: has class_path and init_args, so its arguments go under "
            f"init_args (as LightningCLI writes them); got {sorted(map(str, value))} beside "
            f"them and init_args = {init_args!r:.80}. Move the arguments into init_args.")
    return dict(init_args)


def translate_file(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A config file with its earlier-form keys as the parser's (a LightningCLI-shaped file
    passes unchanged), and jaxlight's own settings: `preset` and a `model:`/`data:`
    `class_path` (LightningCLI's subclass mode with `init_args`, or jaxlight's earlier form with
    the arguments beside it) as `target`/`data`."""
    tree: dict[str, Any] = {}
    extras: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key)
        if name in _FILE_EXTRAS:
            extras[name] = value
            continue
        target = new_key(name)
        if target is None:  # a section (model:, data:, optim:, ...), or a key the parser names
            if name in ("model", "data") and isinstance(value, Mapping) and "class_path" in value:
                value = _section_class(name, value, extras)
            tree[name] = value
            continue
        if target == "trainer.logger" and isinstance(value, str):
            value = _logger_value(value)
        elif target == "trainer.callbacks" and isinstance(value, str):
            value = callback_values(value)
        if target.startswith("trainer."):
            tree.setdefault("trainer", {})[target[len("trainer."):]] = value
        else:
            tree[target] = value
    return tree, extras


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


#: jaxlight's own options, taken out before the parser reads the rest: `--data` (the
#: DataModule, which LightningCLI fixes in the script), `--output` (predict), `--preset`,
#: LightningCLI's `save_config_*` and `--print_config`.
_EXTRAS = ("data", "output", "preset", "save_config_kwargs", "save_config_callback",
           "print_config")
_FLAGS = ("-h", "--help", "--print_config", "--print-config")  # options without a value


def _pairs(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """`--name value` and `--name=value` as `("--name", "value")`; a flag or a stray token as
    `(token, None)`."""
    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if eq and name.startswith("--"):
            out.append((name, value))
        elif name.startswith("--") and name not in _FLAGS and i + 1 < len(argv) and \
                not argv[i + 1].startswith("--"):
            out.append((name, argv[i + 1]))
            i += 1
        else:
            out.append((argv[i], None))
        i += 1
    return out


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _read_config(path: str) -> dict[str, Any]:
    """A `--config` file, or the config's text itself (as jsonargparse takes it)."""
    text = None if os.path.isfile(path) else _yaml_value(path)
    return text if isinstance(text, dict) else load_config_file(path)  # or: no such file


def read_command_line(argv: Sequence[str]) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """(the options under the parser's names, with each config as its tree; jaxlight's own
    settings): the earlier options renamed, and the settings a config file holds (`preset`,
    `devices`, a `model:`/`data:` `class_path` as `target`/`data`) where the command line
    left them open."""
    extras: dict[str, Any] = {**dict.fromkeys(_EXTRAS), "target": None, "configs": []}
    found: dict[str, Any] = {}
    items: list[tuple[str, Any]] = []
    for name, value in _pairs(argv):
        plain = name.startswith("--") and "." not in name  # not a dotted key
        key = name[2:].replace("-", "_") if plain else None
        alias = new_key(name[2:]) if plain else None
        if key in _EXTRAS:
            if value is None and key != "print_config":
                raise ConfigurationError(f"{name} needs a value.")
            extras[key] = "" if value is None else value
        elif key == "config" and value is not None:
            tree, in_file = translate_file(_read_config(value))
            found = {**in_file, **found}  # the first file naming one wins
            extras["configs"].append(value if os.path.isfile(value) else "(text)")
            items.append(("--config", tree))
        elif alias is not None:
            if value is None:
                raise ConfigurationError(f"{name} needs a value.")
            items += option(alias, value)
        elif name.startswith("--") and "." in name and not name.endswith("+"):
            section, _, field = name.rpartition(".")  # --model.num-layers: --model.num_layers
            items.append((f"{section}.{field.replace('-', '_')}", value))
        else:
            items.append((name, value))
    for key, value in found.items():
        if extras.get(key) is None:
            extras[key] = value
    return items, extras


def parser_argv(items: list[tuple[str, Any]], notes: Notes, modules: dict[str, Any]) -> list[str]:
    """The parser's command line: Lightning's trainer flags and config trees in their jaxlight
    meaning, Lightning's and torch's class paths as jaxlight's (`_lightning_keys`)."""
    out: list[str] = []
    for name, value in items:
        key = name[2:]
        if name == "--config":
            value = _lightning_keys.adapt_config(value, notes, modules)
        elif value is None:
            out.append(name)
            continue
        elif key in ("trainer.callbacks+", "trainer.callbacks", "trainer.logger"):
            if isinstance(value, str) and value.startswith(_lightning_keys.LIGHTNING_PACKAGES):
                value = _lightning_keys.jaxlight_callback(value, None, notes, key)[0]
            elif isinstance(value, str) and ":" in value.partition("(")[0] and \
                    key != "trainer.logger":  # your own class, by where it lives: PATH.py:Name
                classes = callback_values(value)
                out += ([f"--{key}={json.dumps(v)}" for v in classes] if key.endswith("+")
                        else [name, json.dumps(classes)])
                continue
        elif key in ("optimizer", "lr_scheduler"):
            value = _lightning_keys.TORCH_CLASS_PATHS.get(value, value)
        elif key.startswith("trainer.") and key[8:] in _lightning_keys.TRAINER_KEYS:
            parsed = _yaml_value(value)
            keep, meant = _lightning_keys.trainer_value(key[8:], parsed, notes)
            if not keep:
                continue
            # A value kept as it is goes to the parser as typed, which reads it by the
            # argument's type: `--trainer.default_root_dir 007` is the folder '007', not 7.
            value = value if meant is parsed else meant
        value = value if isinstance(value, str) else json.dumps(value, default=str)
        out += [f"{name}={value}"] if name.endswith("+") else [name, value]
    return out


def requested_devices(argv: Sequence[str], configs: bool = True) -> int | None:
    """`--devices N`, else (`configs`) the `devices:` of the last `--config` file naming one
    (`--print_config` writes the run's), to be applied before JAX starts."""
    pairs = _pairs(argv[:argv.index("--")] if "--" in argv else argv)
    given = [value for name, value in pairs if name == "--devices"]
    if given:
        try:
            n = int(given[0])
        except (TypeError, ValueError):
            raise ConfigurationError(f"--devices expects a positive int, got {given[0]!r}.") \
                from None
        if n < 1:
            raise ConfigurationError(f"--devices expects a positive int, got {n}.")
        return n
    trees = [_read_config(value) for name, value in pairs
             if configs and name == "--config" and value is not None]
    found = [tree["devices"] for tree in trees if tree.get("devices") is not None]
    if found and (not isinstance(found[-1], int) or isinstance(found[-1], bool) or found[-1] < 1):
        raise ConfigurationError(f"config file: devices: {found[-1]!r}; give a positive number "
                                 "of CPU devices to simulate, or null.")
    return found[-1] if found else None


def config_target(argv: Sequence[str]) -> str | None:
    """The module class the `--config` files name (`model: class_path`), for a command line
    that names none (LightningCLI's subclass mode: `jaxlight fit --config config.yaml`)."""
    found = read_command_line(argv)[1]["target"]
    if found is not None and found.startswith("__main__:"):
        raise ConfigurationError(
            f"config file: model.class_path is {found.replace(':', '.')!r}, a class of the "
            "script that ran LightningCLI; name its file on the command line: jaxlight fit "
            f"PATH.py:{found.partition(':')[2]} --config ...")
    return found
