"""What BaseFinetuning's freeze / unfreeze_and_add_param_group accept as modules."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks


class Net(nnx.Module):
    def __init__(self, rngs):
        self.backbone = nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.relu,
                                       nnx.Linear(16, 16, rngs=rngs), nnx.relu)
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(self.backbone(x))


class Module(jl.TrainModule):
    def configure_model(self, rngs):
        return Net(rngs)

    def configure_optimizers(self):
        return optax.adam(0.01)

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


class Milestones(callbacks.BaseFinetuning):
    """Lightning's fine-tuning template: the backbone's last layers join first."""

    def __init__(self, part):
        super().__init__()
        self.part, self.added = part, []

    def freeze_before_training(self, module):
        self.freeze(self.part(module.model))

    def finetune_function(self, module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(self.part(module.model), optimizer)
            self.added = list(optimizer.param_groups[-1]["params"])


def _fit(cb):
    rng = np.random.default_rng(0)
    data = jl.data.DataLoader({"x": rng.normal(size=(32, 8)).astype(np.float32),
                               "y": rng.normal(size=(32, 8)).astype(np.float32)}, 16)
    jl.Fit("single", max_epochs=2, enable_progress_bar=False, logger=False,
           enable_model_summary=False, enable_checkpointing=False,
           callbacks=[cb]).fit(Module(), data)


def test_a_sequential_slice_holding_activations_freezes_its_linear_layers():
    """`layers[-2:]` of an nnx.Sequential holds nnx.relu (a function, where torch's nn.ReLU is
    a module): it has nothing to freeze. It was refused ("got custom_jvp")."""
    cb = Milestones(lambda model: model.backbone.layers[-2:])
    _fit(cb)
    assert sorted(cb.added) == [("backbone", "layers", 2, "bias"),
                                ("backbone", "layers", 2, "kernel")]


def test_an_element_that_is_not_a_module_is_named_with_a_fix():
    cb = Milestones(lambda model: [model.backbone, [model.head, 3]])
    with pytest.raises(jl.ConfigurationError, match=r"modules\[1\]\[1\] = 3 \(int\).*"
                                                    r"module\.model\.backbone\.layers\[-2:\]"):
        _fit(cb)
