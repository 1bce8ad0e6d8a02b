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
their keys (`_aliases`). Values come, lowest priority first, from the signatures' defaults (a
recipe's defaults, then `--preset`), then `--config` files and flags in order.

`--devices N` simulates N CPU devices. XLA reads `XLA_FLAGS` once, when JAX starts its backend,
so the flag is written into the environment before anything touches a device.

The top layer (23 of docs/architecture.md): may import anything; nothing imports it.
"""

from jaxlight._cli._aliases import ALIASES
from jaxlight._cli._build import build_callbacks, build_loggers, build_strategy, parse_mesh_shape
from jaxlight._cli._config_file import load_config_file
from jaxlight._cli._main import main
from jaxlight._cli._run import RunResult, run

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
