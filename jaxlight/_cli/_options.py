"""The command line's options: the run-option table, the recipe parser, config files, and
resolving recipe, preset, config file and flags into one set of values."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import yaml

from jaxlight import Fit, recipes
from jaxlight._cli._build import parse_mesh_shape
from jaxlight._errors import ConfigurationError, suggest
from jaxlight.recipes._base import apply_overrides, convert, fields, flatten, get_path, type_name

COMMANDS = {
    "fit": "train a recipe (then report its final validation metrics)",
    "validate": "run a recipe's validation data through a model (from --ckpt-path)",
    "test": "run a recipe's test data through a model (from --ckpt-path)",
    "devices": "print devices, process index and count, and the mesh a strategy builds",
    "launch": "start N local processes of a command (multi-process training on one machine)",
}



@dataclasses.dataclass(frozen=True)
class _Opt:
    """A run option that is not a recipe config field (mostly a `Fit` keyword)."""

    name: str
    type: Any
    default: Any
    help: str
    fit_kwarg: bool = True


#: Every run option. Defaults of `Fit` keywords are read from `Fit`'s signature when they are
#: not given here, so the help never disagrees with the code.
RUN_OPTIONS: tuple[_Opt, ...] = (
    _Opt("strategy", str, "auto",
         "strategy by name: auto, single, ddp, dp, fsdp, tp, gpipe, hybrid, or a class of "
         "jaxlight.strategies; arguments in call form, e.g. 'tp(size=4)', "
         "'gpipe(stages=4, microbatches=8)'", fit_kwarg=False),
    _Opt("mesh_shape", str | None, None,
         "mesh for strategies.Hybrid: '{\"data\": 2, \"fsdp\": 4}', 'data=2,fsdp=4' or the Tunix "
         "form '[[4,2],[\"fsdp\",\"tp\"]]' (axes data, pipe, fsdp, tp; aliases model, pipeline)",
         fit_kwarg=False),
    _Opt("devices", int | None, None,
         "simulate this many CPU devices per process (sets XLA_FLAGS before JAX starts)",
         fit_kwarg=False),
    _Opt("precision", str | None, None, "'bf16-mixed', 'bf16-true' or '32-true' "
         "(callbacks.MixedPrecision)"),
    _Opt("accumulate_grad_batches", int, None,
         "microbatches per optimizer step (callbacks.GradientAccumulation)"),
    _Opt("gradient_clip_val", float | None, None, "clip gradients to this global norm"),
    _Opt("gradient_clip_algorithm", str, None, "'norm' or 'value'"),
    _Opt("max_steps", int | None, None, "optimizer steps to take"),
    _Opt("max_epochs", int | None, None, "passes over the training data"),
    _Opt("val_check_interval", int | float | None, None,
         "validate every N steps (int) or this fraction of an epoch (float)"),
    _Opt("check_val_every_n_epoch", int | None, None, "epochs between end-of-epoch validations"),
    _Opt("limit_train_batches", int | float | None, None, "training batches per epoch"),
    _Opt("limit_val_batches", int | float | None, None, "validation batches per validation"),
    _Opt("num_sanity_val_steps", int, None,
         "validation batches run before training to catch errors early (-1: all, 0: none)"),
    _Opt("log_every_n_steps", int, None, "steps between metric reads and logger writes"),
    _Opt("enable_progress_bar", bool, None, "show the tqdm progress bar"),
    _Opt("enable_model_summary", bool, None, "print the parameter table at fit start"),
    _Opt("logger", str, "csv",
         "comma-separated loggers: csv, wandb, tensorboard (call form for arguments, e.g. "
         "\"wandb(project='demo')\"), or none", fit_kwarg=False),
    _Opt("callbacks", str | None, None,
         "extra jaxlight.callbacks in call form, comma-separated, e.g. "
         "\"EarlyStopping(monitor='val_loss', patience=3)\"", fit_kwarg=False),
    _Opt("checkpoint_every_n_steps", int | None, None,
         "save a checkpoint every N steps under <default_root_dir>/checkpoints "
         "(callbacks.ModelCheckpoint)", fit_kwarg=False),
    _Opt("ckpt_path", str | None, None,
         "checkpoint to resume from (fit) or to evaluate (validate, test): a path, 'last' or "
         "'best'", fit_kwarg=False),
    _Opt("default_root_dir", str, None, "where logs and checkpoints are written"),
    _Opt("seed", int, None, "seeds parameter initialization and every nnx.Rngs stream"),
    _Opt("compilation_cache", str | None, None, "directory of the persistent compilation cache "
         "(default $JAXLIGHT_COMPILATION_CACHE, else ~/.cache/jaxlight/xla), or 'off'"),
    _Opt("fast_dev_run", int, 0, "run N training and validation batches, no loggers (0: off)"),
)

_CLI_ONLY = {
    "config": "read options from a YAML or JSON file (command-line options win)",
    "preset": "a named set of defaults of the recipe",
    "print_config": "print the resolved options as YAML (usable with --config) and exit",
}


def fit_signature_defaults() -> dict[str, Any]:
    params = inspect.signature(Fit.__init__).parameters
    return {name: p.default for name, p in params.items()
            if p.default is not inspect.Parameter.empty}


def run_option_defaults() -> dict[str, Any]:
    """Every run option's default (Fit's own defaults where the table leaves them open)."""
    fit_defaults = fit_signature_defaults()
    out = {}
    for opt in RUN_OPTIONS:
        out[opt.name] = opt.default
        if opt.default is None and opt.fit_kwarg and opt.name in fit_defaults:
            out[opt.name] = fit_defaults[opt.name]
    return out


# -- errors and argument parsing -----------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse that raises ConfigurationError instead of exiting, so messages stay ours."""

    def error(self, message: str):
        raise ConfigurationError(f"{self.prog}: {message}")


