"""Running a command (`fit`, `validate`, `test`, `predict`) on a recipe or the user's own
module, in this process: the one parser (`_lightning_form`, jsonargparse) reads the command
line, then `Fit` runs it."""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax

from jaxlight import Fit
from jaxlight import callbacks as cbs
from jaxlight._cli import _predict
from jaxlight._cli._build import build_strategy, parse_mesh_shape, size_bare_strategy
from jaxlight._cli._devices import describe_devices, join_job
from jaxlight._cli._lightning_form import parse, parse_recipe, printed_config, recipe_config
from jaxlight._cli._save_config import save_config_callbacks
from jaxlight._cli._target import is_target
from jaxlight._errors import CheckpointError, ConfigurationError
from jaxlight._fit._hooks import loggers_into_callbacks
from jaxlight.checkpoint._paths import resolve_checkpoint
from jaxlight.data._datamodule import DataModule, defines
from jaxlight.module._module import TrainModule
from jaxlight.optim.torch import configure_optimizers
from jaxlight.recipes._base import Recipe, apply_overrides


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


def run(command: str, recipe_name: str, argv: Sequence[str] = ()) -> RunResult | None:
    """Runs `jaxlight <command> <recipe> [argv]` in this process and returns what it built.

    `run("fit", "digits", ["--trainer.max_steps", "20"])` is `jaxlight fit digits
    --trainer.max_steps 20` (`--max-steps 20` is the same), and `run("fit", "model.py:Net",
    ["--data", "model.py:Data"])` runs the user's own module; the result holds the `Fit`, the
    trained module, the data (a `RecipeData` or the DataModule), the resolved config and
    options, and every reported metric. Returns None for `--help` and `--print_config`.
    """
    if is_target(recipe_name):
        parser, cfg, extras, (model_cls, data_cls), notes = parse(command, recipe_name, argv)
        recipe = None
    else:
        parser, cfg, extras, recipe, notes = parse_recipe(command, recipe_name, argv)
    from_recipe = recipe is not None
    if cfg is None:
        parser.print_help()
        return None
    notes.report()
    if extras["print_config"] is not None:
        print(printed_config(parser, cfg), end="")
        return None
    if not from_recipe and data_cls is None:
        raise ConfigurationError(
            f"jaxlight {command} {recipe_name} needs its data: add --data PATH.py:NAME naming a "
            "jaxlight.DataModule subclass (or a function returning one).")
    if command != "predict" and extras["output"] is not None:
        raise ConfigurationError(
            f"jaxlight {command} {recipe_name}: unknown option '--output'; only jaxlight "
            "predict saves its outputs (--output FILE.npz).")
    _check_options(cfg)
    _predict.check_output_path(extras["output"])
    join_job(cfg.devices)
    ckpt_path, untrained_on_purpose = _ckpt_path(cfg)
    seed = _seed(cfg)
    strategy_name = cfg.trainer.strategy if isinstance(cfg.trainer.strategy, str) else None
    init = parser.instantiate(cfg)
    trainer = _trainer_kwargs(command, init.trainer, cfg.mesh_shape)
    # The loggers join the callbacks before SaveConfigCallback, which writes into the first
    # one's run directory once that is chosen.
    callbacks, trainer["logger"] = loggers_into_callbacks(trainer.pop("logger"),
                                                          trainer.pop("callbacks"))
    callbacks += [*(init[key] for key in parser.callback_sections), *_checkpoint_callbacks(cfg),
                  *save_config_callbacks(printed_config(parser, cfg), extras,
                                         trainer.get("fast_dev_run"),
                                         resuming=command == "fit" and ckpt_path is not None)]
    if not from_recipe:
        config = cfg
        module, data = init.model, init.get("data")
        if not isinstance(data_cls, type) and not isinstance(data, DataModule):
            # A function returning the DataModule (one without arguments has no section).
            data = data_cls(**(vars(data) if data is not None else {}))
        if not isinstance(data, DataModule):
            raise ConfigurationError(
                f"--data {extras['data']!r} returned a {type(data).__name__}, not a "
                "jaxlight.DataModule.")
        _replace_optimizers(cfg, init, module)
        recipe = Recipe(name=recipe_name, summary="", config=type(cfg), build=lambda *a: None)
    else:
        config = recipe_config(recipe, extras["preset"], init)

    def make_fit(strategy):
        return Fit(seed=seed, **{**trainer, "strategy": strategy,
                                 "callbacks": [*callbacks, _LastValidation()]})

    try:
        fit = make_fit(trainer.pop("strategy"))  # refuses bad Fit options before anything builds
    except ConfigurationError as err:
        n = trainer.get("devices")
        if not (isinstance(n, int) and n > jax.local_device_count()
                and jax.default_backend() == "cpu"):
            raise
        raise ConfigurationError(
            f"{err} On the command line, --devices {n} simulates {n} CPU devices (set before "
            f"JAX starts): pass --devices {n} --trainer.devices {n}, or only --devices {n}.") \
            from None
    ckpt_path = _eval_ckpt_path(command, recipe_name, fit, ckpt_path, untrained_on_purpose)
    note = None
    if from_recipe:
        overrides = recipe.ckpt_overrides
        if callable(overrides):
            overrides = overrides(config)
        if ckpt_path is not None and overrides:
            config = apply_overrides(config, overrides, f"recipe {recipe.name}")
        module, data = recipe.build(config, trainer["max_steps"])
        if strategy_name is not None:
            sized, note = size_bare_strategy(strategy_name, cfg.mesh_shape, module, seed)
            if sized is not None:
                fit = make_fit(sized)
    _say(f"{command} {recipe.name}: strategy {fit.strategy.name}, {describe_devices()}")
    if note:
        _say(note)
    options = {"ckpt_path": ckpt_path, "seed": seed, "preset": extras["preset"]}
    try:
        if command == "fit":
            metrics, predictions = _fit(recipe, config, ckpt_path, fit, module, data), None
        else:
            metrics, predictions = _evaluate(command, recipe, ckpt_path, extras["output"], fit,
                                             module, data)
    finally:
        for logger in fit.callbacks:  # one run per command: complete on disk when it returns
            finish = getattr(logger, "finish", None)
            if getattr(logger, "is_logger", False) and callable(finish):
                finish()
    return RunResult(fit, module, data, config, options, metrics, predictions)


