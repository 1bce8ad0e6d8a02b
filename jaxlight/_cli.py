"""The `jaxlight` command: train, validate and test recipes; inspect devices; launch processes.

    jaxlight fit digits --strategy dp
    jaxlight fit gpt --preset tiny --strategy fsdp --max-steps 200 --model.num_layers 4
    jaxlight fit digits --config run.yaml --optim.lr 1e-3
    jaxlight validate digits --ckpt-path jaxlight_logs/checkpoints
    jaxlight devices --strategy tp --mesh-shape '[[4,2],["data","tp"]]'
    jaxlight launch --nprocs 2 -- jaxlight fit digits

Values come, lowest priority first, from: the recipe's defaults, `--preset`, `--config FILE`
(YAML or JSON), then the command line. Strategies, callbacks and loggers are looked up by name in
`jaxlight.strategies` and `jaxlight.callbacks` when the command runs.

`--devices N` simulates N CPU devices. XLA reads `XLA_FLAGS` once, when JAX starts its backend,
so the flag is written into the environment before anything touches a device.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

from jaxlight._errors import ConfigurationError, JaxlightError, suggest

__all__ = ["RunResult", "build_strategy", "load_config_file", "main", "parse_mesh_shape", "run"]

COMMANDS = {
    "fit": "train a recipe (then report its final validation metrics)",
    "validate": "run a recipe's validation data through a model (from --ckpt-path)",
    "test": "run a recipe's test data through a model (from --ckpt-path)",
    "devices": "print devices, process index and count, and the mesh a strategy builds",
    "launch": "start N local processes of a command (multi-process training on one machine)",
}

MESH_FORMS = """accepted forms of --mesh-shape:
  '{"data": 4, "tp": 2}'        a JSON or YAML mapping of axis name to size
  'data=4,tp=2'                 axis=size pairs
  '[[4, 2], ["data", "tp"]]'    the Tunix form: [sizes, axis names]
one size may be -1 (it fills the remaining devices); mesh axes: data, pipe, fsdp, tp"""

_DEVICE_FLAG = "--xla_force_host_platform_device_count"


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
         "form '[[4,2],[\"fsdp\",\"tp\"]]'", fit_kwarg=False),
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


def _fit_signature_defaults() -> dict[str, Any]:
    from jaxlight._fit import Fit

    params = inspect.signature(Fit.__init__).parameters
    return {name: p.default for name, p in params.items()
            if p.default is not inspect.Parameter.empty}


def run_option_defaults() -> dict[str, Any]:
    """Every run option's default (Fit's own defaults where the table leaves them open)."""
    fit_defaults = _fit_signature_defaults()
    out = {}
    for opt in RUN_OPTIONS:
        out[opt.name] = opt.default
        if opt.default is None and opt.fit_kwarg and opt.name in fit_defaults:
            out[opt.name] = fit_defaults[opt.name]
    return out


# -- errors and argument parsing -----------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigurationError instead of exiting, so messages stay ours."""

    def error(self, message: str):
        raise ConfigurationError(f"{self.prog}: {message}")


def _flag(name: str) -> str:
    """The command-line spelling of an option name (`max_steps` -> `--max-steps`)."""
    return "--" + (name if "." in name else name.replace("_", "-"))


