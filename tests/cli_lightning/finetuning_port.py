"""The jaxlight port of `make_config.py`'s LightningCLI program (Lightning's
computer_vision_fine_tuning.py at the digits' scale): the module, its data, the callback, and
the LightningCLI subclass's `add_arguments_to_parser` as a function of this file, which
`jaxlight fit` calls with its parser, as LightningCLI calls the method."""

from __future__ import annotations

import optax
from flax import nnx

import jaxlight as jl
from jaxlight.recipes.digits import DataConfig, load_digits


class MilestonesFinetuning(jl.callbacks.BaseFinetuning):
    def __init__(self, milestones: tuple = (5, 10), train_bn: bool = False):
        super().__init__()
        self.milestones = tuple(milestones)
        self.train_bn = train_bn

    def freeze_before_training(self, module):
        self.freeze(module.model.feature_extractor, train_bn=self.train_bn)

    def finetune_function(self, module, epoch, optimizer):
        layers = module.model.feature_extractor.layers
        if epoch == self.milestones[0]:
            self.unfreeze_and_add_param_group(layers[2], optimizer, train_bn=self.train_bn)
        elif epoch == self.milestones[1]:
            self.unfreeze_and_add_param_group(layers[0], optimizer, train_bn=self.train_bn)


class Net(nnx.Module):
    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.feature_extractor = nnx.Sequential(nnx.Linear(64, hidden, rngs=rngs), nnx.relu,
                                                nnx.Linear(hidden, hidden, rngs=rngs))
        self.fc = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x):
        return self.fc(nnx.relu(self.feature_extractor(x)))


class TransferLearningModel(jl.TrainModule):
    def __init__(self, hidden: int = 32, train_bn: bool = False, milestones: tuple = (2, 4),
                 batch_size: int = 32, lr: float = 1e-3, lr_scheduler_gamma: float = 1e-1):
        super().__init__()
        self.hidden, self.train_bn, self.milestones = hidden, train_bn, tuple(milestones)
        self.batch_size, self.lr = batch_size, lr

    def configure_model(self, rngs):
        return Net(self.hidden, rngs)

    def configure_optimizers(self):
        return optax.adam(self.lr)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


class DigitsDataModule(jl.DataModule):
    def __init__(self, num_workers: int = 0, batch_size: int = 8):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage):
        self.splits = load_digits(DataConfig())

    def train_dataloader(self):
        return jl.data.ArrayLoader(self.splits["train"], self.batch_size, shuffle=False)


def add_arguments_to_parser(parser):
    """MyLightningCLI.add_arguments_to_parser, as it was."""
    parser.add_lightning_class_args(MilestonesFinetuning, "finetuning")
    parser.link_arguments("data.batch_size", "model.batch_size")
    parser.link_arguments("finetuning.milestones", "model.milestones")
    parser.link_arguments("finetuning.train_bn", "model.train_bn")
    parser.set_defaults({"trainer.max_epochs": 15, "trainer.enable_model_summary": False,
                         "trainer.num_sanity_val_steps": 0})
