"""Running a command (`fit`, `validate`, `test`, `predict`) on a recipe or the user's own
module, in this process."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import yaml

from jaxlight import Fit
from jaxlight import callbacks as cbs
from jaxlight._ckpt_paths import resolve_checkpoint
from jaxlight._cli import _predict
from jaxlight._cli._build import (
    build_callbacks,
    build_loggers,
    build_strategy,
    size_bare_strategy,
)
from jaxlight._cli._devices import check_device_count, describe_devices, initialize_distributed
from jaxlight._cli._lightning_form import (
    has_class_parameters,
    parse,
    parse_recipe,
    recipe_config,
    uses_lightning_form,
)
from jaxlight._cli._options import RUN_OPTIONS, fit_signature_defaults, resolve
from jaxlight._cli._target import (
    TargetRecipe,
    import_object,
    is_target,
    missing_required,
    printable,
)
from jaxlight._errors import CheckpointError, ConfigurationError
from jaxlight._module import TrainModule
from jaxlight.data._datamodule import DataModule, defines
from jaxlight.optim.torch import configure_optimizers
from jaxlight.recipes._base import apply_overrides


@dataclasses.dataclass
class RunResult:
    """What `run` returns: the objects it built and every metric it reported."""

    fit: Any
    module: Any
    data: Any
    config: Any
    options: dict[str, Any]
    metrics: dict[str, Any]
    #: `predict`'s outputs: one NumPy pytree per batch (None for the other commands).
    predictions: list[Any] | None = None



def _fit_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    fit_params = fit_signature_defaults()
    return {o.name: options[o.name] for o in RUN_OPTIONS
            if o.fit_kwarg and o.name in fit_params}


def run(command: str, recipe_name: str, argv: Sequence[str] = ()) -> RunResult | None:
    """Runs `jaxlight <command> <recipe> [argv]` in this process and returns what it built.

    `run("fit", "digits", ["--max-steps", "20"])` is `jaxlight fit digits --max-steps 20`, and
    `run("fit", "model.py:Net", ["--data", "model.py:Data"])` runs the user's own module; the
    result holds the `Fit`, the trained module, the data (a `RecipeData` or the DataModule),
    the resolved config and options, and every reported metric. Returns None for `--help` and
    `--print-config`.
    """
    if is_target(recipe_name) and (uses_lightning_form(argv) or _class_typed(recipe_name, argv)):
        return run_lightning_form(command, recipe_name, argv)
    if not is_target(recipe_name) and uses_lightning_form(argv):
        return run_recipe_form(command, recipe_name, argv)
    recipe, config, options, parser, flags = resolve(command, recipe_name, argv)
    if flags.get("help"):
        parser.print_help()
        return None
    if isinstance(recipe, TargetRecipe):
        missing_required(recipe, config)
    if flags.get("print_config"):
        print(yaml.safe_dump(printable(recipe, options, config), sort_keys=False), end="")
        return None
    if isinstance(recipe, TargetRecipe) and "data" not in recipe.class_paths:
        raise ConfigurationError(
            f"jaxlight {command} {recipe.name} needs its data: add --data PATH.py:NAME naming a "
            "jaxlight.DataModule subclass (or a function returning one), or give "
            "`data: {class_path: PATH.py:NAME}` in the --config file."
        )
    _check_options(command, recipe.name, options, flags)
    _predict.check_output_path(flags.get("output"))
    # Join a multi-process job (a no-op alone) before anything starts JAX's backend.
    initialize_distributed()
    if options["devices"] is not None:
        check_device_count(options["devices"])

    strategy = build_strategy(options["strategy"], options["mesh_shape"])
    callbacks = build_callbacks(options["callbacks"])
    loggers = build_loggers(options["logger"]) if not options["fast_dev_run"] else None
    if options["checkpoint_every_n_steps"] is not None or options["checkpoint_monitor"]:
        callbacks.append(cbs.ModelCheckpoint(
            os.path.join(os.path.abspath(options["default_root_dir"]), "checkpoints"),
            every_n_steps=options["checkpoint_every_n_steps"],
            monitor=options["checkpoint_monitor"], mode=options["checkpoint_mode"]))
    kwargs = _fit_kwargs(options)
    kwargs["fast_dev_run"] = options["fast_dev_run"] or False
    if command != "fit" and kwargs["max_steps"] is None and kwargs["max_epochs"] is None:
        kwargs["max_epochs"] = 1  # Fit asks how long to train; evaluating never trains

    def make_fit(strategy):
        return Fit(strategy, callbacks=[*callbacks, *(loggers or []), _LastValidation()],
                   logger=loggers is not None, **kwargs)

    fit = make_fit(strategy)  # refuses bad Fit options before the recipe builds anything
    if command != "fit" and options["ckpt_path"] in ("best", "last"):
        options["ckpt_path"] = _find_checkpoint(fit, options["ckpt_path"])
    overrides = recipe.ckpt_overrides
    if callable(overrides):
        overrides = overrides(config)
    if options["ckpt_path"] is not None and overrides:
        config = apply_overrides(config, overrides, f"recipe {recipe.name}")
    module, data = recipe.build(config, kwargs.get("max_steps"))
    metrics: dict[str, Any] = {}
    predictions = None
    say = _printer()
    sized, note = size_bare_strategy(options["strategy"], options["mesh_shape"], module,
                                     fit.seed)
    if sized is not None:
        strategy = sized
        fit = make_fit(strategy)
    say(f"{command} {recipe.name}: strategy {strategy.name}, {describe_devices()}")
    if note:
        say(note)
    try:
        if command == "fit":
            _fit_command(recipe, config, options, fit, module, data, metrics, say)
        elif command == "predict":
            predictions = _predict_command(recipe, options, flags, fit, module, data, say)
        else:
            _eval_command(command, recipe, options, fit, module, data, metrics, say)
    finally:
        for logger in loggers or []:  # one run per command: complete on disk when it returns
            finish = getattr(logger, "finish", None)
            if callable(finish):
                finish()
    return RunResult(fit, module, data, config, options, metrics, predictions)


def _find_checkpoint(fit, which: str) -> str:
    """The step directory `--ckpt-path best|last` names for validate/test/predict, found before
    the model is built; a run with nothing to load is refused, not evaluated untrained."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "last" finding nothing is refused below instead
            found = resolve_checkpoint(fit, which)
    except CheckpointError as err:
        raise CheckpointError(
            f"--ckpt-path {which}: {err} On the command line: fit with --checkpoint-monitor "
            "val_loss (--checkpoint-mode max for a metric where higher is better)."
        ) from None
    if found is None:
        looked = ", ".join(loc.dirpath for loc in fit.checkpoint_locations)
        raise CheckpointError(
            f"--ckpt-path last: no complete checkpoint in {looked}; fit with "
            "--checkpoint-every-n-steps N (or --checkpoint-monitor) first, with the same "
            "--default-root-dir, or pass the path of a checkpoint."
        )
    if jax.process_index() == 0:
        print(f"--ckpt-path {which}: {found}", flush=True)
    return found


