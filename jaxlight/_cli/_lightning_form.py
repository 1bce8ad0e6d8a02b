"""LightningCLI's command line, built with jsonargparse from type hints, for the user's own module.

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
import sys
import typing
import warnings
from collections.abc import Sequence
from typing import Any

import yaml

from jaxlight import Fit, callbacks
from jaxlight._cli._config_file import load_config_file
from jaxlight._cli._target import import_object
from jaxlight._errors import ConfigurationError, suggest
from jaxlight._module import TrainModule
from jaxlight._porting import TRAINER_ARGS
from jaxlight.data._datamodule import DataModule
from jaxlight.optim.torch import TORCH_PATHS, TorchLRScheduler, TorchOptimizer

#: Command-line tokens and config-file keys that only LightningCLI's form has.
_FORM_FLAGS = ("--trainer", "--seed_everything", "--optimizer", "--lr_scheduler")
_FORM_KEYS = ("trainer", "seed_everything", "optimizer", "lr_scheduler")

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

#: Today's dashed options and their LightningCLI form (`None`: no one-to-one form; the message
#: names what to write instead).
_DASHED = {
    "--max-steps": "--trainer.max_steps", "--max-epochs": "--trainer.max_epochs",
    "--precision": "--trainer.precision", "--strategy": "--trainer.strategy",
    "--accumulate-grad-batches": "--trainer.accumulate_grad_batches",
    "--gradient-clip-val": "--trainer.gradient_clip_val",
    "--gradient-clip-algorithm": "--trainer.gradient_clip_algorithm",
    "--val-check-interval": "--trainer.val_check_interval",
    "--check-val-every-n-epoch": "--trainer.check_val_every_n_epoch",
    "--limit-train-batches": "--trainer.limit_train_batches",
    "--limit-val-batches": "--trainer.limit_val_batches",
    "--num-sanity-val-steps": "--trainer.num_sanity_val_steps",
    "--log-every-n-steps": "--trainer.log_every_n_steps",
    "--enable-progress-bar": "--trainer.enable_progress_bar",
    "--enable-model-summary": "--trainer.enable_model_summary",
    "--default-root-dir": "--trainer.default_root_dir",
    "--fast-dev-run": "--trainer.fast_dev_run",
    "--compilation-cache": "--trainer.compilation_cache",
    "--seed": "--seed_everything", "--ckpt-path": "--ckpt_path",
    "--print-config": "--print_config",
    "--logger": "--trainer.logger CSVLogger (or WandbLogger, TensorBoardLogger, false)",
    "--callbacks": "--trainer.callbacks+=Name --trainer.callbacks.ARG VALUE",
    "--checkpoint-every-n-steps": "--trainer.callbacks+=ModelCheckpoint "
                                  "--trainer.callbacks.dirpath DIR "
                                  "--trainer.callbacks.every_n_steps N",
    "--checkpoint-monitor": "--trainer.callbacks+=ModelCheckpoint "
                            "--trainer.callbacks.dirpath DIR --trainer.callbacks.monitor NAME",
    "--checkpoint-mode": "--trainer.callbacks.mode min|max (after "
                         "--trainer.callbacks+=ModelCheckpoint)",
    "--mesh-shape": "--trainer.strategy \"hybrid(mesh_shape={'data': 2, 'fsdp': 4})\"",
}


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def uses_lightning_form(argv: Sequence[str]) -> bool:
    """Whether a command is written in LightningCLI's form: a `--trainer.*`,
    `--seed_everything`, `--optimizer` or `--lr_scheduler` flag, a nested `--model.a.b` /
    `--data.a.b`, or a `--config` file with LightningCLI's keys (`trainer:`,
    `seed_everything:`, ...) or `init_args`."""
    for i, token in enumerate(argv):
        name = _flag_name(token)
        if name.startswith(_FORM_FLAGS) or name.endswith("+"):
            return True
        if name.startswith(("--model.", "--data.")) and name.count(".") > 1:
            return True
        if name == "--config" and i + 1 < len(argv) and os.path.isfile(argv[i + 1]):
            data = load_config_file(argv[i + 1])
            if any(k in data for k in _FORM_KEYS) or "init_args" in json.dumps(data, default=str):
                return True
    return False


def has_class_parameters(cls: Any) -> bool:
    """Whether a class's `__init__` has a parameter typed as a class (only the LightningCLI
    form can set it: `--model.backbone Backbone` or `class_path`/`init_args`)."""

    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: not a class we can build
        return False
    for name, kind in hints.items():
        if name == "return":
            continue
        for arg in (kind, *typing.get_args(kind)):
            # A path or a container is a value, not a class to choose.
            if inspect.isclass(arg) and typing.get_origin(arg) is None and getattr(
                    arg, "__module__", "") not in ("builtins", "os", "pathlib", "typing",
                                                   "collections.abc", "numpy"):
                return True
    return False


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
    trainer flags in their jaxlight meaning; today's dashed options get their new form or a
    message naming it."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name in _DASHED:
            new = _DASHED[name]
            if " " in new:
                raise ConfigurationError(
                    f"{name} is jaxlight's earlier option; in LightningCLI's form write {new}.")
            out.append(new + (eq + inline if eq else ""))
            i += 1
            continue
        if name == "--config" and (eq or i + 1 < len(argv)):
            path = inline if eq else argv[i + 1]
            # A file, or the config's text itself (as jsonargparse takes it).
            text = None if os.path.isfile(path) else _yaml_value(path)
            if text is not None and not isinstance(text, dict):
                load_config_file(path)  # neither a file nor a mapping: says no such file
            data = adapt_config(text if text is not None else load_config_file(path), notes,
                                modules)
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
                                    "print_config": None, "preset": None}
    rest = []
    i = 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key == "print_config":
            found["print_config"] = inline if eq else ""
            i += 1
            continue
        if key in ("data", "output", "devices", "preset"):
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


def _register(obj: Any) -> Any:
    """Makes a class loaded from a user's file importable under its file's name too, so that
    jsonargparse's `class_path` (`model.Backbone`) finds the same classes."""
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    if module is not None and module.__name__.startswith("_jaxlight_target_"):
        stem = module.__name__[len("_jaxlight_target_"):]
        known = sys.modules.get(stem)
        if known is None or getattr(known, "__name__", "").startswith("_jaxlight_target_"):
            sys.modules[stem] = module  # (a file loaded earlier under that name: the newest)
    return module


