"""LightningCLI's `--optimizer` and `--lr_scheduler`: torch's optimizers and schedulers that optax
expresses exactly, under torch's names and arguments.

`--optimizer Adam --optimizer.lr 0.01` (or `optimizer: {class_path: torch.optim.Adam, init_args:
...}` in a LightningCLI config) replaces the module's `configure_optimizers`, as LightningCLI
does. Each class builds the optax transformation with torch's update rule: `SGD` (momentum,
nesterov and L2 `weight_decay` as torch adds it to the gradient; `dampening` 0), `Adam` (L2
`weight_decay`), `AdamW` (decoupled decay). `StepLR` and `ExponentialLR` count epochs, as
Lightning steps them by default.
"""

from __future__ import annotations

import optax

from jaxlight._errors import ConfigurationError, MissingMethodError


class TorchOptimizer:
    """A torch optimizer's name and arguments; `build()` is the optax transformation."""

    def build(self):
        raise MissingMethodError(
            f"{type(self).__name__} subclasses TorchOptimizer without build(): return the optax "
            "transformation with torch's update rule (see SGD, Adam, AdamW in "
            "jaxlight.optim.torch).")


class SGD(TorchOptimizer):
    """torch.optim.SGD."""

    def __init__(self, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False):
        if dampening:
            raise ConfigurationError(
                f"--optimizer SGD: dampening={dampening} has no optax form; use dampening 0.")
        self.lr, self.momentum, self.weight_decay, self.nesterov = (
            lr, momentum, weight_decay, nesterov)

    def build(self):
        tx = optax.sgd(self.lr, self.momentum or None, self.nesterov)
        if self.weight_decay:
            tx = optax.chain(optax.add_decayed_weights(self.weight_decay), tx)
        return tx


class Adam(TorchOptimizer):
    """torch.optim.Adam (`weight_decay` is L2 added to the gradient, as in torch)."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False):
        if amsgrad:
            raise ConfigurationError("--optimizer Adam: amsgrad=true is not mapped; leave it "
                                     "false, or return optax.amsgrad from configure_optimizers.")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay

    def build(self):
        tx = optax.adam(self.lr, self.betas[0], self.betas[1], self.eps)
        if self.weight_decay:
            tx = optax.chain(optax.add_decayed_weights(self.weight_decay), tx)
        return tx


class AdamW(TorchOptimizer):
    """torch.optim.AdamW (decoupled weight decay, torch's default 0.01)."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False):
        if amsgrad:
            raise ConfigurationError("--optimizer AdamW: amsgrad=true is not mapped; leave it "
                                     "false.")
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay

    def build(self):
        return optax.adamw(self.lr, self.betas[0], self.betas[1], self.eps,
                           weight_decay=self.weight_decay)


class TorchLRScheduler:
    """A torch scheduler's name and arguments; `build()` is the factor schedule of Lightning's
    `lr_scheduler` dict (by epochs, as Lightning steps a scheduler by default)."""

    def build(self):
        raise MissingMethodError(
            f"{type(self).__name__} subclasses TorchLRScheduler without build(): return the "
            "factor schedule (see StepLR, ExponentialLR in jaxlight.optim.torch).")


class StepLR(TorchLRScheduler):
    """torch.optim.lr_scheduler.StepLR: the rate times gamma every step_size epochs."""

    def __init__(self, step_size: int, gamma: float = 0.1):
        self.step_size, self.gamma = step_size, gamma

    def build(self):
        return optax.exponential_decay(1.0, self.step_size, self.gamma, staircase=True)


class ExponentialLR(TorchLRScheduler):
    """torch.optim.lr_scheduler.ExponentialLR: the rate times gamma every epoch."""

    def __init__(self, gamma: float):
        self.gamma = gamma

    def build(self):
        return optax.exponential_decay(1.0, 1, self.gamma)


#: torch's import paths, as a LightningCLI config names them, and ours.
TORCH_PATHS = {
    "torch.optim.SGD": SGD, "torch.optim.sgd.SGD": SGD,
    "torch.optim.Adam": Adam, "torch.optim.adam.Adam": Adam,
    "torch.optim.AdamW": AdamW, "torch.optim.adamw.AdamW": AdamW,
    "torch.optim.lr_scheduler.StepLR": StepLR,
    "torch.optim.lr_scheduler.ExponentialLR": ExponentialLR,
}


def configure_optimizers(optimizer: TorchOptimizer, scheduler: TorchLRScheduler | None):
    """What LightningCLI's generated `configure_optimizers` returns, in jaxlight's form."""
    tx = optimizer.build()
    if scheduler is None:
        return tx
    return {"optimizer": tx, "lr_scheduler": {"scheduler": scheduler.build(),
                                              "interval": "epoch"}}