def _flag(name: str) -> str:
    """The command-line spelling of an option name (`max_steps` -> `--max-steps`)."""
    return "--" + (name if "." in name else name.replace("_", "-"))


def normalize_argv(argv: Sequence[str]) -> list[str]:
    """Accepts `--max_steps` and `--model.num-layers` as well as the canonical spellings."""
    out = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token[2:].partition("=")
            if "." in name:
                section, _, field = name.rpartition(".")
                name = f"{section}.{field.replace('-', '_')}"
            else:
                name = name.replace("_", "-")
            token = f"--{name}{eq}{value}"
        out.append(token)
    return out


def _esc(text: str) -> str:
    """argparse %-formats help strings."""
    return text.replace("%", "%%")


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return repr(value) if value == "" or " " in value else value
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return str(value)


def _recipe_parser(command: str, recipe, defaults: dict[str, Any], config_defaults: Any):
    parser = Parser(
        prog=f"jaxlight {command} {recipe.name}",
        usage=f"jaxlight {command} {recipe.name} [options]",
        description=(f"{recipe.summary}\n\n{COMMANDS[command]}. Values come from the recipe's "
                    "defaults, then --preset, then --config FILE, then the command line."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
        add_help=False,
    )
    general = parser.add_argument_group("options")
    general.add_argument("-h", "--help", action="store_true", help="show this message and exit")
    general.add_argument("--config", metavar="FILE", help=_CLI_ONLY["config"])
    if recipe.presets:
        general.add_argument("--preset", metavar="NAME",
                             help=f"{_CLI_ONLY['preset']}: {', '.join(recipe.presets)} "
                                  "(default: none)")
    general.add_argument("--print-config", action="store_true", help=_CLI_ONLY["print_config"])
    run = parser.add_argument_group("fit options")
    for opt in RUN_OPTIONS:
        run.add_argument(_flag(opt.name), dest=opt.name, metavar=type_name(opt.type).upper()
                         .replace(" | NONE", "").replace(" ", ""),
                         help=_esc(f"{opt.help} (default: {_fmt(defaults[opt.name])})"))
    for dotted, field in fields(type(config_defaults)).items():
        section = dotted.split(".")[0]
        group = next((g for g in parser._action_groups if g.title == f"{section}.*"), None)
        if group is None:
            group = parser.add_argument_group(f"{section}.*", f"recipe config section {section!r}")
        help_text = field.metadata.get("help", "")
        group.add_argument(_flag(dotted), dest=dotted, metavar=type_name(field.type)
                           .upper().replace(" ", ""),
                           help=_esc(f"{help_text} (default: "
                                    f"{_fmt(get_path(config_defaults, dotted))})"))
    return parser


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


# -- config files --------------------------------------------------------------------------------


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


def _split_file_options(path: str, data: dict[str, Any], recipe, config) -> tuple[dict, dict]:
    """Splits a config file into run options and recipe config overrides."""
    run_names = {o.name for o in RUN_OPTIONS} | {"preset"}
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
            raise ConfigurationError(
                f"config file {path}{_line_of(path, str(key))}: unknown key {key!r}."
                f"{suggest(name, valid)} Valid top-level keys: {', '.join(valid)} (recipe "
                f"sections hold mappings, e.g. `{sorted(sections)[0]}: {{...}}`)."
            )
    return run, cfg



def _convert(name: str, value: Any, kind: Any, where: str) -> Any:
    """A run option's value from a flag or a config file; a mesh shape goes through the one
    mesh grammar (so YAML may give it as a real list or mapping, not only as text)."""
    if name == "mesh_shape" and value is not None:
        if isinstance(value, str) and value.strip().lower() in ("none", "null"):
            return None
        return parse_mesh_shape(value, where)
    return convert(value, kind, where)


def resolve(command: str, recipe_name: str, argv: Sequence[str]):
    """Parses a recipe command's options: (recipe, config, options, parser, flags)."""
    recipe = recipes.get(recipe_name)
    argv = normalize_argv(argv)
    base_defaults = {**run_option_defaults(), **recipe.fit_defaults}
    # First pass: --preset and --config decide the defaults the help shows.
    pre = Parser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset")
    pre.add_argument("--config")
    early, _ = pre.parse_known_args(argv)
    file_run: dict[str, Any] = {}
    file_cfg: dict[str, Any] = {}
    preset = early.preset
    config = recipe.config()
    if early.config:
        data = load_config_file(early.config)
        file_run, file_cfg = _split_file_options(early.config, data, recipe, config)
        preset = preset or file_run.pop("preset", None)
        file_run.pop("preset", None)
    defaults = dict(base_defaults)
    if preset is not None:
        config = recipe.default_config(preset)
        defaults.update({k.replace("-", "_"): v for k, v in recipe.preset(preset)
                         .get("fit", {}).items()})
    types = {o.name: o.type for o in RUN_OPTIONS}
    for name, value in file_run.items():
        defaults[name] = _convert(name, value, types[name], f"config file {early.config}: {name}")
    config = apply_overrides(config, file_cfg, f"config file {early.config}")

    parser = _recipe_parser(command, recipe, defaults, config)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        unknown_option_error(parser, unknown)
    flags = vars(args)
    options = dict(defaults)
    for opt in RUN_OPTIONS:
        if flags.get(opt.name) is not None:
            options[opt.name] = _convert(opt.name, flags[opt.name], opt.type, _flag(opt.name))
    known = fields(type(config))
    overrides = {k: flags[k] for k in known if flags.get(k) is not None}
    config = apply_overrides(config, {k: v for k, v in overrides.items()}, "command line")
    options["preset"] = preset
    return recipe, config, options, parser, flags