def _stage_data(command: str, recipe, data) -> dict[str, Any]:
    """The data keywords of `Fit.<command>`: a DataModule, or the recipe's split."""
    if isinstance(data, DataModule):
        return {"datamodule": data}
    if command == "fit":
        return {"train_data": data.train, "val_data": data.val}
    split = {"validate": data.val, "test": data.test or data.val,
             "predict": data.predict}[command]
    if split is None:
        raise ConfigurationError(f"recipe {recipe.name!r} has no {command} data.")
    return {"data": split}


def _has_val(data) -> bool:
    if isinstance(data, DataModule):
        return defines(data, "val_dataloader")
    return data.val is not None



class _LastValidation(cbs.Callback):
    """The step and metrics of the fit's latest validation (the CLI's final report)."""

    def __init__(self):
        self.step: int | None = None
        self.metrics: dict[str, float] = {}

    def on_validation_end(self, fit, module) -> None:
        self.step = fit.global_step
        self.metrics = {k: v for k, v in fit.callback_metrics.items() if k.startswith("val_")}


def _fit_command(recipe, config, options, fit, module, data, metrics, say) -> None:
    # A resumed fit starts from the checkpoint, not from what before_fit would measure.
    if recipe.before_fit is not None and options["ckpt_path"] is None:
        before = recipe.before_fit(fit, module, data, config) or {}
        metrics.update({f"before_{k}": v for k, v in before.items()})
        _report("before training", before, say)
    last = next(cb for cb in fit.callbacks if isinstance(cb, _LastValidation))
    t0 = time.perf_counter()
    fit.fit(module, ckpt_path=options["ckpt_path"], **_stage_data("fit", recipe, data))
    metrics["train_seconds"] = time.perf_counter() - t0
    metrics["global_step"] = fit.global_step
    if _has_val(data):
        # A fit that validated after its last step already measured (and logged) the final
        # model: validating again would log the same metrics twice at one step.
        if last.step == fit.global_step and last.metrics:
            final = dict(last.metrics)
        else:
            final = fit.validate(module, **_stage_data("validate", recipe, data))
        metrics.update(final)
        _report(f"final validation metrics (step {fit.global_step}, "
                f"{metrics['train_seconds']:.1f} s)", final, say)
    if recipe.after_fit is not None:
        after = recipe.after_fit(fit, module, data, config) or {}
        metrics.update(after)
        _report("after training", after, say)


