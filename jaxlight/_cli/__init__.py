"""The `jaxlight` command: train, validate, test and predict with recipes or the user's own
module; inspect devices; launch processes.

    jaxlight fit digits --strategy dp
    jaxlight fit gpt --preset tiny --strategy fsdp --max-steps 200 --model.num_layers 4
    jaxlight fit digits --config run.yaml --optim.lr 1e-3
    jaxlight validate digits --ckpt-path jaxlight_logs/checkpoints
    jaxlight fit model.py:Net --data model.py:Data --model.hidden 256 --max-steps 100
    jaxlight predict model.py:Net --data model.py:Data --ckpt-path best --output pred.npz
    jaxlight devices --strategy tp --mesh-shape '[[4,2],["data","tp"]]'
    jaxlight launch --nprocs 2 -- jaxlight fit digits
    jaxlight fit model.py:LitClassifier --data model.py:MyDataModule --config config.yaml \
        --trainer.max_epochs 3 --model.backbone Backbone --model.backbone.hidden_dim 64

The user's module also takes LightningCLI's form (`_lightning_form`: `--trainer.*`,
`--seed_everything`, `--trainer.callbacks+=Name`, `class_path`/`init_args`, `--optimizer`,
`--lr_scheduler`, a `config.yaml` LightningCLI wrote), parsed by jsonargparse from the type
hints of `Fit`, the module and the data; it is chosen by those flags or keys, or by an argument
typed as a class.

Values come, lowest priority first, from: the recipe's defaults (a user module's: its and its
DataModule's `__init__` signatures), `--preset`, `--config FILE` (YAML or JSON), then the command
line. Strategies, callbacks and loggers are looked up by name in
`jaxlight.strategies` and `jaxlight.callbacks` when the command runs.

`--devices N` simulates N CPU devices. XLA reads `XLA_FLAGS` once, when JAX starts its backend,
so the flag is written into the environment before anything touches a device.
"""

from jaxlight._cli._build import build_callbacks, build_loggers, build_strategy, parse_mesh_shape
from jaxlight._cli._config_file import load_config_file
from jaxlight._cli._main import main
from jaxlight._cli._options import RUN_OPTIONS, resolve, run_option_defaults
from jaxlight._cli._run import RunResult, run

__all__ = [
    "RUN_OPTIONS",
    "RunResult",
    "build_callbacks",
    "build_loggers",
    "build_strategy",
    "load_config_file",
    "main",
    "parse_mesh_shape",
    "resolve",
    "run",
    "run_option_defaults",
]
