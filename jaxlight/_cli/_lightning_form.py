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
(`_argv`): jaxlight's own options taken out, the earlier forms renamed, each config file
loaded with a message naming its line, Lightning's keys in their jaxlight meaning.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import typing
from collections.abc import Sequence
from typing import Any

from jaxlight import Fit, callbacks, recipes
from jaxlight._cli import _argv, _lightning_keys
from jaxlight._cli._argv import parser_argv, read_command_line
from jaxlight._cli._lightning_keys import Notes
from jaxlight._cli._target import import_object, register, same_target
from jaxlight._errors import ConfigurationError, suggest
from jaxlight.data._datamodule import DataModule
from jaxlight.module._module import TrainModule
from jaxlight.optim.torch import TorchLRScheduler, TorchOptimizer
from jaxlight.recipes._base import type_name

#: Every public callback and logger class, loaded: jsonargparse resolves a short class name
#: (`--trainer.logger CSVLogger`, `--trainer.callbacks+=EarlyStopping`) among the subclasses
#: already imported, and `jaxlight.callbacks` loads its classes on first use (PEP 562).
CALLBACK_CLASSES = tuple(getattr(callbacks, name) for name in callbacks.__all__)

# -- the parser -----------------------------------------------------------------------------------


def _parser(command: str, description: str):
    """The sections every run command starts with: `--config`, `--seed_everything` and
    `trainer` (`Fit`'s signature)."""
    # jsonargparse (with its type-hint machinery) loads only when a run command is parsed:
    # `jaxlight --help`, `devices` and `generate` start without it.
    from jsonargparse import ActionConfigFile, ArgumentParser, DefaultHelpFormatter

    class Parser(ArgumentParser):
        """jsonargparse's parser with LightningCLI's `add_lightning_class_args`, for a module's
        `add_arguments_to_parser(parser)` (a LightningCLI subclass's method, ported)."""

        def add_lightning_class_args(self, cls, nested_key: str, subclass_mode: bool = False,
                                     required: bool = True):
            """A callback's arguments as the section `nested_key`; the callback built from them
            joins the fit's callbacks (LightningCLI's meaning)."""
            if not (isinstance(cls, type) and issubclass(cls, callbacks.Callback)):
                raise ConfigurationError(
                    f"add_lightning_class_args({cls!r}, {nested_key!r}): jaxlight adds "
                    "callbacks this way (a subclass of jaxlight.callbacks.Callback); add "
                    "other classes with parser.add_class_arguments.")
            self.callback_sections.append(nested_key)
            if subclass_mode:
                return self.add_subclass_arguments(cls, nested_key, required=required)
            return self.add_class_arguments(cls, nested_key, fail_untyped=False,
                                            sub_configs=True)

    class Formatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
        """Keeps the description's and the epilog's lines as written."""

    # env_prefix: LightningCLI's environment variables (PL_FIT__TRAINER__MAX_EPOCHS), read when
    # JSONARGPARSE_DEFAULT_ENV=true, as for a LightningCLI script.
    # allow_abbrev=False: argparse read `--trainer.max_step 7` as max_steps, silently.
    parser = Parser(prog=f"jaxlight {command}", exit_on_error=False, allow_abbrev=False,
                            epilog=_argv.HELP, env_prefix=f"PL_{command.upper()}_",
                            formatter_class=Formatter, description=description)
    parser.callback_sections = []  # add_lightning_class_args's sections
    parser.add_argument("--config", action=ActionConfigFile,
                        help="a YAML/JSON config file (LightningCLI's, as it is) or its text")
    parser.add_argument("--seed_everything", type=bool | int, default=True,
                        help="seed of parameter initialization and every nnx.Rngs stream; true "
                             "draws one (as Lightning) and prints it, false uses 0")
    parser.add_class_arguments(Fit, "trainer", instantiate=False, fail_untyped=False,
                               sub_configs=True, skip={"seed"})
    return parser


def _add_tail(parser) -> None:
    """The keys every run command ends with: `--ckpt_path`, `--weights_only`, and jaxlight's
    `--devices`, `--mesh_shape` and `--checkpoint_*`."""
    parser.add_argument("--devices", type=int | None, default=None,
                        help="jaxlight: simulate N CPU devices (set before JAX starts; a config "
                             "file's devices: too)")
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
    parser.add_argument("--weights_only", type=bool | None, default=None,
                        help="Lightning's torch.load switch for --ckpt_path: jaxlight's "
                             "checkpoints hold no pickles, so every value loads the same")


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
    # A LightningCLI subclass's add_arguments_to_parser, ported as a function of the module's
    # file: its sections, links (jsonargparse's link_arguments) and defaults.
    hook = getattr(sys.modules.get(model_cls.__module__), "add_arguments_to_parser", None)
    if callable(hook):
        hook(parser)
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
        parser.add_class_arguments(type(value), section.name, fail_untyped=False, default=value)
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
        raise ConfigurationError(_explain(parser, str(err), spec, extras,
                                          _unknown_keys(parser, items, modules))) from None
    return cfg, notes


def _unknown_keys(parser, items, modules) -> list[str]:
    """Every key of the `--config` files that the parser does not take (jsonargparse names the
    first only): a key with no parser key at or above it."""
    # A section (`trainer`, `model`) is read key by key; any other key takes what it holds.
    sections = {a.dest for a in parser._actions if type(a).__name__ == "_ActionConfigLoad"}
    keys = {a.dest for a in parser._actions} - sections
    unknown: list[str] = []

    def walk(tree: dict, prefix: str) -> None:
        for name, value in tree.items():
            key = f"{prefix}{name}"
            if key in keys:
                continue
            if isinstance(value, dict) and (
                    key in sections or any(k.startswith(f"{key}.") for k in keys)):
                walk(value, f"{key}.")
            else:
                unknown.append(key)

    for name, tree in items:
        if name == "--config":
            walk(_lightning_keys.adapt_config(tree, Notes(), modules), "")
    return unknown


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


def recipe_config(recipe, preset: str | None, init) -> Any:
    """The recipe's config dataclass with the sections jsonargparse built (`init`)."""
    config = recipe.default_config(preset)
    return dataclasses.replace(config, **{f.name: init[f.name] for f in dataclasses.fields(config)})


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


def _explain(parser, message: str, spec: str, extras, unknown: Sequence[str] = ()) -> str:
    """jsonargparse's error in jaxlight's words: the option or key, what it expects, the
    nearest valid name."""
    options = sorted({s for a in parser._actions for s in a.option_strings if s.startswith("--")}
                     | {f"--{old}" for old in _argv.ALIASES})
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
        keys = sorted({o[2:] for o in options if "-" not in o[2:]}
                      | {old.replace("-", "_") for old in _argv.ALIASES})
        if ":" in spec and any("." not in k for k in unknown or [name]):
            hint = (" A section that a LightningCLI subclass added (add_arguments_to_parser) "
                    "needs that method as a function add_arguments_to_parser(parser) of the "
                    "module's file (docs/cli.md, LightningCLI's form).")
        if len(unknown) > 1:
            named = (f"{k!r}{suggest(k, keys).replace(' Did', ' (did').replace('?', '?)')}"
                     for k in unknown)
            message = f"config file {files}: unknown keys {', '.join(named)}"
        else:
            name = unknown[0] if unknown else name  # a whole section, where it is one
            message = f"config file {files}: unknown key {name!r}"
            hint = suggest(name, keys) + hint
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