def _eval_command(command, recipe, options, fit, module, data, metrics, say) -> None:
    if options["ckpt_path"] is None:
        say(f"warning: --ckpt-path none: {command} evaluates the model as configure_model "
            "initializes it, not a trained one")
    method = fit.validate if command == "validate" else fit.test
    result = method(module, ckpt_path=options["ckpt_path"], **_stage_data(command, recipe, data))
    metrics.update(result)
    _report(f"{command} metrics", result, say)


def _predict_command(recipe, options, flags, fit, module, data, say) -> list[Any]:
    if options["ckpt_path"] is None:
        say("warning: --ckpt-path none: predict runs the model as configure_model initializes "
            "it, not a trained one")
    outputs = fit.predict(module, ckpt_path=options["ckpt_path"],
                          **_stage_data("predict", recipe, data))
    arrays = _predict.collect(outputs)
    for line in _predict.summarize(outputs, arrays):
        say(line)
    if flags.get("output"):
        _predict.save(flags["output"], arrays)
        say(f"saved {len(arrays)} arrays to {flags['output']}")
    return outputs


def _check_options(command: str, recipe_name: str, options: dict[str, Any],
                   flags: dict[str, Any]) -> None:
    """Refuses option values that would run but do nothing useful, before anything starts."""
    every = options["checkpoint_every_n_steps"]
    if every is not None and every < 1:
        raise ConfigurationError(
            f"--checkpoint-every-n-steps {every} would save no checkpoint: give a positive "
            "number of steps, or leave the option out for no periodic checkpoints."
        )
    # `--ckpt-path none` asks for the initialization on purpose (a baseline, or sft's base).
    raw = flags.get("ckpt_path")
    untrained_on_purpose = isinstance(raw, str) and raw.lower() in ("none", "null")
    if command == "fit" and options["max_steps"] is None and options["max_epochs"] is None \
            and not options["fast_dev_run"]:
        raise ConfigurationError(
            f"jaxlight fit {recipe_name} needs to know how long to train: give --max-steps N or "
            "--max-epochs N (or max_steps / max_epochs in the --config file)."
        )
    if options["checkpoint_mode"] not in ("min", "max"):
        raise ConfigurationError(
            f"--checkpoint-mode {options['checkpoint_mode']!r}: give 'min' (lower "
            "--checkpoint-monitor values are better, as for a loss) or 'max' (an accuracy)."
        )
    if command != "fit" and options["ckpt_path"] is None and not untrained_on_purpose:
        root = options["default_root_dir"]
        run_recipe = recipe_name if ":" not in recipe_name else f"{recipe_name} --data ..."
        found = os.path.isdir(os.path.join(root, "checkpoints"))
        hint = (f"--ckpt-path last (the newest checkpoint under {root}/checkpoints)" if found
                else f"--ckpt-path PATH, a checkpoint step directory (such as "
                f"{root}/checkpoints/100), a checkpoints directory, 'last' or 'best', as "
                f"written by `jaxlight fit {run_recipe} --checkpoint-every-n-steps N`")
        raise ConfigurationError(
            f"jaxlight {command} {recipe_name} without --ckpt-path would evaluate a randomly "
            f"initialized model, not a trained one; pass {hint}. (To evaluate the "
            "initialization on purpose, pass --ckpt-path none.)"
        )


def _printer():
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


def _class_typed(spec: str, argv: Sequence[str]) -> bool:
    """Whether the module or its data takes a class-typed argument (an injected backbone):
    such a module is configured in LightningCLI's form."""
    data = next((argv[i + 1] for i, t in enumerate(argv[:-1]) if t == "--data"), None)
    return any(has_class_parameters(import_object(s, what))
               for s, what in ((spec, "target"), (data, "--data")) if s is not None)


