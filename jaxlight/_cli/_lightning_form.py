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
`_torch_optim`), `ckpt_path`. jsonargparse reads the values, config files (`--config`, a file
or its text), environment variables and `--help`; before it, the command line is read once
(`read_command_line`): jaxlight's own options taken out, the earlier options (`_aliases`)
renamed, and each config file loaded with a message naming its line, its earlier-form keys
renamed and Lightning's keys in their jaxlight meaning (`_lightning_keys`).
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
from collections.abc import Sequence
from typing import Any

import yaml

from jaxlight import Fit, callbacks, recipes
from jaxlight._cli import _aliases, _lightning_keys
from jaxlight._cli._config_file import load_config_file
from jaxlight._cli._lightning_keys import Notes
from jaxlight._cli._target import import_object, register, same_target
from jaxlight._errors import ConfigurationError, suggest
from jaxlight.data._datamodule import DataModule
from jaxlight.module._module import TrainModule
from jaxlight.optim.torch import TorchLRScheduler, TorchOptimizer
from jaxlight.recipes._base import apply_overrides, flatten, type_name

#: Every public callback and logger class, loaded: jsonargparse resolves a short class name
#: (`--trainer.logger CSVLogger`, `--trainer.callbacks+=EarlyStopping`) among the subclasses
#: already imported, and `jaxlight.callbacks` loads its classes on first use (PEP 562).
CALLBACK_CLASSES = tuple(getattr(callbacks, name) for name in callbacks.__all__)