def _replace_optimizers(cfg, init, module) -> None:
    """`--optimizer`/`--lr_scheduler` replace the module's `configure_optimizers`, as in
    LightningCLI."""
    if cfg.optimizer is not None:
        tx = configure_optimizers(init.optimizer, init.lr_scheduler)
        if type(module).configure_optimizers is not TrainModule.configure_optimizers:
            warnings.warn(f"{type(module).__name__}.configure_optimizers is replaced by "
                          "--optimizer, as LightningCLI does.", UserWarning, stacklevel=3)
        module.configure_optimizers = lambda: tx
    elif cfg.lr_scheduler is not None:
        raise ConfigurationError("--lr_scheduler needs --optimizer (as in LightningCLI).")


def _checkpoint_callbacks(cfg) -> list:
    """The `ModelCheckpoint` that `--checkpoint_every_n_steps` / `--checkpoint_monitor` ask
    for, under `<default_root_dir>/checkpoints`."""
    every, monitor = cfg.checkpoint_every_n_steps, cfg.checkpoint_monitor
    if every is None and not monitor:
        return []
    root = os.path.abspath(cfg.trainer.default_root_dir or "jaxlight_logs")
    return [cbs.ModelCheckpoint(os.path.join(root, "checkpoints"), every_n_steps=every,
                                monitor=monitor, mode=cfg.checkpoint_mode)]


def _check_options(cfg) -> None:
    """Refuses option values that would run but do nothing useful, before anything starts."""
    every = cfg.checkpoint_every_n_steps
    if every is not None and every < 1:
        raise ConfigurationError(
            f"--checkpoint_every_n_steps {every} would save no checkpoint: give a positive "
            "number of steps, or leave the option out for no periodic checkpoints."
        )
    if cfg.checkpoint_mode not in ("min", "max"):
        raise ConfigurationError(
            f"--checkpoint_mode {cfg.checkpoint_mode!r}: give 'min' (lower "
            "--checkpoint_monitor values are better, as for a loss) or 'max' (an accuracy)."
        )


