"""Several optimizers and manual optimization (docs/models.md, section 'Several optimizers').

`configure_optimizers` may return named optimizers, each bound to part of the model
(`_named`); with `automatic_optimization = False`, `training_step(self, model, batch, opt)`
sequences their updates inside the one compiled step (`_manual`). `build_optimizer` and
`build_train_step` are what the fit's session calls: they hand everything else to
`jaxlight.step._step`.

May import `step`, `schedules`, `state`, `metrics` and the root modules (layer 14 of
docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optax

from jaxlight.optim._manual import Optimizers, build_manual_step
from jaxlight.optim._named import NamedOptimizers, named_optimizers, resolve
from jaxlight.step import _step

__all__ = ["NamedOptimizers", "Optimizers", "build_optimizer", "build_train_step",
           "is_manual", "named_optimizers"]


def is_manual(module: Any) -> bool:
    """Whether `module` asks for manual optimization (`automatic_optimization = False`)."""
    return getattr(module, "automatic_optimization", True) is False


def build_optimizer(module, callbacks: Sequence) -> tuple[optax.GradientTransformation, Any]:
    """`jaxlight.step._step.build_optimizer`, reading named optimizers too (see `resolve`)."""
    tx, scheduler, named = resolve(module)
    if is_manual(module):
        # Only observers see it (LearningRateMonitor); build_manual_step refuses the rest.
        for cb in callbacks:
            if getattr(cb, "observes_optimizer_only", False):
                cb.transform_optimizer(tx)
        return tx, scheduler
    for cb in callbacks:
        bind = getattr(cb, "bind_optimizer_groups", None)
        if bind is not None:
            bind(None if named is None else named.labels)
    if named is None:
        for cb in callbacks:
            tx = cb.transform_optimizer(tx)
        return tx, scheduler
    # Named optimizers: each callback wraps each optimizer inside the one optax.partition, so
    # a guard or loss scale acts per optimizer (one optimizer's non-finite gradients skip only
    # its update); observers (LearningRateMonitor) see the partition itself.
    txs = dict(named.txs)
    for cb in callbacks:
        if not getattr(cb, "observes_optimizer_only", False):
            txs = {name: cb.transform_optimizer(inner) for name, inner in txs.items()}
    tx = dataclasses.replace(named, txs=txs).transformation()
    for cb in callbacks:
        if getattr(cb, "observes_optimizer_only", False):
            tx = cb.transform_optimizer(tx)
    return tx, scheduler


def build_train_step(module, graphdef, tx, callbacks: Sequence, strategy, frozen: Any = None,
                     log_spec=None):
    """`jaxlight.step._step.build_train_step`, or the manual-optimization step."""
    build = build_manual_step if is_manual(module) else _step.build_train_step
    return build(module, graphdef, tx, callbacks, strategy, frozen=frozen, log_spec=log_spec)