#: jaxlight's own options, taken out before the parser reads the rest: `--data` (the
#: DataModule, which LightningCLI fixes in the script), `--output` (predict), `--devices`
#: (applied before JAX starts), `--preset`, LightningCLI's `save_config_*` and `--print_config`.
_EXTRAS = ("data", "output", "devices", "preset", "save_config_kwargs", "save_config_callback",
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
        option = name.startswith("--") and "." not in name
        key = name[2:].replace("-", "_") if option else None
        alias = _aliases.new_key(name[2:]) if option else None
        if key in _EXTRAS:
            if value is None and key != "print_config":
                raise ConfigurationError(f"{name} needs a value.")
            extras[key] = "" if value is None else value
        elif key == "config" and value is not None:
            tree, in_file = _aliases.translate_file(_read_config(value))
            found = {**in_file, **found}  # the first file naming one wins
            extras["configs"].append(value if os.path.isfile(value) else "(text)")
            items.append(("--config", tree))
        elif alias is not None:
            if value is None:
                raise ConfigurationError(f"{name} needs a value.")
            items += _aliases.option(alias, value)
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
        elif key in ("optimizer", "lr_scheduler"):
            value = _lightning_keys.TORCH_CLASS_PATHS.get(value, value)
        elif key.startswith("trainer.") and key[8:] in _lightning_keys.TRAINER_KEYS:
            keep, value = _lightning_keys.trainer_value(key[8:], _yaml_value(value), notes)
            if not keep:
                continue
        value = value if isinstance(value, str) else json.dumps(value, default=str)
        out += [f"{name}={value}"] if name.endswith("+") else [name, value]
    return out


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


# -- the parser -----------------------------------------------------------------------------------


def _parser(command: str, description: str):
    """The sections every run command starts with: `--config`, `--seed_everything` and
    `trainer` (`Fit`'s signature)."""
    # jsonargparse (with its type-hint machinery) loads only when a run command is parsed:
    # `jaxlight --help`, `devices` and `generate` start without it.
    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    class Formatter(DefaultHelpFormatter):
        """Keeps the description's and the epilog's lines as written."""

        def _fill_text(self, text, width, indent):
            return "".join(indent + line for line in text.splitlines(keepends=True))

    # env_prefix: LightningCLI's environment variables (PL_FIT__TRAINER__MAX_EPOCHS), read when
    # JSONARGPARSE_DEFAULT_ENV=true, as for a LightningCLI script.
    parser = ArgumentParser(prog=f"jaxlight {command}", exit_on_error=False,
                            epilog=_aliases.HELP, env_prefix=f"PL_{command.upper()}_",
                            formatter_class=Formatter, description=description)
    parser.add_argument("--config", action=ActionConfigFile,
                        help="a YAML/JSON config file (LightningCLI's, as it is) or its text")
    parser.add_argument("--seed_everything", type=bool | int, default=True,
                        help="seed of parameter initialization and every nnx.Rngs stream; true "
                             "draws one (as Lightning) and prints it, false uses 0")
    parser.add_class_arguments(Fit, "trainer", instantiate=False, fail_untyped=False,
                               sub_configs=True, skip={"seed"})
    return parser


def _add_tail(parser) -> None:
    """The keys every run command ends with: `--ckpt_path` and jaxlight's `--mesh_shape` and
    `--checkpoint_*`."""
    parser.add_argument("--mesh_shape", type=Any, default=None,
                        help="jaxlight: the mesh of strategies.Hybrid: '{\"data\": 2, \"fsdp\": "
                             "4}', 'data=2,fsdp=4' or the Tunix form '[[4,2],[\"fsdp\",\"tp\"]]' "
                             "(axes data, pipe, fsdp, context, expert, tp)")
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


def build_parser(command: str, model_cls: type, data_cls: Any | None):
    """The parser of `jaxlight <command> <module> --data <data>`: the `__init__` arguments of
    both as `model` and `data`, and LightningCLI's `--optimizer`/`--lr_scheduler`."""
    parser = _parser(command, (
        f"{(inspect.getdoc(model_cls) or '').strip()}\n\nLightningCLI's command line for "
        f"{model_cls.__qualname__}: values come from the signatures'\ndefaults, then --config "
        "files and flags in order."))
    parser.add_class_arguments(model_cls, "model", fail_untyped=False, sub_configs=True)
    if isinstance(data_cls, type):
        parser.add_class_arguments(data_cls, "data", fail_untyped=False, sub_configs=True)
    elif data_cls is not None:  # a function returning the DataModule: called after parsing
        parser.add_function_arguments(data_cls, "data", fail_untyped=False, sub_configs=True)
    parser.add_subclass_arguments(TorchOptimizer, "optimizer", required=False,
                                  help="torch.optim's SGD, Adam or AdamW (replaces the module's "
                                       "configure_optimizers, as in LightningCLI)")
    parser.add_subclass_arguments(TorchLRScheduler, "lr_scheduler", required=False,
                                  help="torch's StepLR or ExponentialLR (with --optimizer)")
    _add_tail(parser)
    return parser


def build_recipe_parser(command: str, recipe, preset: str | None):
    """The parser of `jaxlight <command> <recipe>`: the recipe's config sections (`model`,
    `data`, `optim`, ...) beside `trainer`, at the recipe's defaults with the preset's applied
    (its `fit:` values as `trainer` defaults)."""
    parser = _parser(command, (
        f"{recipe.summary}\n\nLightningCLI's command line for recipe {recipe.name!r}: values "
        "come from the recipe's defaults, then\n--preset, then --config files and flags in "
        "order."))
    trainer = dict(recipe.fit_defaults)
    if preset is not None:
        trainer.update({k.replace("-", "_"): v
                        for k, v in recipe.preset(preset).get("fit", {}).items()})
    parser.set_defaults({f"trainer.{k}": v for k, v in trainer.items()})
    config = recipe.default_config(preset)
    helps = {}
    for section in dataclasses.fields(config):
        value = getattr(config, section.name)
        parser.add_class_arguments(type(value), section.name, instantiate=False,
                                   fail_untyped=False, default=value)
        helps.update({f"{section.name}.{f.name}": f.metadata.get("help")
                      for f in dataclasses.fields(value)})
    for action in parser._actions:  # a recipe field's help, from its metadata
        action.help = helps.get(action.dest) or action.help
    # A recipe's runs repeat by default (seed 0, as `Fit`'s), where LightningCLI draws one.
    parser.set_defaults(seed_everything=0)
    _add_tail(parser)
    return parser


def _parse_args(parser, items, modules, spec: str, extras) -> tuple[Any, Notes]:
    """The parsed config (None for `--help`) and the Lightning keys met."""
    notes = Notes()
    argv = parser_argv(items, notes, modules)
    if any(t in ("-h", "--help") for t in argv):
        return None, notes
    try:
        cfg = parser.parse_args(argv)
    except argparse.ArgumentError as err:
        raise ConfigurationError(_explain(parser, str(err), spec, extras)) from None
    for key in ("limit_train_batches", "limit_val_batches"):
        value = cfg.trainer[key]
        # jsonargparse reads `2` as 2.0 for `int | float`; Lightning reads a whole float above
        # 1 as that many batches.
        if isinstance(value, float) and value > 1 and value.is_integer():
            cfg.trainer[key] = int(value)
    return cfg, notes


def parse_recipe(command: str, name: str, argv: Sequence[str]):
    """Parses `jaxlight <command> <recipe>` in LightningCLI's form: (parser, config, extras,
    recipe, notes); the config is None for `--help`."""
    recipe = recipes.get(name)
    items, extras = read_command_line(argv)
    parser = build_recipe_parser(command, recipe, extras["preset"])
    cfg, notes = _parse_args(parser, items, {}, name, extras)
    return parser, cfg, extras, recipe, notes


def parse(command: str, spec: str, argv: Sequence[str]):
    """Parses `jaxlight <command> PATH.py:Module [--data PATH.py:Data]` in LightningCLI's form:
    (parser, config, extras, (module class, data class), notes); the config is None for
    `--help`."""
    items, extras = read_command_line(argv)
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
    data_cls = None if extras["data"] is None else _data_class(extras["data"], model_cls, spec)
    modules = {}
    for obj in (model_cls, data_cls):
        module = register(obj) if obj is not None else None
        if module is not None:
            modules[module.__name__] = module
            modules[module.__name__.removeprefix("_jaxlight_target_")] = module
    parser = build_parser(command, model_cls, data_cls)
    cfg, notes = _parse_args(parser, items, modules, spec, extras)
    return parser, cfg, extras, (model_cls, data_cls), notes


def _data_class(data: str, model_cls: type, spec: str):
    """The DataModule class (or function) `--data` names; one file is executed once, so that
    its classes are the same objects for the module and the data."""
    where, _, attr = data.rpartition(":")
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
    data_cls = getattr(home, attr) if same_file and hasattr(home, attr) else \
        import_object(data, "--data")
    if not (isinstance(data_cls, type) and issubclass(data_cls, DataModule)) and not \
            inspect.isfunction(data_cls):
        raise ConfigurationError(
            f"--data {data!r} is {_describe(data_cls)}, not a jaxlight.DataModule subclass (or "
            "a function returning a DataModule).")
    return data_cls


def _describe(obj: Any) -> str:
    if inspect.isclass(obj):
        return f"a class deriving from {', '.join(b.__name__ for b in obj.__bases__)}"
    if callable(obj):
        return f"a {type(obj).__name__}"
    return f"a {type(obj).__name__} ({obj!r:.60})"


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


def _explain(parser, message: str, spec: str, extras) -> str:
    """jsonargparse's error in jaxlight's words: the option or key, what it expects, the
    nearest valid name."""
    options = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")}
                     | {f"--{old}" for old in _aliases.ALIASES})
    message = message.strip()
    hint = ""
    bad = re.match(r"unrecognized arguments: (\S+)", message)
    key = re.search(r"Group '([^']+)' does not accept option '([^']+)'", message)
    top = re.search(r"Option '([^']+)' is not accepted", message)
    typed = re.match(r'Parser key "([^"]+)"', message)
    given = re.search(r"(?:Given value|Got value): (.*?)(?:\.?$|\n)", message, re.M)
    typed = typed if given else None  # else jsonargparse's own words (a class not found, ...)
    if bad:
        name = bad.group(1).split("=", 1)[0]
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
                      | {old.replace("-", "_") for old in _aliases.ALIASES})
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
