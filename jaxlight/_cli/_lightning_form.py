"""LightningCLI's command line, built with jsonargparse from type hints: the one parser of every
run command, for the user's own module and for the recipes (their config sections).

    jaxlight fit model.py:LitClassifier --data model.py:MyDataModule --config config.yaml \\
        --trainer.max_epochs 3 --seed_everything 42 \\
        --trainer.callbacks+=EarlyStopping --trainer.callbacks.monitor val_loss \\
        --model.backbone Backbone --model.backbone.hidden_dim 64

The parser has LightningCLI's sections: `seed_everything`, `trainer` (`Fit`'s keywords, read
from its signature), `model` and `data` (the `__init__` arguments of the two classes, any of
them typed as a class in subclass mode: `class_path`/`init_args`, or a short name on the
command line), `optimizer` and `lr_scheduler` (torch's names that optax expresses exactly, see
`_torch_optim`), `ckpt_path`. A `config.yaml` written by Lightning's own LightningCLI
(`--print_config`) is read as it is: each `trainer:` key gets its jaxlight meaning (Lightning's
`None` defaults become `Fit`'s, `max_steps: -1` no limit, and Lightning's 1000 epochs when
neither length is set); a key jaxlight has no meaning for is dropped when it holds Lightning's
default, named in a warning otherwise, and refused where ignoring it would change what is
trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import typing
import warnings
from collections.abc import Sequence
from typing import Any

import yaml

from jaxlight import Fit, callbacks, recipes
from jaxlight._cli._aliases import ALIASES, translate_argv, translate_file
from jaxlight._cli._config_file import load_config_file
from jaxlight._cli._target import import_object, register, same_target
from jaxlight._errors import ConfigurationError, suggest
from jaxlight.data._datamodule import DataModule
from jaxlight.module._module import TrainModule
from jaxlight.module._porting import TRAINER_ARGS
from jaxlight.optim.torch import TORCH_PATHS, TorchLRScheduler, TorchOptimizer
from jaxlight.recipes._base import apply_overrides, flatten, type_name

#: Lightning 2.6 `Trainer` arguments that `Fit` takes under the same name, with Lightning's
#: default and the `Fit` value that means the same (`None` in Lightning often means "the
#: default", which `Fit` spells out).
_SHARED = {
    "strategy": ("auto", "auto"),
    "devices": ("auto", None),
    "precision": (None, None),
    "logger": (None, True),
    "callbacks": (None, []),
    "fast_dev_run": (False, False),
    "max_epochs": (None, None),
    "max_steps": (-1, None),
    "max_time": (None, None),
    "limit_train_batches": (None, None),
    "limit_val_batches": (None, None),
    "val_check_interval": (None, None),
    "check_val_every_n_epoch": (1, 1),
    "num_sanity_val_steps": (None, 2),
    "log_every_n_steps": (None, 50),
    "enable_progress_bar": (None, True),
    "enable_model_summary": (None, True),
    "accumulate_grad_batches": (1, 1),
    "gradient_clip_val": (None, None),
    "gradient_clip_algorithm": (None, "norm"),
    "default_root_dir": (None, "jaxlight_logs"),
}

#: Shared arguments whose `None` Lightning keeps as a value rather than reading as its default
#: (`check_val_every_n_epoch=None`: `val_check_interval` counts steps across epochs).
_NONE_IS_A_VALUE = frozenset({"check_val_every_n_epoch"})

#: Lightning 2.6 `Trainer` arguments without a jaxlight meaning, with Lightning's default. At
#: the default they ask for nothing and are dropped; another value is named in a warning.
_NO_MEANING = {
    "accelerator": "auto",
    "num_nodes": 1,
    "enable_checkpointing": None,
    "deterministic": None,
    "benchmark": None,
    "inference_mode": True,
    "use_distributed_sampler": True,
    "profiler": None,
    "detect_anomaly": False,
    "barebones": False,
    "plugins": None,
    "sync_batchnorm": False,
    "enable_autolog_hparams": True,
    "model_registry": None,
}

#: ... and those whose other values would change what is trained or evaluated: refused.
_REFUSED = {
    "min_epochs": None,
    "min_steps": None,
    "overfit_batches": 0.0,
    "limit_test_batches": None,
    "limit_predict_batches": None,
    "reload_dataloaders_every_n_epochs": 0,
}

#: Lightning's length when neither max_epochs nor max_steps is given.
_LIGHTNING_DEFAULT_EPOCHS = 1000

def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


# -- reading Lightning's keys ---------------------------------------------------------------------


class _Notes:
    """Keys met while adapting a Lightning config: dropped at their default, warned, refused."""

    def __init__(self):
        self.warned: dict[str, Any] = {}
        self.refused: dict[str, Any] = {}

    def report(self) -> None:

        if self.refused:
            items = "; ".join(f"trainer.{k}: {v!r} ({TRAINER_ARGS.get(k, 'no jaxlight form')})"
                              for k, v in self.refused.items())
            raise ConfigurationError(
                f"these Lightning Trainer settings have no jaxlight meaning, and ignoring them "
                f"would change what is trained or evaluated: {items}. Remove them or set them "
                "to Lightning's default (see docs/porting.md, The command line)."
            )
        if self.warned:
            items = "; ".join(
                f"trainer.{k}: {v!r} ({TRAINER_ARGS[k]})" if k in TRAINER_ARGS
                else f"{k}: {v!r} (not an argument of jaxlight's class)"
                for k, v in self.warned.items())
            warnings.warn(
                f"ignored Lightning settings without a jaxlight meaning: {items}.",
                UserWarning, stacklevel=2)


def _adapt_trainer_value(key: str, value: Any, notes: _Notes) -> tuple[bool, Any]:
    """(keep, value) for one `trainer.<key>` of a Lightning config or flag."""
    if key in _NO_MEANING or key in _REFUSED:
        default = _NO_MEANING.get(key, _REFUSED.get(key))
        # enable_checkpointing: False asks for what jaxlight does (no checkpoint callback).
        if value != default and not (key == "enable_checkpointing" and value is False):
            (notes.refused if key in _REFUSED else notes.warned)[key] = value
        return False, None
    if key in _SHARED:
        lightning_default, ours = _SHARED[key]
        if value is None and key in _NONE_IS_A_VALUE:
            return True, None
        if value is None or (key == "max_steps" and value == -1) or (
                key in ("strategy", "devices") and value == "auto"):
            return True, ours if value == lightning_default or value is None else value
        if key == "precision" and str(value) in ("32", "32-true"):
            return True, None
    return True, value


#: Lightning's packages whose callbacks and loggers jaxlight.callbacks holds under their names.
_LIGHTNING_PACKAGES = ("lightning.pytorch.callbacks", "lightning.pytorch.loggers",
                       "pytorch_lightning.callbacks", "pytorch_lightning.loggers")

#: Lightning callback and logger arguments jaxlight's classes do not take, at the value that
#: asks for nothing (besides None and False, which never ask for anything here).
_QUIET_ARGUMENTS = {"strict": True, "auto_insert_metric_name": True,
                    "enable_version_counter": True, "log_rank_zero_only": False}


def _jaxlight_callback(path: str, init_args: Any, notes: _Notes, where: str):
    """(class path, init_args) of jaxlight's class of Lightning's name, looked up in
    `jaxlight.callbacks` when the command runs; arguments it does not take are dropped at a
    value that asks for nothing and named otherwise."""


    name = path.rpartition(".")[2]
    cls = getattr(callbacks, name, None)
    if not inspect.isclass(cls):
        valid = [n for n in getattr(callbacks, "__all__", ()) if inspect.isclass(
            getattr(callbacks, n))]
        raise ConfigurationError(
            f"{where}: {path} has no jaxlight counterpart in jaxlight.callbacks."
            f"{suggest(name, valid)} jaxlight.callbacks has {', '.join(valid)}; remove it or "
            "name one of those.")
    if not isinstance(init_args, dict):
        return f"jaxlight.callbacks.{name}", init_args
    params = inspect.signature(cls).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return f"jaxlight.callbacks.{name}", init_args
    kept = {}
    for key, value in init_args.items():
        if key in params:
            kept[key] = value
        elif not (value is None or value is False or _QUIET_ARGUMENTS.get(key, object()) == value):
            notes.warned[f"{where}.init_args.{key}"] = value
    return f"jaxlight.callbacks.{name}", kept


def _class_path(value: Any, modules: dict[str, Any], notes: _Notes, where: str) -> Any:
    """Rewrites class paths of a config tree to jaxlight's: `__main__.X` (a script run as
    `python main.py`) or the script's module to X in the user's file, Lightning's callbacks and
    loggers to `jaxlight.callbacks`' of the same name, torch's optimizers and schedulers to
    `jaxlight.optim.torch`."""
    if isinstance(value, list):
        return [_class_path(v, modules, notes, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    out = {k: _class_path(v, modules, notes, f"{where}.{k}" if where else str(k))
           for k, v in value.items()}
    path = out.get("class_path")
    if isinstance(path, str) and path in _torch_paths():
        out["class_path"] = _torch_paths()[path]
    elif isinstance(path, str) and path.startswith(_LIGHTNING_PACKAGES):
        out["class_path"], init_args = _jaxlight_callback(path, out.get("init_args"), notes,
                                                          where)
        if "init_args" in out:
            out["init_args"] = init_args
    elif isinstance(path, str) and "." in path:
        where_, _, name = path.rpartition(".")
        if where_ == "__main__" or where_ in modules:
            found = modules.get(where_) or next(
                (m for m in modules.values() if hasattr(m, name)), None)
            if found is not None and hasattr(found, name):
                out["class_path"] = f"{found.__name__}.{name}"
    return out


def _torch_paths() -> dict[str, str]:

    return {k: f"{v.__module__}.{v.__qualname__}" for k, v in TORCH_PATHS.items()}


def adapt_config(data: dict[str, Any], notes: _Notes, modules: dict[str, Any]) -> dict[str, Any]:
    """A LightningCLI config tree with each `trainer:` key in its jaxlight meaning."""
    data = _class_path(dict(data), modules, notes, "")
    trainer = data.get("trainer")
    if isinstance(trainer, dict):
        adapted = {}
        for key, value in trainer.items():
            keep, value = _adapt_trainer_value(key, value, notes)
            if keep:
                adapted[key] = value
        if ("max_epochs" in trainer or "max_steps" in trainer) and adapted.get(
                "max_epochs") is None and adapted.get("max_steps") is None:
            adapted["max_epochs"] = _LIGHTNING_DEFAULT_EPOCHS
        data["trainer"] = adapted
    return data


def _adapt_argv(argv: list[str], notes: _Notes, modules: dict[str, Any]) -> list[str]:
    """The command line with config files adapted (passed on as their content) and Lightning's
    trainer flags in their jaxlight meaning."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name == "--config" and (eq or i + 1 < len(argv)):
            # The config's text, as `_read_configs` passed it on.
            data = adapt_config(_yaml_value(inline if eq else argv[i + 1]), notes, modules)
            out += ["--config", json.dumps(data)]
            i += 1 if eq else 2
            continue
        if name in ("--trainer.callbacks+", "--trainer.callbacks", "--trainer.logger") and (
                eq or i + 1 < len(argv)):
            value = inline if eq else argv[i + 1]
            if value.startswith(_LIGHTNING_PACKAGES):  # Lightning's path: jaxlight's class
                value = _jaxlight_callback(value, None, notes, name[2:])[0]
            out.append(f"{name}={value}" if eq else name)
            if not eq:
                out.append(value)
            i += 1 if eq else 2
            continue
        if name in ("--optimizer", "--lr_scheduler"):
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            value = _torch_paths().get(value, value)
            out += [name, value]
            i += 1 if eq else 2
            continue
        if name.startswith("--trainer.") and name.count(".") == 1 and not name.endswith("+"):
            key = name[len("--trainer."):]
            if key in _NO_MEANING or key in _REFUSED or key in _SHARED:
                if eq:
                    raw, step = inline, 1
                elif i + 1 < len(argv):
                    raw, step = argv[i + 1], 2
                else:
                    raw, step = None, 1
                value = _yaml_value(raw)
                keep, value = _adapt_trainer_value(key, value, notes)
                if keep:
                    out += [name, json.dumps(value) if not isinstance(value, str) else value]
                i += step
                continue
        out.append(token)
        i += 1
    return out