def build_parser(command: str, model_cls: type | None, data_cls: Any | None, *,
                 recipe: Any = None, sections: dict[str, Any] | None = None,
                 trainer_defaults: dict[str, Any] | None = None):
    """The jsonargparse parser of `jaxlight <command> <module> --data <data>` (or of a recipe,
    whose config `sections` replace `model`/`data`) in LightningCLI's form."""
    # jsonargparse (with its type-hint machinery) loads only when the LightningCLI form runs:
    # `jaxlight --help`, recipes and the dashed form start without it.
    from jsonargparse import ActionConfigFile, ArgumentParser


    parser = ArgumentParser(
        prog=f"jaxlight {command}", exit_on_error=False,
        description=(f"LightningCLI's command line for {model_cls.__qualname__}: values come "
                     "from the signatures' defaults, then --config files and flags in order."
                     if recipe is None else
                     f"{recipe.summary}\n\nLightningCLI's command line for recipe "
                     f"{recipe.name!r}: values come from the recipe's defaults, then --preset, "
                     "then --config files and flags in order."))
    parser.add_argument("--config", action=ActionConfigFile,
                        help="a YAML/JSON config file (LightningCLI's, as it is) or its text")
    parser.add_argument("--seed_everything", type=bool | int, default=True,
                        help="seed of parameter initialization and every nnx.Rngs stream; true "
                             "draws one (as Lightning) and prints it, false uses 0")
    parser.add_class_arguments(Fit, "trainer", instantiate=False, fail_untyped=False,
                               sub_configs=True, skip={"seed"})
    if trainer_defaults:
        parser.set_defaults({f"trainer.{k}": v for k, v in trainer_defaults.items()})
    if recipe is not None:
        for name, value in (sections or {}).items():
            parser.add_class_arguments(type(value), name, instantiate=False,
                                       fail_untyped=False)
            parser.set_defaults({f"{name}.{f.name}": getattr(value, f.name)
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


def _add_common_tail(parser, with_optimizer: bool) -> None:
    """`--optimizer`/`--lr_scheduler` (a module's; a recipe has its `optim` section) and
    `--ckpt_path`."""
    if with_optimizer:
        _add_optimizer(parser)
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
    from jaxlight import recipes

    extras, rest = _extras(list(argv))
    recipe = recipes.get(name)
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
    from jaxlight.recipes._base import apply_overrides, flatten

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


def parse(command: str, spec: str, argv: Sequence[str]):
    """Parses a LightningCLI-form command: (parser, config, extras, classes, notes)."""
    extras, rest = _extras(list(argv))
    if extras["preset"] is not None:
        raise ConfigurationError(
            f"--preset {extras['preset']}: presets belong to recipes; {spec} takes its "
            "defaults from its signatures (and --config files).")
    model_cls = import_object(spec, "target")

    if not (isinstance(model_cls, type) and issubclass(model_cls, TrainModule)):
        raise ConfigurationError(
            f"target {spec!r} is not a jaxlight.TrainModule subclass; name a class deriving "
            "from jl.TrainModule (a DataModule goes after --data).")
    data_cls = None
    if extras["data"] is not None:
        where, _, attr = extras["data"].rpartition(":")
        home = sys.modules.get(model_cls.__module__)
        same_file = where.endswith(".py") and os.path.abspath(where) == os.path.abspath(
            getattr(home, "__file__", "") or "")
        # One file is executed once, so that its classes are the same objects for both.
        data_cls = getattr(home, attr) if same_file and hasattr(home, attr) else \
            import_object(extras["data"], "--data")
        if not (isinstance(data_cls, type) and issubclass(data_cls, DataModule)) and not \
                callable(data_cls):
            raise ConfigurationError(
                f"--data {extras['data']!r} is not a jaxlight.DataModule subclass (or a "
                "function returning one).")
    modules = {}
    for obj in (model_cls, data_cls):
        module = _register(obj) if obj is not None else None
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


def _explain(parser, message: str, spec: str, extras) -> str:
    options = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")})
    hint = ""
    if "unrecognized arguments" in message:
        bad = message.split(":", 1)[1].split()[0] if ":" in message else ""
        hint = suggest(_flag_name(bad), options)
    if "are required" in message:
        hint = (" An argument typed as a class takes the class's name and its arguments "
                "(--model.backbone Backbone --model.backbone.hidden_dim 64), or class_path and "
                "init_args in a --config file.")
    data = f" --data {extras['data']}" if extras["data"] else ""
    return (f"jaxlight {parser.prog.split()[-1]} {spec}{data}: {message.strip()}.{hint} See "
            f"jaxlight {parser.prog.split()[-1]} {spec}{data} --help.")