def _find_checkpoint(fit, which: str) -> str:
    """The step directory `--ckpt-path best|last` names for validate/test/predict, found before
    the model is built; a run with nothing to load is refused, not evaluated untrained."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "last" finding nothing is refused below instead
            found = resolve_checkpoint(fit, which)
    except CheckpointError as err:
        raise CheckpointError(
            f"--ckpt_path {which}: {err} On the command line: fit with --checkpoint_monitor "
            "val_loss (--checkpoint_mode max for a metric where higher is better)."
        ) from None
    if found is None:
        looked = ", ".join(loc.dirpath for loc in fit.checkpoint_locations)
        raise CheckpointError(
            f"--ckpt_path last: no complete checkpoint in {looked}; fit with "
            "--checkpoint_every_n_steps N (or --checkpoint_monitor) first, with the same "
            "--trainer.default_root_dir, or pass the path of a checkpoint."
        )
    if jax.process_index() == 0:
        print(f"--ckpt_path {which}: {found}", flush=True)
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


def _fit(recipe, config, ckpt_path, fit, module, data) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    # A resumed fit starts from the checkpoint, not from what before_fit would measure.
    if recipe.before_fit is not None and ckpt_path is None:
        before = recipe.before_fit(fit, module, data, config) or {}
        metrics.update({f"before_{k}": v for k, v in before.items()})
        _report("before training", before)
    last = next(cb for cb in fit.callbacks if isinstance(cb, _LastValidation))
    t0 = time.perf_counter()
    fit.fit(module, ckpt_path=ckpt_path, **_stage_data("fit", recipe, data))
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
                f"{metrics['train_seconds']:.1f} s)", final)
    if recipe.after_fit is not None:
        after = recipe.after_fit(fit, module, data, config) or {}
        metrics.update(after)
        _report("after training", after)
    return metrics


def _evaluate(command, recipe, ckpt_path, output, fit, module, data):
    """validate, test or predict: (metrics, predictions)."""
    if ckpt_path is None:
        verb = "runs" if command == "predict" else "evaluates"
        _say(f"warning: --ckpt_path none: {command} {verb} the model as configure_model "
             "initializes it, not a trained one")
    stage = {"validate": fit.validate, "test": fit.test, "predict": fit.predict}[command]
    result = stage(module, ckpt_path=ckpt_path, **_stage_data(command, recipe, data))
    if command != "predict":
        _report(f"{command} metrics", result)
        return dict(result), None
    arrays = _predict.collect(result)
    for line in _predict.summarize(result, arrays):
        _say(line)
    if output:
        _predict.save(output, arrays)
        _say(f"saved {len(arrays)} arrays to {output}")
    return {}, result


def _say(text: str) -> None:
    if jax.process_index() == 0:
        print(text, flush=True)


def _report(title: str, metrics: dict[str, Any]) -> None:
    if not metrics:
        return
    _say(f"{title}:")
    width = max(len(k) for k in metrics)
    for key, value in metrics.items():
        if isinstance(value, float):
            shown = f"{value:.4f}"
        elif isinstance(value, str) and "\n" in value:
            shown = "\n" + "\n".join(f"    | {line}" for line in value.splitlines())
        else:
            shown = str(value)
        _say(f"  {key:<{width}}  {shown}")


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


def _trainer_kwargs(command: str, trainer_ns, mesh_shape) -> dict[str, Any]:
    """`Fit`'s keywords from the instantiated `trainer` section (`--mesh_shape` builds
    `strategies.Hybrid`)."""
    trainer = dict(vars(trainer_ns))
    if isinstance(trainer.get("strategy"), str):
        if mesh_shape is not None:  # named as the parser's key, given on the line or in a file
            mesh_shape = parse_mesh_shape(mesh_shape, "mesh_shape")
        trainer["strategy"] = build_strategy(trainer["strategy"], mesh_shape)
    elif mesh_shape is not None:
        raise ConfigurationError(
            f"--mesh_shape builds strategies.Hybrid, but --trainer.strategy is "
            f"{type(trainer['strategy']).__name__}; drop one of them.")
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
        root = fit.default_root_dir
        data = "" if ":" not in spec else " --data ..."
        found = os.path.isdir(os.path.join(root, "checkpoints"))
        hint = (f"--ckpt_path last (the newest checkpoint under {root}/checkpoints)" if found
                else f"--ckpt_path PATH, a checkpoint step directory (such as "
                f"{root}/checkpoints/100), a checkpoints directory, 'last' or 'best', as "
                f"written by `jaxlight fit {spec}{data} --checkpoint_every_n_steps N`")
        raise ConfigurationError(
            f"jaxlight {command} {spec} without --ckpt_path would evaluate a randomly "
            f"initialized model, not a trained one; pass {hint}. (To evaluate the "
            "initialization on purpose, pass --ckpt_path none.)")
    if ckpt_path in ("best", "last"):
        ckpt_path = _find_checkpoint(fit, ckpt_path)
    return ckpt_path
