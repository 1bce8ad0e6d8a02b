"""jaxlight's earlier dashed options and config-file keys, read as keys of the one parser.

`jaxlight fit digits --max-steps 20 --strategy dp` is `--trainer.max_steps 20
--trainer.strategy dp`: one table maps each earlier name to its key. Two take a value in call
form that becomes LightningCLI's: `--logger csv,wandb(project='x')` is `--trainer.logger` with
those logger classes, and `--callbacks "EarlyStopping(monitor='val_loss')"` appends to
`--trainer.callbacks`, each as `class_path`/`init_args`. A config file in the earlier form
(`max_steps: 100` at the top level, `model: {class_path: model.py:Net, hidden: 64}`) is read the
same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxlight import callbacks
from jaxlight._cli._build import callback_calls, logger_calls
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
_FILE_EXTRAS = ("preset", "devices")


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


def _callback_values(text: str) -> list[dict[str, Any]]:
    """`--callbacks "EarlyStopping(monitor='val_loss'), x.py:Mine(n=2)"` as `class_path`s."""
    return [_as_class(cls, kwargs) for cls, kwargs in callback_calls(text)]


def option(key: str, value: str) -> list[tuple[str, Any]]:
    """An earlier option (its parser `key`, from `new_key`) and its value as the parser's
    options: `--logger` becomes `--trainer.logger`'s classes, `--callbacks` appends to
    `--trainer.callbacks+`, each as `class_path`/`init_args`."""
    if key == "trainer.logger":
        return [(f"--{key}", _logger_value(value))]
    if key == "trainer.callbacks":
        return [("--trainer.callbacks+", v) for v in _callback_values(value)]
    return [(f"--{key}", value)]


HELP = ("jaxlight's own options:\n"
        "  --data PATH.py:NAME      your module's data (a DataModule, or a function returning "
        "one)\n"
        "  --devices N              simulate N CPU devices (set before JAX starts)\n"
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
    passes unchanged), and jaxlight's own settings: `preset`, `devices`, and a `model:`/`data:`
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
            value = _callback_values(value)
        if target.startswith("trainer."):
            tree.setdefault("trainer", {})[target[len("trainer."):]] = value
        else:
            tree[target] = value
    return tree, extras
