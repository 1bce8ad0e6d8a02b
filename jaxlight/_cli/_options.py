"""The command line's options: the run-option table, the recipe parser, config files, and
resolving recipe, preset, config file and flags into one set of values."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

from jaxlight import Fit, recipes
from jaxlight._cli._build import parse_mesh_shape
from jaxlight._cli._config_file import load_config_file, split_file_options
from jaxlight._cli._target import (
    TargetRecipe,
    is_target,
    load_target,
    same_target,
    take_class_paths,
)
from jaxlight._errors import ConfigurationError, suggest
from jaxlight.recipes._base import apply_overrides, convert, fields, get_path, type_name

COMMANDS = {
    "fit": "train a recipe or your module (then report its final validation metrics)",
    "validate": "run the validation data through a model (from --ckpt-path)",
    "test": "run the test data through a model (from --ckpt-path)",
    "predict": "run predict_step over the prediction data (from --ckpt-path); --output saves it",
    "generate": "sample from a Hugging Face model directory (Llama 3, Qwen 2/3, Gemma 3) with "
                "a key/value cache: jaxlight generate PATH --prompt TEXT",
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
         "form '[[4,2],[\"fsdp\",\"tp\"]]' (axes data, pipe, fsdp, context, tp; aliases "
         "model, pipeline, sequence)",
         fit_kwarg=False),
    _Opt("devices", int | None, None,
         "simulate this many CPU devices per process (sets XLA_FLAGS before JAX starts)",
         fit_kwarg=False),
    _Opt("precision", str | None, None, "'bf16-mixed', 'bf16-true' or '32-true' "
         "(callbacks.MixedPrecision)"),
    _Opt("accumulate_grad_batches", int, None,
         "loader batches per optimizer step (callbacks.GradientAccumulation)"),
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
    _Opt("checkpoint_monitor", str | None, None,
         "rank checkpoints by this metric (e.g. val_loss), so that --ckpt-path best finds the "
         "best; saves at every epoch's end without --checkpoint-every-n-steps", fit_kwarg=False),
    _Opt("checkpoint_mode", str, "min", "'min' or 'max': which --checkpoint-monitor values are "
         "better", fit_kwarg=False),
    _Opt("ckpt_path", str | None, None,
         "checkpoint to resume from (fit) or to run (validate, test, predict): a path, 'last' "
         "or 'best'", fit_kwarg=False),
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
    "data": "your data: PATH.py:NAME or package.module:NAME, a jaxlight.DataModule subclass or "
            "a function returning one; its __init__ arguments become --data.<name> options",
    "output": "save the predictions to this .npz file (one array per output, batches "
              "concatenated)",
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
            # LightningCLI's spellings of a run option: --trainer.max_steps, --seed_everything.
            if name.startswith("trainer.") and name.count(".") == 1:
                name = name[len("trainer."):]
            elif name == "seed_everything":
                name = "seed"
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
    target = isinstance(recipe, TargetRecipe)
    parser = Parser(
        prog=f"jaxlight {command} {recipe.name}",
        usage=f"jaxlight {command} {recipe.name} [options]",
        description=(f"{recipe.summary}\n\n{COMMANDS[command]}. Values come from the "
                     f"{'signatures' if target else 'recipe'}' defaults, then "
                     f"{'' if target else '--preset, then '}--config FILE, then the command "
                     "line."),
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
    if target:
        general.add_argument("--data", metavar="PATH:NAME", help=_esc(_CLI_ONLY["data"]))
    if command == "predict":
        general.add_argument("--output", metavar="FILE.npz", help=_CLI_ONLY["output"])
    run = parser.add_argument_group("fit options")
    for opt in RUN_OPTIONS:
        run.add_argument(_flag(opt.name), dest=opt.name, metavar=type_name(opt.type).upper()
                         .replace(" | NONE", "").replace(" ", ""),
                         help=_esc(f"{opt.help} (default: {_fmt(defaults[opt.name])})"))
    for dotted, field in fields(type(config_defaults)).items():
        section = dotted.split(".")[0]
        group = next((g for g in parser._action_groups if g.title == f"{section}.*"), None)
        if group is None:
            group = parser.add_argument_group(
                f"{section}.*", recipe.notes[section] if target
                else f"recipe config section {section!r}")
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


def _convert(name: str, value: Any, kind: Any, where: str) -> Any:
    """A run option's value from a flag or a config file; a mesh shape goes through the one
    mesh grammar (so YAML may give it as a real list or mapping, not only as text)."""
    if name == "mesh_shape" and value is not None:
        if isinstance(value, str) and value.strip().lower() in ("none", "null"):
            return None
        return parse_mesh_shape(value, where)
    return convert(value, kind, where)


def resolve(command: str, recipe_name: str, argv: Sequence[str]):
    """Parses a command's options: (recipe, config, options, parser, flags). `recipe_name` is a
    registered recipe, or user code (`PATH.py:Module`, with `--data PATH.py:Data`)."""
    argv = normalize_argv(argv)
    # First pass: --preset, --config and --data decide the options and the defaults shown.
    pre = Parser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset")
    pre.add_argument("--config")
    pre.add_argument("--data")
    early, _ = pre.parse_known_args(argv)
    data = load_config_file(early.config) if early.config else {}
    if is_target(recipe_name):
        paths = take_class_paths(data)
        if "model" in paths and not same_target(paths["model"], recipe_name):
            raise ConfigurationError(
                f"config file {early.config}: model.class_path is {paths['model']!r}, but the "
                f"command line names {recipe_name!r}; drop one of them, or make them agree."
            )
        recipe = load_target(recipe_name, early.data or paths.get("data"))
    else:
        recipe = recipes.get(recipe_name)
    base_defaults = {**run_option_defaults(), **recipe.fit_defaults}
    file_run: dict[str, Any] = {}
    file_cfg: dict[str, Any] = {}
    preset = early.preset
    config = recipe.config()
    if early.config:
        file_run, file_cfg = split_file_options(
            early.config, data, recipe, config, {o.name for o in RUN_OPTIONS} | {"preset"})
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