def run_lightning_form(command: str, spec: str, argv: Sequence[str]) -> RunResult | None:
    """`jaxlight <command> PATH.py:Module --data PATH.py:Data` in LightningCLI's form (see
    `_lightning_form`): parsed by jsonargparse, then run as any other command."""
    parser, cfg, extras, (model_cls, data_cls), notes = parse(command, spec, argv)
    if cfg is None:
        parser.print_help()
        return None
    notes.report()
    if extras["print_config"] is not None:
        text = parser.dump(cfg, skip_unset=False)
        for name, module in list(sys.modules.items()):
            if name.startswith("_jaxlight_target_") and sys.modules.get(
                    name.removeprefix("_jaxlight_target_")) is module:
                text = text.replace(f"class_path: {name}.",
                                    f"class_path: {name.removeprefix('_jaxlight_target_')}.")
        print(text, end="")
        return None
    if data_cls is None:
        raise ConfigurationError(
            f"jaxlight {command} {spec} needs its data: add --data PATH.py:NAME naming a "
            "jaxlight.DataModule subclass (or a function returning one).")
    _predict.check_output_path(extras["output"])
    initialize_distributed()
    if extras["devices"] is not None:
        check_device_count(int(extras["devices"]))
    ckpt_path, untrained_on_purpose = _ckpt_path(cfg)
    seed = _seed(cfg)
    init = parser.instantiate(cfg)
    trainer = _trainer_kwargs(command, init.trainer)
    module, data = init.model, init.data
    if not isinstance(data_cls, type) and not isinstance(data, DataModule):
        data = data_cls(**vars(data))  # a function returning the DataModule
    if not isinstance(data, DataModule):
        raise ConfigurationError(
            f"--data {extras['data']!r} returned a {type(data).__name__}, not a "
            "jaxlight.DataModule.")
    if cfg.optimizer is not None:
        tx = configure_optimizers(init.optimizer, init.lr_scheduler)
        if type(module).configure_optimizers is not TrainModule.configure_optimizers:
            warnings.warn(f"{type(module).__name__}.configure_optimizers is replaced by "
                          "--optimizer, as LightningCLI does.", UserWarning, stacklevel=2)
        module.configure_optimizers = lambda: tx
    elif cfg.lr_scheduler is not None:
        raise ConfigurationError("--lr_scheduler needs --optimizer (as in LightningCLI).")
    trainer["callbacks"] = [*trainer["callbacks"], _LastValidation()]
    fit = Fit(seed=seed, **trainer)
    ckpt_path = _eval_ckpt_path(command, spec, fit, ckpt_path, untrained_on_purpose)
    recipe = TargetRecipe(name=spec, summary="", config=type(cfg), build=lambda *a: None)
    options = {"ckpt_path": ckpt_path, "seed": seed}
    metrics: dict[str, Any] = {}
    predictions = None
    say = _printer()
    say(f"{command} {spec}: strategy {fit.strategy.name}, {describe_devices()}")
    if command == "fit":
        _fit_command(recipe, cfg, options, fit, module, data, metrics, say)
    elif command == "predict":
        predictions = _predict_command(recipe, options, {"output": extras["output"]}, fit,
                                       module, data, say)
    else:
        _eval_command(command, recipe, options, fit, module, data, metrics, say)
    return RunResult(fit, module, data, cfg, options, metrics, predictions)


def _ckpt_path(cfg) -> tuple[str | None, bool]:
    """`--ckpt_path` and whether `none` asked for the initialization on purpose."""
    ckpt_path = cfg.ckpt_path
    untrained_on_purpose = isinstance(ckpt_path, str) and ckpt_path.lower() in ("none", "null")
    return (None if untrained_on_purpose else ckpt_path), untrained_on_purpose


def _seed(cfg) -> int:
    """`--seed_everything`: true draws a seed (and prints it, to repeat the run), false is 0."""
    seed = cfg.seed_everything
    if seed is True:
        seed = int.from_bytes(os.urandom(4), "little") >> 1
        print(f"seed_everything: true: seed {seed} (pass --seed_everything {seed} to repeat "
              "this run)", flush=True)
    elif seed is False:
        seed = 0
    return seed


