"""Lightning's keys in jaxlight's meaning: a `config.yaml` that Lightning's own LightningCLI
wrote, and its `--trainer.*` flags, read as they are.

Each `trainer:` key gets its jaxlight meaning (Lightning's `None` defaults become `Fit`'s,
`max_steps: -1` no limit, and Lightning's 1000 epochs when neither length is set); a key jaxlight
has no meaning for is dropped when it holds Lightning's default, named in a warning otherwise,
and refused where ignoring it would change what is trained. Class paths of Lightning's callbacks
and loggers, torch's optimizers and a script's `__main__` become jaxlight's.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

from jaxlight import callbacks
from jaxlight._errors import ConfigurationError, suggest
from jaxlight.module._porting import TRAINER_ARGS
from jaxlight.optim.torch import TORCH_PATHS

#: Lightning 2.6 `Trainer` arguments that `Fit` takes under the same name, where Lightning's
#: `None` means "the default": the value `Fit` spells that default as.
_NONE_MEANS = {
    "strategy": "auto", "logger": True, "callbacks": [], "fast_dev_run": False,
    "accumulate_grad_batches": 1, "num_sanity_val_steps": 2, "log_every_n_steps": 50,
    "enable_progress_bar": True, "enable_model_summary": True, "gradient_clip_algorithm": "norm",
    "default_root_dir": "jaxlight_logs",
}

#: ... Lightning's values that mean `Fit`'s `None`: no step limit, every device, float32.
_MEANS_NONE = {"max_steps": ("-1",), "devices": ("auto",), "precision": ("32", "32-true")}

#: ... and those whose values mean the same in both (None included: Lightning's
#: `check_val_every_n_epoch: null` makes `val_check_interval` count steps, as in `Fit`).
_AS_THEY_ARE = ("max_epochs", "max_time", "limit_train_batches", "limit_val_batches",
                "val_check_interval", "check_val_every_n_epoch", "gradient_clip_val",
                "enable_checkpointing")

#: Lightning 2.6 `Trainer` arguments without a jaxlight meaning, with Lightning's default. At
#: the default they ask for nothing and are dropped; another value is named in a warning.
_NO_MEANING = {
    "accelerator": "auto", "num_nodes": 1, "deterministic": None,
    "benchmark": None, "inference_mode": True, "use_distributed_sampler": True,
    "profiler": None, "detect_anomaly": False, "barebones": False, "plugins": None,
    "sync_batchnorm": False, "enable_autolog_hparams": True, "model_registry": None,
}

#: ... and those whose other values would change what is trained or evaluated: refused.
_REFUSED = {
    "min_epochs": None, "min_steps": None, "overfit_batches": 0.0, "limit_test_batches": None,
    "limit_predict_batches": None, "reload_dataloaders_every_n_epochs": 0,
}

#: The `trainer.` keys read here (a flag `--trainer.<key>` among them gets its jaxlight value).
TRAINER_KEYS = frozenset({*_NONE_MEANS, *_MEANS_NONE, *_AS_THEY_ARE, *_NO_MEANING, *_REFUSED})

#: Lightning's packages whose callbacks and loggers jaxlight.callbacks holds under their names.
LIGHTNING_PACKAGES = ("lightning.pytorch.callbacks", "lightning.pytorch.loggers",
                      "pytorch_lightning.callbacks", "pytorch_lightning.loggers")

#: Lightning callback and logger arguments jaxlight's classes do not take, at the value that
#: asks for nothing (besides None and False, which never ask for anything here).
_QUIET_ARGUMENTS = {"strict": True, "auto_insert_metric_name": True,
                    "enable_version_counter": True, "log_rank_zero_only": False}

#: torch's optimizer and scheduler paths as jaxlight.optim.torch's.
TORCH_CLASS_PATHS = {k: f"{v.__module__}.{v.__qualname__}" for k, v in TORCH_PATHS.items()}


class Notes:
    """Keys met while adapting a Lightning config: warned about, or refused (`report`)."""

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
            warnings.warn(f"ignored Lightning settings without a jaxlight meaning: {items}.",
                          UserWarning, stacklevel=2)


def trainer_value(key: str, value: Any, notes: Notes) -> tuple[bool, Any]:
    """(keep, value) for one `trainer.<key>` of a Lightning config or flag."""
    if key in _NO_MEANING or key in _REFUSED:
        default = _NO_MEANING.get(key, _REFUSED.get(key))
        if value != default:
            (notes.refused if key in _REFUSED else notes.warned)[key] = value
        return False, None
    if value is None and key in _NONE_MEANS:
        return True, _NONE_MEANS[key]
    if str(value) in _MEANS_NONE.get(key, ()):
        return True, None
    return True, value


def jaxlight_callback(path: str, init_args: Any, notes: Notes, where: str):
    """(class path, init_args) of jaxlight's class of Lightning's name, looked up in
    `jaxlight.callbacks`; arguments it does not take are dropped at a value that asks for
    nothing and named otherwise."""
    name = path.rpartition(".")[2]
    cls = getattr(callbacks, name, None)
    if not inspect.isclass(cls):
        valid = [n for n in getattr(callbacks, "__all__", ())
                 if inspect.isclass(getattr(callbacks, n))]
        raise ConfigurationError(
            f"{where}: {path} has no jaxlight counterpart in jaxlight.callbacks."
            f"{suggest(name, valid)} jaxlight.callbacks has {', '.join(valid)}; remove it or "
            "name one of those.")
    params = inspect.signature(cls).parameters
    if not isinstance(init_args, dict) or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return f"jaxlight.callbacks.{name}", init_args
    kept = {}
    for key, value in init_args.items():
        if key in params:
            kept[key] = value
        elif not (value is None or value is False or _QUIET_ARGUMENTS.get(key, object()) == value):
            notes.warned[f"{where}.init_args.{key}"] = value
    return f"jaxlight.callbacks.{name}", kept


def _class_paths(value: Any, modules: dict[str, Any], notes: Notes, where: str) -> Any:
    """A config tree with jaxlight's class paths: `__main__.X` (a script run as `python
    main.py`) or the script's module to X in the user's file, Lightning's callbacks and loggers
    to `jaxlight.callbacks`' of the same name, torch's optimizers to `jaxlight.optim.torch`."""
    if isinstance(value, list):
        return [_class_paths(v, modules, notes, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    out = {k: _class_paths(v, modules, notes, f"{where}.{k}" if where else str(k))
           for k, v in value.items()}
    path = out.get("class_path")
    if not isinstance(path, str):
        return out
    if path in TORCH_CLASS_PATHS:
        out["class_path"] = TORCH_CLASS_PATHS[path]
    elif path.startswith(LIGHTNING_PACKAGES):
        out["class_path"], init_args = jaxlight_callback(path, out.get("init_args"), notes,
                                                         where)
        if "init_args" in out:
            out["init_args"] = init_args
    elif "." in path:
        home, _, name = path.rpartition(".")
        if home == "__main__" or home in modules:
            found = modules.get(home) or next(
                (m for m in modules.values() if hasattr(m, name)), None)
            if found is not None and hasattr(found, name):
                out["class_path"] = f"{found.__name__}.{name}"
    return out


def adapt_config(data: dict[str, Any], notes: Notes, modules: dict[str, Any]) -> dict[str, Any]:
    """A LightningCLI config tree with jaxlight's class paths and each `trainer:` key in its
    jaxlight meaning."""
    data = _class_paths(dict(data), modules, notes, "")
    trainer = data.get("trainer")
    if isinstance(trainer, dict):
        adapted = {}
        for key, value in trainer.items():
            keep, value = trainer_value(key, value, notes)
            if keep:
                adapted[key] = value
        if ("max_epochs" in trainer or "max_steps" in trainer) and adapted.get(
                "max_epochs") is None and adapted.get("max_steps") is None:
            adapted["max_epochs"] = 1000  # Lightning's length when neither is given
        data["trainer"] = adapted
    return data
