"""Running a recipe command (`fit`, `validate`, `test`) in this process."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import yaml

from jaxlight import Fit
from jaxlight import callbacks as cbs
from jaxlight._cli._build import (
    build_callbacks,
    build_loggers,
    build_strategy,
    size_bare_strategy,
)
from jaxlight._cli._devices import check_device_count, describe_devices, initialize_distributed
from jaxlight._cli._options import RUN_OPTIONS, fit_signature_defaults, resolve
from jaxlight._errors import ConfigurationError
from jaxlight.recipes._base import apply_overrides, as_dict


@dataclasses.dataclass
class RunResult:
    """What `run` returns: the objects it built and every metric it reported."""

    fit: Any
    module: Any
    data: Any
    config: Any
    options: dict[str, Any]
    metrics: dict[str, Any]



def _fit_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    fit_params = fit_signature_defaults()
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
        printable = {**options, **as_dict(config)}
        print(yaml.safe_dump(printable, sort_keys=False), end="")
        return None
    _check_options(command, recipe.name, options, flags)
    # Join a multi-process job (a no-op alone) before anything starts JAX's backend.
    initialize_distributed()
    if options["devices"] is not None:
        check_device_count(options["devices"])

    strategy = build_strategy(options["strategy"], options["mesh_shape"])
    callbacks = build_callbacks(options["callbacks"])
    loggers = build_loggers(options["logger"]) if not options["fast_dev_run"] else None
    if options["checkpoint_every_n_steps"] is not None:
        if not hasattr(cbs, "ModelCheckpoint"):
            raise ConfigurationError("--checkpoint-every-n-steps needs callbacks.ModelCheckpoint, "
                                     "which this jaxlight does not have.")
        callbacks.append(cbs.ModelCheckpoint(
            os.path.join(os.path.abspath(options["default_root_dir"]), "checkpoints"),
            every_n_steps=options["checkpoint_every_n_steps"]))
    kwargs = _fit_kwargs(options)
    kwargs["fast_dev_run"] = options["fast_dev_run"] or False

    def make_fit(strategy):
        return Fit(strategy, callbacks=[*callbacks, *(loggers or []), _LastValidation()],
                   logger=loggers is not None, **kwargs)

    fit = make_fit(strategy)  # refuses bad Fit options before the recipe builds anything
    overrides = recipe.ckpt_overrides
    if callable(overrides):
        overrides = overrides(config)
    if options["ckpt_path"] is not None and overrides:
        config = apply_overrides(config, overrides, f"recipe {recipe.name}")
    module, data = recipe.build(config, kwargs.get("max_steps"))
    metrics: dict[str, Any] = {}
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
        else:
            _eval_command(command, recipe, options, fit, module, data, metrics, say)
    finally:
        for logger in loggers or []:  # one run per command: complete on disk when it returns
            finish = getattr(logger, "finish", None)
            if callable(finish):
                finish()
    return RunResult(fit, module, data, config, options, metrics)



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
    fit.fit(module, data.train, data.val, ckpt_path=options["ckpt_path"])
    metrics["train_seconds"] = time.perf_counter() - t0
    metrics["global_step"] = fit.global_step
    if data.val is not None:
        # A fit that validated after its last step already measured (and logged) the final
        # model: validating again would log the same metrics twice at one step.
        if last.step == fit.global_step and last.metrics:
            final = dict(last.metrics)
        else:
            final = fit.validate(module, data.val)
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
    split = data.val if command == "validate" else (data.test or data.val)
    if split is None:
        raise ConfigurationError(f"recipe {recipe.name!r} has no {command} data.")
    method = fit.validate if command == "validate" else fit.test
    result = method(module, split, ckpt_path=options["ckpt_path"])
    metrics.update(result)
    _report(f"{command} metrics", result, say)


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
    if command != "fit" and options["ckpt_path"] is None and not untrained_on_purpose:
        root = options["default_root_dir"]
        found = os.path.isdir(os.path.join(root, "checkpoints"))
        hint = (f"--ckpt-path last (the newest checkpoint under {root}/checkpoints)" if found
                else f"--ckpt-path PATH, a checkpoint step directory (such as "
                f"{root}/checkpoints/100), a checkpoints directory, 'last' or 'best', as "
                f"written by `jaxlight fit {recipe_name} --checkpoint-every-n-steps N`")
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