def _read_configs(argv: list[str], extras: dict[str, Any]) -> list[str]:
    """Reads each `--config` file (or config text) once, with its earlier-form keys as the
    parser's (`_aliases.translate_file`), and passes it on as JSON; its jaxlight settings
    (`preset`, `devices`, an earlier `model:`/`data:` `class_path`) fill what the command line
    left open."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        if name != "--config" or not (eq or i + 1 < len(argv)):
            out.append(argv[i])
            i += 1
            continue
        path = inline if eq else argv[i + 1]
        i += 1 if eq else 2
        # A file, or the config's text itself (as jsonargparse takes it).
        text = None if os.path.isfile(path) else _yaml_value(path)
        if not isinstance(text, dict):
            text = load_config_file(path)  # neither a file nor a mapping: says no such file
        tree, found = translate_file(text)
        for key, value in found.items():
            if extras.get(key) is None:
                extras[key] = value
        out += ["--config", json.dumps(tree, default=str)]
        extras.setdefault("configs", []).append(path if os.path.isfile(path) else "(text)")
    return out


def config_target(argv: Sequence[str]) -> str | None:
    """The module class the `--config` files name (`model: class_path`, read as `parse` reads
    it), for a command line that names none (LightningCLI's subclass mode: `jaxlight fit
    --config config.yaml`)."""
    extras: dict[str, Any] = {}
    _read_configs(translate_argv(list(argv)), extras)
    found = extras.get("target")
    if found is not None and found.startswith("__main__:"):
        raise ConfigurationError(
            f"config file: model.class_path is {found.replace(':', '.')!r}, a class of the "
            "script that ran LightningCLI; name its file on the command line: jaxlight fit "
            f"PATH.py:{found.partition(':')[2]} --config ...")
    return found


def _yaml_value(text: str | None) -> Any:

    if text is None:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


# -- the parser -----------------------------------------------------------------------------------


def _extras(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """Takes jaxlight's own options out of a LightningCLI-form command line: `--data SPEC` (the
    DataModule, which LightningCLI fixes in the script), `--output FILE` (predict), `--devices
    N` (applied before JAX starts)."""
    found: dict[str, str | None] = {"data": None, "output": None, "devices": None,
                                    "print_config": None, "preset": None, "target": None,
                                    "save_config_kwargs": None, "save_config_callback": None}
    rest = []
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key == "print_config":
            found["print_config"] = inline if eq else ""
            i += 1
            continue
        if key in ("data", "output", "devices", "preset", "save_config_kwargs",
                   "save_config_callback"):
            if eq:
                found[key] = inline
                i += 1
            elif i + 1 < len(argv):
                found[key] = argv[i + 1]
                i += 2
            else:
                raise ConfigurationError(f"--{key} needs a value.")
            continue
        rest.append(argv[i])
        i += 1
    return found, rest


def build_parser(command: str, model_cls: type | None, data_cls: Any | None, *,
                 recipe: Any = None, sections: dict[str, Any] | None = None,
                 trainer_defaults: dict[str, Any] | None = None):
    """The jsonargparse parser of `jaxlight <command> <module> --data <data>` (or of a recipe,
    whose config `sections` replace `model`/`data`) in LightningCLI's form."""
    # jsonargparse (with its type-hint machinery) loads only when a run command is parsed:
    # `jaxlight --help`, `devices` and `generate` start without it.
    from jsonargparse import ActionConfigFile, ArgumentParser


    parser = ArgumentParser(
        # LightningCLI's environment variables (PL_FIT__TRAINER__MAX_EPOCHS), read when
        # JSONARGPARSE_DEFAULT_ENV=true, as for a LightningCLI script.
        prog=f"jaxlight {command}", exit_on_error=False, epilog=_aliases_help(),
        env_prefix=f"PL_{command.upper()}_",
        formatter_class=_formatter(),
        description=(f"{(inspect.getdoc(model_cls) or '').strip()}\n\n"
                     f"LightningCLI's command line for {model_cls.__qualname__}: values come "
                     "from the signatures'\ndefaults, then --config files and flags in order."
                     if recipe is None else
                     f"{recipe.summary}\n\nLightningCLI's command line for recipe "
                     f"{recipe.name!r}: values come from the recipe's defaults, then\n"
                     "--preset, then --config files and flags in order."))
    parser.add_argument("--config", action=ActionConfigFile,
                        help="a YAML/JSON config file (LightningCLI's, as it is) or its text")
    parser.add_argument("--seed_everything", type=bool | int, default=True,
                        help="seed of parameter initialization and every nnx.Rngs stream; true "
                             "draws one (as Lightning) and prints it, false uses 0")
    parser.add_class_arguments(Fit, "trainer", instantiate=False, fail_untyped=False,
                               sub_configs=True, skip={"seed"})
    if trainer_defaults:
        _set_defaults(parser, {f"trainer.{k}": v for k, v in trainer_defaults.items()})
    if recipe is not None:
        for name, value in (sections or {}).items():
            parser.add_class_arguments(type(value), name, instantiate=False,
                                       fail_untyped=False)
            _set_defaults(parser, {f"{name}.{f.name}": getattr(value, f.name)
                                   for f in dataclasses.fields(value)},
                          {f"{name}.{f.name}": f.metadata.get("help")
                           for f in dataclasses.fields(value)})
        # A recipe's runs repeat by default (seed 0, as `Fit`'s), where LightningCLI draws one.
        parser.set_defaults(seed_everything=0)
        _add_common_tail(parser, with_optimizer=False)
        return parser
    parser.add_class_arguments(model_cls, "model", fail_untyped=False, sub_configs=True)
    if isinstance(data_cls, type):
        parser.add_class_arguments(data_cls, "data", fail_untyped=False, sub_configs=True)
    elif data_cls is not None:  # a function returning the DataModule: called after parsing
        parser.add_function_arguments(data_cls, "data", fail_untyped=False, sub_configs=True)
    _add_common_tail(parser, with_optimizer=True)
    return parser


def _set_defaults(parser, values: dict[str, Any], helps: dict[str, Any] | None = None) -> None:
    """Defaults that `--help` shows too (a recipe's, its preset's), with a recipe field's help."""
    parser.set_defaults(values)
    for action in parser._actions:
        if action.dest in values:
            action.default = values[action.dest]
            if helps and helps.get(action.dest):
                action.help = helps[action.dest]


def _add_common_tail(parser, with_optimizer: bool) -> None:
    """`--optimizer`/`--lr_scheduler` (a module's; a recipe has its `optim` section),
    `--ckpt_path`, and jaxlight's own keys: `--mesh_shape`, `--checkpoint_*`."""
    if with_optimizer:
        _add_optimizer(parser)
    parser.add_argument("--mesh_shape", type=Any, default=None,
                        help="jaxlight: the mesh of strategies.Hybrid: '{\"data\": 2, \"fsdp\": "
                             "4}', 'data=2,fsdp=4' or the Tunix form '[[4,2],[\"fsdp\",\"tp\"]]' "
                             "(axes data, pipe, fsdp, context, tp)")
    parser.add_argument("--checkpoint_every_n_steps", type=int | None, default=None,
                        help="jaxlight: save a checkpoint every N steps under "
                             "<default_root_dir>/checkpoints (callbacks.ModelCheckpoint)")
    parser.add_argument("--checkpoint_monitor", type=str | None, default=None,
                        help="jaxlight: rank checkpoints by this metric (e.g. val_loss), so that "
                             "--ckpt_path best finds the best; saves at every epoch's end "
                             "without --checkpoint_every_n_steps")
    parser.add_argument("--checkpoint_mode", type=str, default="min",
                        help="jaxlight: 'min' or 'max': which --checkpoint_monitor values are "
                             "better")
    parser.add_argument("--ckpt_path", type=str | None, default=None,
                        help="checkpoint to resume from (fit) or to run (validate, test, "
                             "predict): a path, 'last', 'best' or 'none'")


def _add_optimizer(parser) -> None:
    parser.add_subclass_arguments(TorchOptimizer, "optimizer", required=False,
                                  help="torch.optim's SGD, Adam or AdamW (replaces the module's "
                                       "configure_optimizers, as in LightningCLI)")
    parser.add_subclass_arguments(TorchLRScheduler, "lr_scheduler", required=False,
                                  help="torch's StepLR or ExponentialLR (with --optimizer)")


def _recipe_sections(recipe, preset: str | None) -> dict[str, Any]:
    """A recipe's config sections (`model`, `data`, `optim`, ...) at their defaults, the
    preset's values applied: each becomes a section of the parser, as a module's `__init__`
    does (`--model.width 32`, `model:` in a config file)."""
    config = recipe.default_config(preset)
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def _recipe_trainer_defaults(recipe, preset: str | None) -> dict[str, Any]:
    """`trainer.*` defaults of a recipe: its `fit_defaults`, then its preset's `fit:` values."""
    out = dict(recipe.fit_defaults)
    if preset is not None:
        out.update({k.replace("-", "_"): v for k, v in recipe.preset(preset)
                    .get("fit", {}).items()})
    return out


def parse_recipe(command: str, name: str, argv: Sequence[str]):
    """Parses `jaxlight <command> <recipe>` in LightningCLI's form: (parser, config, extras,
    recipe, notes). The recipe's config sections are the parser's sections beside `trainer`."""
    extras, rest = _extras(list(argv))
    recipe = recipes.get(name)
    rest = _read_configs(translate_argv(rest), extras)
    preset = extras["preset"]
    sections = _recipe_sections(recipe, preset)
    notes = _Notes()
    adapted = _adapt_argv(rest, notes, {})
    parser = build_parser(command, None, None, recipe=recipe, sections=sections,
                          trainer_defaults=_recipe_trainer_defaults(recipe, preset))
    if any(t in ("-h", "--help") for t in adapted):
        return parser, None, extras, recipe, notes
    try:
        cfg = parser.parse_args(adapted)
    except argparse.ArgumentError as err:
        raise ConfigurationError(_explain(parser, str(err), name, extras)) from None
    _whole_batch_limits(cfg)
    return parser, cfg, extras, recipe, notes


def recipe_config(recipe, preset: str | None, cfg) -> Any:
    """The recipe's config dataclass with the parsed sections' values."""
    config = recipe.default_config(preset)
    values = {}
    for f in dataclasses.fields(config):
        section = cfg.get(f.name)
        if section is not None:
            values.update(flatten(section.as_dict() if hasattr(section, "as_dict")
                                  else dict(section), f"{f.name}."))
    return apply_overrides(config, values, "command line")


def _whole_batch_limits(cfg) -> None:
    for key in ("limit_train_batches", "limit_val_batches"):
        value = cfg.trainer[key]
        # jsonargparse reads `2` as 2.0 for `int | float`; Lightning reads a whole float above
        # 1 as that many batches.
        if isinstance(value, float) and value > 1 and value.is_integer():
            cfg.trainer[key] = int(value)


def _describe(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"a class deriving from {', '.join(b.__name__ for b in obj.__bases__)}"
    if callable(obj):
        return f"a {type(obj).__name__}"
    return f"a {type(obj).__name__} ({obj!r:.60})"


def parse(command: str, spec: str, argv: Sequence[str]):
    """Parses a LightningCLI-form command: (parser, config, extras, classes, notes)."""
    extras, rest = _extras(list(argv))
    rest = _read_configs(translate_argv(rest), extras)
    if extras["preset"] is not None:
        raise ConfigurationError(
            f"--preset {extras['preset']}: presets belong to recipes; {spec} takes its "
            "defaults from its signatures (and --config files).")
    if extras["target"] is not None and not same_target(extras["target"], spec):
        raise ConfigurationError(
            f"config file: model.class_path is {extras['target']!r}, but the command line "
            f"names {spec!r}; drop one of them, or make them agree.")
    model_cls = import_object(spec, "target")

    if not (isinstance(model_cls, type) and issubclass(model_cls, TrainModule)):
        raise ConfigurationError(
            f"target {spec!r} is {_describe(model_cls)}, not a jaxlight.TrainModule subclass; "
            "name a class deriving from jl.TrainModule (a DataModule goes after --data).")
    data_cls = None
    if extras["data"] is not None:
        where, _, attr = extras["data"].rpartition(":")
        home = sys.modules.get(model_cls.__module__)
        same_file = where.endswith(".py") and os.path.abspath(where) == os.path.abspath(
            getattr(home, "__file__", "") or "")
        if where == "__main__":  # a LightningCLI script's own class: the target's file has it
            if not hasattr(home, attr):
                raise ConfigurationError(
                    f"config file: data.class_path is '__main__.{attr}', a class of the script "
                    f"that ran LightningCLI, but {spec} has no {attr!r}; give its file: --data "
                    f"PATH.py:{attr}.")
            same_file = True
        # One file is executed once, so that its classes are the same objects for both.
        data_cls = getattr(home, attr) if same_file and hasattr(home, attr) else \
            import_object(extras["data"], "--data")
        if not (isinstance(data_cls, type) and issubclass(data_cls, DataModule)) and not \
                inspect.isfunction(data_cls):
            raise ConfigurationError(
                f"--data {extras['data']!r} is {_describe(data_cls)}, not a jaxlight.DataModule "
                "subclass (or a function returning a DataModule).")
    modules = {}
    for obj in (model_cls, data_cls):
        module = register(obj) if obj is not None else None
        if module is not None:
            modules[module.__name__] = module
            modules[module.__name__.removeprefix("_jaxlight_target_")] = module
    notes = _Notes()
    adapted = _adapt_argv(rest, notes, modules)
    parser = build_parser(command, model_cls, data_cls)
    if any(t in ("-h", "--help") for t in adapted):
        return parser, None, extras, (model_cls, data_cls), notes
    try:
        cfg = parser.parse_args(adapted)
    except argparse.ArgumentError as err:
        raise ConfigurationError(_explain(parser, str(err), spec, extras)) from None
    _whole_batch_limits(cfg)
    return parser, cfg, extras, (model_cls, data_cls), notes


def printed_config(parser, cfg) -> str:
    """What `--print_config` prints: the parsed config in LightningCLI's shape, a user file's
    classes under the file's name (`model.Backbone`), ready for `--config`."""
    text = parser.dump(cfg, skip_unset=False)
    for name, module in list(sys.modules.items()):
        if name.startswith("_jaxlight_target_") and sys.modules.get(
                name.removeprefix("_jaxlight_target_")) is module:
            text = text.replace(f"class_path: {name}.",
                                f"class_path: {name.removeprefix('_jaxlight_target_')}.")
    return text


def _aliases_help() -> str:
    pairs = "\n".join(f"  --{old} = --{new}" for old, new in ALIASES.items())
    return ("jaxlight's own options:\n"
            "  --data PATH.py:NAME      your module's data (a DataModule, or a function "
            "returning one)\n"
            "  --devices N              simulate N CPU devices (set before JAX starts)\n"
            "  --preset NAME            a recipe's named defaults\n"
            "  --output FILE.npz        predict: save the predictions\n"
            "  --save_config_kwargs M   LightningCLI's save_config_kwargs, e.g. "
            "'{\"overwrite\": true}'\n"
            "  --save_config_callback null   save no config.yaml (LightningCLI's "
            "save_config_callback=None)\n\n"
            f"jaxlight's earlier options, read as these keys:\n{pairs}\n"
            "--logger takes csv,wandb,tensorboard or none (call form for arguments, e.g. "
            "\"wandb(project='demo')\");\n--callbacks \"EarlyStopping(monitor='val_loss'), "
            "file.py:Mine(n=2)\" appends to --trainer.callbacks.\n")


def _formatter():
    # jsonargparse loads only when a parser is built (see build_parser).
    from jsonargparse import DefaultHelpFormatter

    class Formatter(DefaultHelpFormatter):
        """Keeps the description's and the epilog's lines as written."""

        def _fill_text(self, text, width, indent):
            return "".join(indent + line for line in text.splitlines(keepends=True))

    return Formatter


def _explain(parser, message: str, spec: str, extras) -> str:
    """jsonargparse's error in jaxlight's words: the option or key, what it expects, the
    nearest valid name."""
    options = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")}
                     | {f"--{old}" for old in ALIASES})
    message = message.strip()
    hint = ""
    bad = re.match(r"unrecognized arguments: (\S+)", message)
    key = re.search(r"Group '([^']+)' does not accept option '([^']+)'", message)
    top = re.search(r"Option '([^']+)' is not accepted", message)
    typed = re.match(r'Parser key "([^"]+)"', message)
    given = re.search(r"(?:Given value|Got value): (.*?)(?:\.?$|\n)", message, re.M)
    typed = typed if given else None  # else jsonargparse's own words (a class not found, ...)
    if bad:
        name = _flag_name(bad.group(1))
        message = f"unknown option {name!r}"
        if name.startswith("-"):
            hint = f"{suggest(name, options)} Valid options: {', '.join(options)}."
        else:
            message = f"unexpected argument {name!r}; options take the form --name value"
    elif key or top:
        name = f"{key.group(1)}.{key.group(2)}" if key else top.group(1)
        files = ", ".join(extras.get("configs") or ["(none)"])
        message = f"config file {files}: unknown key {name!r}"
        keys = sorted({o[2:] for o in options if "-" not in o[2:]}
                      | {old.replace("-", "_") for old in ALIASES})
        hint = suggest(name, keys)
    elif typed:
        dest = typed.group(1)
        action = next((a for a in parser._actions if a.dest == dest), None)
        kind = getattr(action, "_typehint", None)
        value = given.group(1).strip()
        if value.endswith(".") and not value[:-1].replace(".", "").isdigit():
            value = value[:-1]
        message = f"--{dest} expects {type_name(kind) if kind is not None else 'another value'}" \
                  f", got {value!r}"
        if typing.get_origin(kind) is typing.Literal:
            hint = suggest(value, [str(v) for v in typing.get_args(kind)])
    if "are required" in message:
        hint = (" Give each on the command line (--model.NAME VALUE) or in a --config file's "
                "section. An argument typed as a class takes the class's name and its arguments "
                "(--model.backbone Backbone --model.backbone.hidden_dim 64), or class_path and "
                "init_args in a --config file.")
    data = f" --data {extras['data']}" if extras["data"] else ""
    command = parser.prog.split()[-1]
    return (f"jaxlight {command} {spec}{data}: {message}.{hint} See jaxlight {command} "
            f"{spec}{data} --help.")