def _trainer_kwargs(command: str, trainer_ns) -> dict[str, Any]:
    """`Fit`'s keywords from the instantiated `trainer` section."""
    trainer = dict(vars(trainer_ns))
    if isinstance(trainer.get("strategy"), str):
        trainer["strategy"] = build_strategy(trainer["strategy"])
    if trainer.get("callbacks") is None:
        trainer["callbacks"] = []
    if command != "fit" and trainer["max_steps"] is None and trainer["max_epochs"] is None:
        trainer["max_epochs"] = 1  # Fit asks how long to train; evaluating never trains
    if command == "fit" and trainer["max_steps"] is None and trainer["max_epochs"] is None \
            and not trainer["fast_dev_run"]:
        trainer["max_epochs"] = 1000  # Lightning's length when none is given
    return trainer


def _eval_ckpt_path(command: str, spec: str, fit, ckpt_path, untrained_on_purpose: bool):
    """The checkpoint validate/test/predict run: refused when none is given (unless `none` on
    purpose), `best`/`last` found before the model is built."""
    if command == "fit":
        return ckpt_path
    if ckpt_path is None and not untrained_on_purpose:
        raise ConfigurationError(
            f"jaxlight {command} {spec} without --ckpt_path would evaluate a randomly "
            "initialized model, not a trained one; pass --ckpt_path PATH (a checkpoint "
            "step directory, a checkpoints directory, 'last' or 'best'), or --ckpt_path "
            "none to evaluate the initialization on purpose.")
    if ckpt_path in ("best", "last"):
        ckpt_path = _find_checkpoint(fit, ckpt_path)
    return ckpt_path


def run_recipe_form(command: str, name: str, argv: Sequence[str]) -> RunResult | None:
    """`jaxlight <command> <recipe>` in LightningCLI's form: `--trainer.*`, the recipe's config
    sections as `--model.*`, `--data.*`, `--optim.*` ..., `--seed_everything`, `--print_config`
    and LightningCLI-shaped `--config` files, parsed by jsonargparse (see `_lightning_form`)."""
    parser, cfg, extras, recipe, notes = parse_recipe(command, name, argv)
    if cfg is None:
        parser.print_help()
        return None
    notes.report()
    if extras["print_config"] is not None:
        print(parser.dump(cfg, skip_unset=False), end="")
        return None
    _predict.check_output_path(extras["output"])
    initialize_distributed()
    if extras["devices"] is not None:
        check_device_count(int(extras["devices"]))
    ckpt_path, untrained_on_purpose = _ckpt_path(cfg)
    seed = _seed(cfg)
    strategy_name = cfg.trainer.strategy if isinstance(cfg.trainer.strategy, str) else None
    trainer = _trainer_kwargs(command, parser.instantiate(cfg).trainer)
    config = recipe_config(recipe, extras["preset"], cfg)

    def make_fit(strategy):
        return Fit(seed=seed, **{**trainer, "strategy": strategy,
                                 "callbacks": [*trainer["callbacks"], _LastValidation()]})

    fit = make_fit(trainer["strategy"])  # refuses bad Fit options before the recipe builds
    ckpt_path = _eval_ckpt_path(command, name, fit, ckpt_path, untrained_on_purpose)
    overrides = recipe.ckpt_overrides
    if callable(overrides):
        overrides = overrides(config)
    if ckpt_path is not None and overrides:
        config = apply_overrides(config, overrides, f"recipe {recipe.name}")
    module, data = recipe.build(config, trainer["max_steps"])
    say = _printer()
    note = None
    if strategy_name is not None:
        sized, note = size_bare_strategy(strategy_name, None, module, seed)
        if sized is not None:
            fit = make_fit(sized)
    say(f"{command} {recipe.name}: strategy {fit.strategy.name}, {describe_devices()}")
    if note:
        say(note)
    options = {"ckpt_path": ckpt_path, "seed": seed, "preset": extras["preset"]}
    metrics: dict[str, Any] = {}
    predictions = None
    if command == "fit":
        _fit_command(recipe, config, options, fit, module, data, metrics, say)
    elif command == "predict":
        predictions = _predict_command(recipe, options, {"output": extras["output"]}, fit,
                                       module, data, say)
    else:
        _eval_command(command, recipe, options, fit, module, data, metrics, say)
    return RunResult(fit, module, data, config, options, metrics, predictions)
