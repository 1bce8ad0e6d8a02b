"""The `jaxlight` command: train, validate, test and predict with recipes or the user's own
module; inspect devices; launch processes.

    jaxlight fit digits --trainer.strategy dp          (or --strategy dp: the earlier spelling)
    jaxlight fit gpt --preset tiny --trainer.strategy fsdp --trainer.max_steps 200 \
        --model.num_layers 4
    jaxlight fit digits --config run.yaml --optim.lr 1e-3
    jaxlight validate digits --ckpt_path jaxlight_logs/checkpoints
    jaxlight fit model.py:Net --data model.py:Data --model.hidden 256 --max-steps 100
    jaxlight predict model.py:Net --data model.py:Data --ckpt_path best --output pred.npz
    jaxlight devices --strategy tp --mesh-shape '[[4,2],["data","tp"]]'
    jaxlight launch --nprocs 2 -- jaxlight fit digits
    jaxlight fit model.py:LitClassifier --data model.py:MyDataModule --config config.yaml \
        --trainer.max_epochs 3 --model.backbone Backbone --model.backbone.hidden_dim 64

Every run command is read by one parser, LightningCLI's, built with jsonargparse from the type
hints of `Fit` (`--trainer.*`), the module and its data (`--model.*`, `--data.*`; a recipe's
config sections), with `--seed_everything`, `--trainer.callbacks+=Name`,
`class_path`/`init_args`, `--optimizer`, `--lr_scheduler`, `--ckpt_path` and a `config.yaml`
LightningCLI wrote (`_lightning_form`). jaxlight's earlier dashed options (`--max-steps`,
`--strategy`, `--logger`, `--callbacks`, ...) and config files are read through one table of
their keys (`_argv`). Values come, lowest priority first, from the signatures' defaults (a
recipe's defaults, then `--preset`), then `--config` files and flags in order.

`--devices N` simulates N CPU devices. XLA reads `XLA_FLAGS` once, when JAX starts its backend,
so the flag is written into the environment before anything touches a device.

`jaxlight`, `jaxlight -h` and `jaxlight --help` print the top-level help from `_help`, which
imports no JAX, so it appears at once; every other command goes to `_main.main`. The names below
are resolved on first use (PEP 562: `__getattr__` imports them with `importlib.import_module`
from the table `_PUBLIC`), so importing the package costs nothing until one is used.

The top layer (23 of docs/architecture.md): may import anything; nothing imports it.
"""

import importlib as _importlib
import sys as _sys
from collections.abc import Sequence as _Sequence

from jaxlight._cli import _help
from jaxlight._errors import MissingAttributeError as _MissingAttributeError

#: Public name -> the module defining it (imported on first use).
_PUBLIC = {
    "ALIASES": "jaxlight._cli._argv",
    "build_callbacks": "jaxlight._cli._build",
    "build_loggers": "jaxlight._cli._build",
    "build_strategy": "jaxlight._cli._build",
    "parse_mesh_shape": "jaxlight._cli._build",
    "load_config_file": "jaxlight._cli._argv",
    "RunResult": "jaxlight._cli._run",
    "run": "jaxlight._cli._run",
}

__all__ = [
    "ALIASES",
    "RunResult",
    "build_callbacks",
    "build_loggers",
    "build_strategy",
    "load_config_file",
    "main",
    "parse_mesh_shape",
    "run",
]


def main(argv: _Sequence[str] | None = None) -> int:
    """The `jaxlight` console script (`jaxlight._cli._main.main`, whose exit statuses it keeps).
    The top-level help is printed from `_help` without importing JAX, unless the recipes are
    already loaded (a recipe registered in this process is then listed, as `_main` lists it)."""
    args = list(_sys.argv[1:] if argv is None else argv)
    if _help.is_top_help(args) and "jaxlight.recipes" not in _sys.modules:
        return _help.print_top_help(args)
    return _importlib.import_module("jaxlight._cli._main").main(args)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise _MissingAttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    hidden = {"_PUBLIC", "_importlib", "_sys", "_Sequence", "_MissingAttributeError",
              "__getattr__", "__dir__"}
    return sorted({*globals(), *__all__} - hidden)