def _normalize(argv: Sequence[str]) -> list[str]:
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
    from jaxlight.recipes._base import fields, get_path, type_name

    parser = _Parser(
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


def _unknown_option_error(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
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
        import yaml

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
    from jaxlight.recipes._base import fields, flatten

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


# -- resolving names at run time -----------------------------------------------------------------


def _parse_call(text: str, what: str) -> tuple[str, list, dict]:
    """`"tp(size=4)"` -> `("tp", [], {"size": 4})`; a bare name has no arguments."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError as err:
        raise ConfigurationError(
            f"{what} {text!r} does not parse ({err.msg}); write a name, or a call with literal "
            "arguments such as \"tp(size=4)\"."
        ) from None
    if isinstance(node, ast.Name):
        return node.id, [], {}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        try:
            args = [ast.literal_eval(a) for a in node.args]
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            raise ConfigurationError(
                f"{what} {text!r}: arguments must be literals (numbers, strings, lists, dicts)."
            ) from None
        return node.func.id, args, kwargs
    raise ConfigurationError(
        f"{what} {text!r} is not a name or a call such as \"tp(size=4)\"."
    )


def _split_calls(text: str) -> list[str]:
    """Splits `"a(x=1, y=2), b"` at top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _call(target, args, kwargs, what: str):
    try:
        return target(*args, **kwargs)
    except TypeError as err:
        try:
            sig = str(inspect.signature(target))
        except (TypeError, ValueError):
            sig = "(...)"
        raise ConfigurationError(f"{what}: {err}; the signature is {sig}.") from None


def _strategy_table() -> dict[str, Any]:
    """Strategy names the command line accepts: the alias table, then class names."""
    from jaxlight import strategies

    table: dict[str, Any] = {k.lower(): v for k, v in strategies.ALIASES.items()}
    for name in getattr(strategies, "__all__", ()):
        obj = getattr(strategies, name, None)
        if (inspect.isclass(obj) and issubclass(obj, strategies.Strategy)
                and not inspect.isabstract(obj) and name != "SpmdStrategy"):
            table.setdefault(name.lower(), obj)
    return table


def parse_mesh_shape(text: str) -> dict[str, int]:
    """Parses `--mesh-shape` in any accepted form into `{axis: size}`."""
    text = text.strip()
    bad = f"--mesh-shape {text!r} does not parse"
    if not text:
        raise ConfigurationError(f"{bad}: it is empty.\n{MESH_FORMS}")
    if "=" in text and text[0] not in "{[":
        shape = {}
        for pair in text.split(","):
            name, eq, size = pair.partition("=")
            if not eq or not name.strip():
                raise ConfigurationError(f"{bad}: {pair.strip()!r} is not axis=size.\n{MESH_FORMS}")
            try:
                shape[name.strip()] = int(size)
            except ValueError:
                raise ConfigurationError(
                    f"{bad}: size {size.strip()!r} of axis {name.strip()!r} is not an integer."
                    f"\n{MESH_FORMS}"
                ) from None
        return shape
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigurationError(
            f"{bad}: {getattr(err, 'problem', None) or err}.\n{MESH_FORMS}") from None
    if isinstance(value, dict):
        shape = value
    elif (isinstance(value, list) and len(value) == 2 and all(isinstance(v, list) for v in value)
          and len(value[0]) == len(value[1])):
        sizes, names = value
        if all(isinstance(s, str) for s in sizes) and not all(isinstance(n, str) for n in names):
            sizes, names = names, sizes  # [[names], [sizes]] is unambiguous too
        shape = dict(zip(names, sizes, strict=True))
    else:
        raise ConfigurationError(
            f"{bad}: it is neither a mapping nor [sizes, names].\n{MESH_FORMS}")
    for name, size in shape.items():
        if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int):
            raise ConfigurationError(
                f"{bad}: axis {name!r} has size {size!r}; axis names are strings and sizes "
                f"integers.\n{MESH_FORMS}"
            )
    return shape


def build_strategy(name: str = "auto", mesh_shape: str | dict | None = None):
    """The strategy an option pair names, looked up in `jaxlight.strategies` now."""
    from jaxlight import strategies

    key, args, kwargs = _parse_call(name or "auto", "--strategy")
    table = _strategy_table()
    if key.lower() not in table:
        raise ConfigurationError(
            f"unknown strategy {key!r}; valid names are {sorted(table)}."
            f"{suggest(key.lower(), table)}"
        )
    if mesh_shape is not None:
        shape = parse_mesh_shape(mesh_shape) if isinstance(mesh_shape, str) else dict(mesh_shape)
        if key.lower() not in ("auto", "hybrid"):
            raise ConfigurationError(
                f"--mesh-shape builds strategies.Hybrid, but --strategy is {name!r}; drop one of "
                "them, or use --strategy hybrid (the mesh axes data, fsdp, tp and pipe express "
                "every other strategy)."
            )
        hybrid = table.get("hybrid")
        if hybrid is None:
            raise ConfigurationError(
                "--mesh-shape needs strategies.Hybrid, which this jaxlight does not have; "
                f"choose one of {sorted(table)} with --strategy."
            )
        return _call(hybrid, [shape, *args], kwargs, "--strategy hybrid")
    if key.lower() == "hybrid" and not args and "mesh_shape" not in kwargs:
        raise ConfigurationError(
            f"--strategy hybrid needs a mesh: add --mesh-shape, for example 'data=2,fsdp=4'."
            f"\n{MESH_FORMS}"
        )
    target = table[key.lower()]
    if not args and not kwargs:
        return strategies.resolve(key) if key.lower() in strategies.ALIASES else target()
    return _call(target, args, kwargs, f"--strategy {name}")


_LOGGERS = {"csv": "CSVLogger", "wandb": "WandbLogger", "tensorboard": "TensorBoardLogger",
            "tb": "TensorBoardLogger"}


def build_loggers(text: str | None) -> list | None:
    """Logger callbacks from `csv,wandb,...`; None when no logger is wanted."""
    from jaxlight import callbacks

    if text is None or text.strip().lower() in ("", "none", "false", "off"):
        return None
    out = []
    for part in _split_calls(text):
        name, args, kwargs = _parse_call(part, "--logger")
        cls_name = _LOGGERS.get(name.lower(), name)
        cls = getattr(callbacks, cls_name, None)
        if cls is None or not getattr(cls, "is_logger", False):
            available = [k for k, v in _LOGGERS.items() if hasattr(callbacks, v) and k != "tb"]
            raise ConfigurationError(
                f"unknown logger {name!r}; available loggers are {available} (or 'none')."
                f"{suggest(name.lower(), _LOGGERS)}"
            )
        out.append(_call(cls, args, kwargs, f"--logger {part}"))
    return out


def build_callbacks(text: str | None) -> list:
    """Callbacks from `"EarlyStopping(monitor='val_loss'), LearningRateMonitor()"`."""
    from jaxlight import callbacks

    if not text:
        return []
    valid = [n for n in getattr(callbacks, "__all__", ()) if n not in ("Callback",)]
    out = []
    for part in _split_calls(text):
        name, args, kwargs = _parse_call(part, "--callbacks")
        cls = getattr(callbacks, name, None)
        if cls is None or not (inspect.isclass(cls) and issubclass(cls, callbacks.Callback)):
            raise ConfigurationError(
                f"unknown callback {name!r}; jaxlight.callbacks has {valid}.{suggest(name, valid)}"
            )
        out.append(_call(cls, args, kwargs, f"--callbacks {part}"))
    return out


# -- devices -------------------------------------------------------------------------------------


def _prescan_devices(argv: Sequence[str]) -> int | None:
    """`--devices N` from raw argv (before argparse, before JAX starts)."""
    for i, token in enumerate(argv):
        if token == "--":
            break
        value = None
        if token == "--devices" and i + 1 < len(argv):
            value = argv[i + 1]
        elif token.startswith("--devices="):
            value = token.split("=", 1)[1]
        if value is not None:
            try:
                n = int(value)
            except ValueError:
                raise ConfigurationError(f"--devices expects a positive int, got {value!r}.") \
                    from None
            if n < 1:
                raise ConfigurationError(f"--devices expects a positive int, got {n}.")
            return n
    return None


def simulate_cpu_devices(n: int) -> None:
    """Asks XLA for `n` CPU devices; effective only before JAX initializes its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(rf"{_DEVICE_FLAG}=\S+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()


def _initialize_distributed() -> None:
    """Joins a multi-process run when the environment describes one (the launcher's, SLURM...)."""
    try:
        from jaxlight import distributed
    except ImportError:
        return
    init = getattr(distributed, "initialize", None)
    if init is not None:
        init()


def _check_devices(n: int) -> None:
    import jax

    local = jax.local_device_count()
    if local != n:
        platform = jax.devices()[0].platform
        if platform == "cpu":
            hint = ("JAX had already started in this process (XLA_FLAGS is read once); run the "
                    "command in a fresh process")
        else:
            hint = (f"--devices simulates CPU devices only; on {platform} choose devices with "
                    "CUDA_VISIBLE_DEVICES (or drop --devices)")
        raise ConfigurationError(
            f"--devices {n} asked for {n} devices per process but this process has {local} "
            f"{platform} devices: {hint}."
        )


def _print_devices(strategy_name: str, mesh_shape: str | None) -> None:
    import jax
    import numpy as np

    import jaxlight

    devices = jax.devices()
    print(f"jaxlight {jaxlight.__version__}, jax {jax.__version__}, backend "
          f"{jax.default_backend()}")
    print(f"process {jax.process_index()} of {jax.process_count()}; "
          f"{jax.local_device_count()} local devices, {jax.device_count()} global")
    print("devices:")
    for d in devices:
        print(f"  id {d.id:<3} {d.device_kind:<16} {d.platform:<5} process {d.process_index}"
              f"{'  (local)' if d.process_index == jax.process_index() else ''}")
    strategy = build_strategy(strategy_name, mesh_shape)
    strategy.setup(None)
    info = strategy.describe()
    print(f"strategy {strategy.name} ({type(strategy).__name__}): mesh {info.get('mesh')}, "
          f"data-parallel degree {strategy.data_parallel_size}")
    mesh = getattr(strategy, "mesh", None)
    if mesh is not None and hasattr(mesh, "devices"):
        ids = np.vectorize(lambda d: d.id)(np.asarray(mesh.devices))
        print(f"device ids on mesh axes {tuple(mesh.axis_names)}:")
        for line in np.array2string(ids).splitlines():
            print(f"  {line}")


# -- running a recipe ----------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    """What `run` returns: the objects it built and every metric it reported."""

    fit: Any
    module: Any
    data: Any
    config: Any
    options: dict[str, Any]
    metrics: dict[str, Any]


def resolve(command: str, recipe_name: str, argv: Sequence[str]):
    """Parses a recipe command's options: (recipe, config, options, parser, flags)."""
    from jaxlight import recipes
    from jaxlight.recipes._base import apply_overrides, convert, fields

    recipe = recipes.get(recipe_name)
    argv = _normalize(argv)
    base_defaults = {**run_option_defaults(), **recipe.fit_defaults}
    # First pass: --preset and --config decide the defaults the help shows.
    pre = _Parser(add_help=False, allow_abbrev=False)
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
        defaults[name] = convert(value, types[name], f"config file {early.config}: {name}")
    config = apply_overrides(config, file_cfg, f"config file {early.config}")

    parser = _recipe_parser(command, recipe, defaults, config)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _unknown_option_error(parser, unknown)
    flags = vars(args)
    options = dict(defaults)
    for opt in RUN_OPTIONS:
        if flags.get(opt.name) is not None:
            options[opt.name] = convert(flags[opt.name], opt.type, _flag(opt.name))
    known = fields(type(config))
    overrides = {k: flags[k] for k in known if flags.get(k) is not None}
    config = apply_overrides(config, {k: v for k, v in overrides.items()}, "command line")
    options["preset"] = preset
    return recipe, config, options, parser, flags


def _fit_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    fit_params = _fit_signature_defaults()
    return {o.name: options[o.name] for o in RUN_OPTIONS
            if o.fit_kwarg and o.name in fit_params}


def run(command: str, recipe_name: str, argv: Sequence[str] = ()) -> RunResult | None:
    """Runs `jaxlight <command> <recipe> [argv]` in this process and returns what it built.

    `run("fit", "digits", ["--max-steps", "20"])` is `jaxlight fit digits --max-steps 20`; the
    result holds the `Fit`, the trained module, the data, the resolved config and options, and
    every reported metric. Returns None for `--help` and `--print-config`.
    """
    recipe, config, options, parser, flags = resolve(command, recipe_name, argv)
    if flags.get("help"):
        parser.print_help()
        return None
    if flags.get("print_config"):
        import yaml

        from jaxlight.recipes._base import as_dict

        printable = {**options, **as_dict(config)}
        print(yaml.safe_dump(printable, sort_keys=False), end="")
        return None
    # Join a multi-process job (a no-op alone) before anything starts JAX's backend.
    _initialize_distributed()
    if options["devices"] is not None:
        _check_devices(options["devices"])

    import jaxlight as jl
    from jaxlight import callbacks as cbs

    strategy = build_strategy(options["strategy"], options["mesh_shape"])
    callbacks = build_callbacks(options["callbacks"])
    loggers = build_loggers(options["logger"]) if not options["fast_dev_run"] else None
    if options["checkpoint_every_n_steps"]:
        if not hasattr(cbs, "ModelCheckpoint"):
            raise ConfigurationError("--checkpoint-every-n-steps needs callbacks.ModelCheckpoint, "
                                     "which this jaxlight does not have.")
        callbacks.append(cbs.ModelCheckpoint(
            os.path.join(os.path.abspath(options["default_root_dir"]), "checkpoints"),
            every_n_steps=options["checkpoint_every_n_steps"]))
    kwargs = _fit_kwargs(options)
    kwargs["fast_dev_run"] = options["fast_dev_run"] or False
    fit = jl.Fit(strategy, callbacks=[*callbacks, *(loggers or [])],
                 logger=loggers is not None, **kwargs)
    overrides = recipe.ckpt_overrides
    if callable(overrides):
        overrides = overrides(config)
    if options["ckpt_path"] is not None and overrides:
        from jaxlight.recipes._base import apply_overrides

        config = apply_overrides(config, overrides, f"recipe {recipe.name}")
    module, data = recipe.build(config, kwargs.get("max_steps"))
    metrics: dict[str, Any] = {}
    say = _printer()
    say(f"{command} {recipe.name}: strategy {strategy.name}, {_describe_devices()}")
    if command == "fit":
        # A resumed fit starts from the checkpoint, not from what before_fit would measure.
        if recipe.before_fit is not None and options["ckpt_path"] is None:
            before = recipe.before_fit(fit, module, data, config) or {}
            metrics.update({f"before_{k}": v for k, v in before.items()})
            _report("before training", before, say)
        t0 = time.perf_counter()
        fit.fit(module, data.train, data.val, ckpt_path=options["ckpt_path"])
        metrics["train_seconds"] = time.perf_counter() - t0
        metrics["global_step"] = fit.global_step
        if data.val is not None:
            final = fit.validate(module, data.val)
            metrics.update(final)
            _report(f"final validation metrics (step {fit.global_step}, "
                    f"{metrics['train_seconds']:.1f} s)", final, say)
        if recipe.after_fit is not None:
            after = recipe.after_fit(fit, module, data, config) or {}
            metrics.update(after)
            _report("after training", after, say)
    else:
        if options["ckpt_path"] is None:
            say(f"note: no --ckpt-path: {command} runs the freshly initialized model")
        split = data.val if command == "validate" else (data.test or data.val)
        if split is None:
            raise ConfigurationError(f"recipe {recipe.name!r} has no {command} data.")
        method = fit.validate if command == "validate" else fit.test
        result = method(module, split, ckpt_path=options["ckpt_path"])
        metrics.update(result)
        _report(f"{command} metrics", result, say)
    return RunResult(fit, module, data, config, options, metrics)


def _describe_devices() -> str:
    import jax

    return (f"{jax.device_count()} {jax.devices()[0].platform} devices, "
            f"process {jax.process_index()} of {jax.process_count()}")


def _printer():
    import jax

    def say(text: str) -> None:
        if jax.process_index() == 0:
            print(text, flush=True)

    return say


def _report(title: str, metrics: dict[str, Any], say) -> None:
    if not metrics:
        return
    say(f"{title}:")
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        if isinstance(value, float):
            shown = f"{value:.4f}"
        elif isinstance(value, str) and "\n" in value:
            shown = "\n" + "\n".join(f"    | {line}" for line in value.splitlines())
        else:
            shown = str(value)
        say(f"  {key:<{width}}  {shown}")


# -- entry point ---------------------------------------------------------------------------------


def _top_help() -> str:
    from jaxlight import recipes

    lines = ["usage: jaxlight <command> [recipe] [options]", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    lines += ["", "recipes (jaxlight fit <recipe> --help lists every option and its default):"]
    for name in recipes.names():
        try:
            summary = recipes.get(name).summary
        except Exception as err:  # a recipe whose dependencies are missing still gets listed
            summary = f"(unavailable: {err})"
        lines.append(f"  {name:<9} {summary}")
    return "\n".join(lines)


def _devices_command(argv: Sequence[str]) -> None:
    parser = _Parser(prog="jaxlight devices", description=COMMANDS["devices"],
                     allow_abbrev=False)
    parser.add_argument("--strategy", default="auto", help="strategy whose mesh to show "
                        "(default: auto)")
    parser.add_argument("--mesh-shape", default=None, help="mesh for strategies.Hybrid "
                        "(default: none)")
    parser.add_argument("--devices", type=int, default=None,
                        help="simulate this many CPU devices (default: as XLA_FLAGS says)")
    args, unknown = parser.parse_known_args(_normalize(argv))
    if unknown:
        _unknown_option_error(parser, unknown)
    _initialize_distributed()
    if args.devices is not None:
        _check_devices(args.devices)
    _print_devices(args.strategy, args.mesh_shape)


def main(argv: Sequence[str] | None = None) -> int:
    """The `jaxlight` console script. Returns the exit status (2: bad input, 1: failed run)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help", "help"):
            print(_top_help())
            return 0 if argv else 2
        command, rest = argv[0], argv[1:]
        if command == "launch":
            from jaxlight._launch import main as launch_main

            return launch_main(rest) or 0
        if command not in COMMANDS:
            raise ConfigurationError(
                f"unknown command {command!r}; valid commands are {list(COMMANDS)}."
                f"{suggest(command, COMMANDS)}"
            )
        n = _prescan_devices(rest)
        if n is not None:
            simulate_cpu_devices(n)
        if command == "devices":
            _devices_command(rest)
            return 0
        if not rest or rest[0].startswith("-"):
            if rest and rest[0] in ("-h", "--help"):
                print(_top_help())
                return 0
            from jaxlight import recipes

            raise ConfigurationError(
                f"jaxlight {command} needs a recipe: jaxlight {command} <recipe> [options]; "
                f"recipes are {recipes.names()}."
            )
        run(command, rest[0], rest[1:])
        return 0
    except ConfigurationError as err:
        print(f"jaxlight: error: {err}", file=sys.stderr)
        return 2
    except JaxlightError as err:
        print(f"jaxlight: {type(err).__name__}: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

