"""Writes `finetuning_config.yaml`: the config that Lightning 2.6's own `fit --print_config`
prints for the shape of its `examples/pytorch/domain_templates/computer_vision_fine_tuning.py`:
a LightningCLI subclass whose `add_arguments_to_parser` adds a callback section
(`finetuning:`, `add_lightning_class_args`), links it and the data's batch size into the model
(`link_arguments`) and sets trainer defaults; `fit` adds `ckpt_path` and `weights_only`.
The model is the example's at the digits' scale (a small torch network; no torchvision, no
download). `finetuning_port.py` is its jaxlight port; tests/test_cli_lightning_config.py runs
the file under jaxlight as it is.

Run under the reference environment (torch CPU + lightning 2.6.6, `make
.venv-conformance/.installed`), never in the regular suite:

    .venv-conformance/bin/python tests/cli_lightning/make_config.py
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import warnings

import lightning
import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks.finetuning import BaseFinetuning
from lightning.pytorch.cli import LightningCLI
from torch import nn

HERE = pathlib.Path(__file__).resolve().parent
warnings.filterwarnings("ignore")


class MilestonesFinetuning(BaseFinetuning):
    def __init__(self, milestones: tuple = (5, 10), train_bn: bool = False):
        super().__init__()
        self.milestones = milestones
        self.train_bn = train_bn

    def freeze_before_training(self, pl_module):
        self.freeze(modules=pl_module.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, pl_module, epoch, optimizer):
        if epoch == self.milestones[0]:
            self.unfreeze_and_add_param_group(modules=pl_module.feature_extractor[-1:],
                                              optimizer=optimizer, train_bn=self.train_bn)
        elif epoch == self.milestones[1]:
            self.unfreeze_and_add_param_group(modules=pl_module.feature_extractor[:-1],
                                              optimizer=optimizer, train_bn=self.train_bn)


class TransferLearningModel(L.LightningModule):
    def __init__(self, hidden: int = 32, train_bn: bool = False, milestones: tuple = (2, 4),
                 batch_size: int = 32, lr: float = 1e-3, lr_scheduler_gamma: float = 1e-1):
        super().__init__()
        self.save_hyperparameters()
        self.feature_extractor = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(),
                                               nn.Linear(hidden, hidden))
        self.fc = nn.Linear(hidden, 10)

    def configure_optimizers(self):
        return torch.optim.Adam(self.fc.parameters(), lr=self.hparams.lr)


class DigitsDataModule(L.LightningDataModule):
    def __init__(self, num_workers: int = 0, batch_size: int = 8):
        super().__init__()
        self.num_workers, self.batch_size = num_workers, batch_size


class MyLightningCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.add_lightning_class_args(MilestonesFinetuning, "finetuning")
        parser.link_arguments("data.batch_size", "model.batch_size")
        parser.link_arguments("finetuning.milestones", "model.milestones")
        parser.link_arguments("finetuning.train_bn", "model.train_bn")
        parser.set_defaults({"trainer.max_epochs": 15, "trainer.enable_model_summary": False,
                             "trainer.num_sanity_val_steps": 0})


def main() -> None:
    #: The flags: a few values off their defaults, so that the test sees them arrive.
    argv = ["fit", "--finetuning.milestones", "[1, 2]", "--data.batch_size", "16",
            "--model.hidden", "16", "--trainer.max_epochs", "3", "--print_config"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        MyLightningCLI(TransferLearningModel, DigitsDataModule, seed_everything_default=1234,
                       args=argv)
    header = (f"# Lightning {lightning.__version__}'s own `fit --print_config` (written by "
              f"tests/cli_lightning/make_config.py, torch {torch.__version__.split('+')[0]}):\n"
              f"# {' '.join(argv[:-1])}\n")
    (HERE / "finetuning_config.yaml").write_text(header + out.getvalue())


if __name__ == "__main__":
    main()
