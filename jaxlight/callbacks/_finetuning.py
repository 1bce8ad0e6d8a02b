"""BaseFinetuning and BackboneFinetuning: Lightning's freezing and unfreezing mid-run.

In Lightning a frozen parameter has `requires_grad=False` and is not in the optimizer (the
optimizer is built over the trainable ones); `unfreeze_and_add_param_group` later adds it as a
new parameter group with its own learning rate, and torch creates its optimizer state (Adam's
moments, its step count) at its first update. jaxlight reproduces that inside one compiled step:

- every parameter array has its own optimizer state (the optimizer applied per parameter with
  `optax.masked`, so each has its own step count, as torch's per-parameter state), sharded like
  the parameter, saved in checkpoints and resumed bit for bit;
- each epoch has a table row: which parameters are in the optimizer and at which learning rate.
  A parameter outside it gets no update and its state stays as initialized (zero moments, count
  0), so it starts from zero when it joins; the learning rate scales its updates (Adam, SGD and
  AdamW updates are linear in the rate).

The table comes from the callback's own hooks, run on the host when the fit starts, epoch by
epoch, against a stand-in optimizer (`ParamGroups`) that records `add_param_group` and the
groups' `lr`: `freeze_before_training(module)` and `finetune_function(module, epoch, optimizer)`
keep Lightning's meaning as long as they depend on the epoch (not on metrics), which is how
Lightning's own BackboneFinetuning works.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlight._errors import ConfigurationError, MissingMethodError
from jaxlight.callbacks._base import Callback
from jaxlight.callbacks._lr_monitor import find_schedulers, find_schedules
from jaxlight.callbacks._swa import constant_rate, optimizer_steps_per_epoch
from jaxlight.schedules._scheduler import ScheduleState

__all__ = ["BackboneFinetuning", "BaseFinetuning", "ParamGroups"]

Path = tuple


class FinetuneState(NamedTuple):
    """The per-parameter optimizer states (one `optax.masked` state per parameter array, in
    the parameters' order) and the optimizer steps taken (int32)."""

    per_param: tuple
    count: jax.Array


def _key(k: Any) -> Any:
    return getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))


def param_paths(params: Any) -> list[Path]:
    """The path of every parameter array, in `jax.tree.leaves` order."""
    return [tuple(_key(k) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


class ParamGroups:
    """What `finetune_function` gets in the optimizer's place: `param_groups` (a list of dicts
    with "params", a list of parameter paths, and "lr") and `add_param_group`."""

    def __init__(self, params: list[Path], lr: float):
        self.param_groups: list[dict[str, Any]] = [{"params": list(params), "lr": lr}]

    def add_param_group(self, group: dict[str, Any]) -> None:
        self.param_groups.append({"lr": self.param_groups[0]["lr"], **group,
                                  "params": list(group["params"])})


def _module_params(model: nnx.Module) -> dict[int, Path]:
    """id(nnx.Param) -> its path in `model`."""
    return {id(node): tuple(path) for path, node in nnx.iter_graph(model)
            if isinstance(node, nnx.Param)}


def _as_list(modules: Any, where: str = "modules") -> list:
    """The nnx.Modules in `modules` (a module, or nested iterables of them). A parameterless
    callable among them (an activation such as `nnx.relu` in an `nnx.Sequential`'s layers, the
    place torch's `nn.ReLU` module holds) has nothing to freeze and is skipped."""
    if isinstance(modules, nnx.Module):
        return [modules]
    if isinstance(modules, Iterable) and not isinstance(modules, str | bytes):
        return [m for i, item in enumerate(modules) for m in _as_list(item, f"{where}[{i}]")]
    if callable(modules) and not isinstance(modules, nnx.Variable):
        return []
    shown = repr(modules)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    raise ConfigurationError(
        f"BaseFinetuning got {where} = {shown} ({type(modules).__name__}), which is neither an "
        "nnx.Module, an iterable of them, nor a parameterless function such as nnx.relu. Pass "
        "the sub-modules that hold the parameters: module.model.backbone, or a slice of an "
        "nnx.Sequential's layers (module.model.backbone.layers[-2:]).")


class BaseFinetuning(Callback):
    """Lightning's `BaseFinetuning`: override `freeze_before_training(module)` and
    `finetune_function(module, epoch, optimizer)`, using `freeze`, `make_trainable` and
    `unfreeze_and_add_param_group` on sub-modules of `module.model`.

    Frozen parameters are not in the optimizer: no update, no optimizer state change, so their
    Adam moments and step count start at zero when `unfreeze_and_add_param_group` adds them
    (as in Lightning with an optimizer built over the trainable parameters). Everything happens
    inside the one compiled step; see the module docstring for how the hooks are run (once per
    epoch at fit start: they may depend on the epoch, not on metrics).

    Departures (docs/porting.md): BatchNorm statistics are not frozen with the parameters; the
    optimizer's rate must be a constant (a number, or `optax.inject_hyperparams`); a
    transformation that couples parameters inside the optax chain (`clip_by_global_norm`) sees
    one parameter at a time (use `gradient_clip_val` instead).

    Example:
        >>> from jaxlight import callbacks
        >>> class Unfreeze(callbacks.BaseFinetuning):
        ...     def freeze_before_training(self, module):
        ...         self.freeze(module.model.backbone)
        ...     def finetune_function(self, module, epoch, optimizer):
        ...         if epoch == 2:
        ...             self.unfreeze_and_add_param_group(module.model.backbone, optimizer)
    """

    def __init__(self) -> None:
        self._frozen: set[Path] = set()
        self._paths: dict[int, Path] = {}
        self._table: tuple[np.ndarray, np.ndarray, int] | None = None
        #: group[epoch, param]: the parameter group each parameter is in (-1: none).
        self._groups: np.ndarray | None = None
        self._lr = 0.0
        self._schedulers: list = []

    # -- Lightning's helpers ---------------------------------------------------------------

    def _paths_of(self, modules: Any, skip_batchnorm: bool) -> list[Path]:
        """The paths of `modules`' parameters, a BatchNorm's left out with `skip_batchnorm`."""
        out = []
        for module in _as_list(modules):
            for path, node in nnx.iter_graph(module):
                if not isinstance(node, nnx.Param) or id(node) not in self._paths:
                    continue
                owner = path[:-1]
                parent = module
                for part in owner:
                    parent = parent[part] if isinstance(part, int) else getattr(parent, part)
                if skip_batchnorm and isinstance(parent, nnx.BatchNorm):
                    continue
                out.append(self._paths[id(node)])
        return out

    def freeze(self, modules: Any, train_bn: bool = True) -> None:
        """Takes the parameters of `modules` out of training (BatchNorm's stay with
        `train_bn`)."""
        self._frozen.update(self._paths_of(modules, skip_batchnorm=train_bn))

    def make_trainable(self, modules: Any) -> None:
        """Marks the parameters of `modules` trainable (they still join the optimizer only
        through a parameter group)."""
        self._frozen.difference_update(self._paths_of(modules, skip_batchnorm=False))

    def unfreeze_and_add_param_group(self, modules: Any, optimizer: ParamGroups,
                                     lr: float | None = None, initial_denom_lr: float = 10.0,
                                     train_bn: bool = True) -> None:
        """Lightning's: makes `modules` trainable and adds their parameters not yet in the
        optimizer as a new group, at `lr`, or the first group's rate / `initial_denom_lr`. As in
        Lightning, a BatchNorm's parameters join the group only with `train_bn` (`freeze` reads
        the same flag the other way: with it, a BatchNorm stays trainable)."""
        self.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom = initial_denom_lr if lr is None else 1.0
        present = {p for g in optimizer.param_groups for p in g["params"]}
        params = [p for p in self._paths_of(modules, skip_batchnorm=not train_bn)
                  if p not in present]
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom})

    def freeze_before_training(self, module) -> None:
        raise MissingMethodError(
            f"{type(self).__name__} subclasses BaseFinetuning without freeze_before_training: "
            "define `def freeze_before_training(self, module)` and freeze there what trains "
            "later (e.g. self.freeze(module.model.backbone)).")

    def finetune_function(self, module, epoch: int, optimizer: ParamGroups) -> None:
        raise MissingMethodError(
            f"{type(self).__name__} subclasses BaseFinetuning without finetune_function: define "
            "`def finetune_function(self, module, epoch, optimizer)` and unfreeze there (e.g. "
            "self.unfreeze_and_add_param_group(module.model.backbone, optimizer) at some epoch).")

    # -- the table, made at fit start --------------------------------------------------------

    def _epoch_factors(self, epochs: int, spe: int) -> np.ndarray:
        """The lr_scheduler's factor in each epoch's first step (ones without one): what
        Lightning's `optimizer.param_groups[0]["lr"]` holds, over the optimizer's rate, when
        `finetune_function` runs at the epoch's start."""
        if not self._schedulers:
            return np.ones(epochs)
        sched = self._schedulers[0]
        if sched.plateau is not None:
            raise ConfigurationError(
                f"{type(self).__name__} runs finetune_function for every epoch when the fit "
                "starts, where the rate a plateau scheduler will have is unknown (it depends on "
                "the validation metric); use an epoch or step schedule (a function of the "
                "epoch or step), or no lr_scheduler.")
        # The scheduler's count at each epoch's start (see Scheduler.apply: a step schedule
        # drops each epoch's batches short of a full `frequency`).
        per_epoch = 1 if sched.interval == "epoch" else spe // sched.frequency * sched.frequency
        return np.asarray([float(sched.schedule(e * per_epoch // sched.frequency))
                           for e in range(epochs)], np.float64)

    def on_fit_start(self, fit, module) -> None:
        if fit.max_epochs is None:
            raise ConfigurationError(
                f"{type(self).__name__} runs its hooks for every epoch when the fit starts, so "
                "it needs Fit(max_epochs=...).")
        spe = optimizer_steps_per_epoch(fit, type(self).__name__)
        model = module.model
        self._paths = _module_params(model)
        order = param_paths(fit.state.params)
        index = {p: i for i, p in enumerate(order)}
        factors = self._epoch_factors(fit.max_epochs, spe)
        self._frozen = set()
        self.freeze_before_training(module)
        optimizer = ParamGroups([p for p in order if p not in self._frozen],
                                self._lr * factors[0])
        active = np.zeros((fit.max_epochs, len(order)), bool)
        lrs = np.zeros((fit.max_epochs, len(order)), np.float32)
        groups = np.full((fit.max_epochs, len(order)), -1, np.int32)
        for epoch in range(fit.max_epochs):
            if epoch and factors[epoch - 1]:
                # Lightning steps an epoch scheduler at the epoch's end, multiplying every
                # group's rate (torch's StepLR, MultiStepLR, ExponentialLR), before the next
                # epoch's finetune_function reads and sets them.
                for group in optimizer.param_groups:
                    group["lr"] = group["lr"] * factors[epoch] / factors[epoch - 1]
            self.finetune_function(module, epoch, optimizer)
            for g, group in enumerate(optimizer.param_groups):
                for path in group["params"]:
                    if path not in index:
                        raise ConfigurationError(
                            f"{type(self).__name__}: parameter group names {path}, which is "
                            f"not a trainable parameter of the model.")
                    if path not in self._frozen:
                        active[epoch, index[path]] = True
                        groups[epoch, index[path]] = g
                        # The step multiplies by the scheduler's factor itself.
                        lrs[epoch, index[path]] = (group["lr"] / factors[epoch]
                                                   if factors[epoch] else 0.0)
        old = self._table
        if old is not None and fit.compile_counts.get("train", 0) and not (
                old[2] == spe and np.array_equal(old[0], active)
                and np.array_equal(old[1], lrs)):
            raise ConfigurationError(
                f"{type(self).__name__}: this Fit's step was compiled with another epoch table "
                "(parameter groups, rates or epoch length); use a new Fit and callback.")
        self._table = (active, lrs, spe)
        self._groups = groups

    def group_rates(self, opt_state: Any) -> jax.Array:
        """Each parameter group's rate in the epoch of the step about to update `opt_state`
        (traceable), without the lr_scheduler's factor; 0 for a group not yet added. Read by
        `LearningRateMonitor` (`lr-Adam/pg1`, `lr-Adam/pg2`, ... as in Lightning)."""
        active, lrs, spe = self.table()
        groups = self._groups
        table = np.zeros((groups.shape[0], max(1, int(groups.max()) + 1)), np.float32)
        for epoch, row in enumerate(groups):
            for param, g in enumerate(row):
                if g >= 0 and active[epoch, param]:
                    table[epoch, g] = lrs[epoch, param]
        count = [s.count for s in jax.tree.leaves(
            opt_state, is_leaf=lambda x: isinstance(x, FinetuneState))
            if isinstance(s, FinetuneState)][0]
        epoch = jnp.minimum(count // spe, table.shape[0] - 1)
        return jnp.asarray(table)[epoch]

    def table(self) -> tuple[np.ndarray, np.ndarray, int]:
        """(active[epoch, param], lr[epoch, param] without the lr_scheduler's factor, optimizer
        steps per epoch)."""
        if self._table is None:
            raise ConfigurationError(
                f"{type(self).__name__}'s step needs its table, made when a fit starts "
                "(Fit.fit); it cannot be compiled outside a fit (Fit.plan).")
        return self._table

    # -- the step --------------------------------------------------------------------------

    def transform_optimizer(self, tx):
        if find_schedules(tx):
            raise ConfigurationError(
                f"{type(self).__name__} gives each parameter group its own constant rate, but "
                "the optimizer's rate is a schedule; give it a number.")
        self._lr = constant_rate(tx)
        self._schedulers = find_schedulers(tx)
        return per_parameter(tx, self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def per_parameter(tx: optax.GradientTransformation, cb: BaseFinetuning
                  ) -> optax.GradientTransformation:
    """`tx` applied per parameter array, each only in the epochs `cb.table()` has it active,
    at its rate there (see the module docstring)."""

    def masks(params):
        n = len(jax.tree.leaves(params))
        treedef = jax.tree.structure(params)
        return [treedef.unflatten([i == j for j in range(n)]) for i in range(n)]

    def init(params):
        per = tuple(optax.masked(tx, m).init(params) for m in masks(params))
        return FinetuneState(per, jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        active, lrs, spe = cb.table()
        epoch = jnp.minimum(state.count // spe, active.shape[0] - 1)
        on = jnp.asarray(active)[epoch]
        scale = jnp.asarray(lrs)[epoch] / cb._lr
        treedef = jax.tree.structure(updates)
        out = treedef.flatten_up_to(updates)
        new_states = []
        for i, (m, old) in enumerate(zip(masks(updates), state.per_param, strict=True)):
            u, new = optax.masked(tx, m).update(updates, old, params)
            u_i = treedef.flatten_up_to(u)[i]
            out[i] = jnp.where(on[i], u_i * scale[i], jnp.zeros_like(u_i)).astype(u_i.dtype)
            new_states.append(_keep_where(on[i], new, old))
        return treedef.unflatten(out), FinetuneState(tuple(new_states), state.count + 1)

    return optax.GradientTransformation(init, update)


def _keep_where(on: jax.Array, new: Any, old: Any) -> Any:
    """`new` where the parameter is in the optimizer this epoch, else `old`; an lr_scheduler's
    counters always advance (its schedule is the whole optimizer's, as in torch, not restarted
    for a parameter that joins later)."""

    def merge(n, o):
        if isinstance(n, ScheduleState):
            return n._replace(inner=jax.tree.map(lambda a, b: jnp.where(on, a, b),
                                                 n.inner, o.inner))
        return jnp.where(on, n, o)

    return jax.tree.map(merge, new, old, is_leaf=lambda x: isinstance(x, ScheduleState))


def multiplicative(epoch: int) -> float:
    """Lightning's default `lambda_func`: the backbone's rate doubles every epoch."""
    del epoch
    return 2.0


class BackboneFinetuning(BaseFinetuning):
    """Lightning's `BackboneFinetuning`: `module.model.backbone` frozen until
    `unfreeze_backbone_at_epoch`, then trained as a new parameter group at
    `backbone_initial_lr` (default: the optimizer's rate × `backbone_initial_ratio_lr`),
    multiplied by `lambda_func(epoch + 1)` each later epoch and, with `should_align`, never
    above the optimizer's rate.

    Example:
        >>> from jaxlight import callbacks
        >>> finetune = callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=2)
    """

    def __init__(self, unfreeze_backbone_at_epoch: int = 10,
                 lambda_func: Callable[[int], float] = multiplicative,
                 backbone_initial_ratio_lr: float = 10e-2,
                 backbone_initial_lr: float | None = None, should_align: bool = True,
                 initial_denom_lr: float = 10.0, train_bn: bool = True, verbose: bool = False,
                 rounding: int = 12):
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def on_fit_start(self, fit, module) -> None:
        if not isinstance(getattr(module.model, "backbone", None), nnx.Module):
            raise ConfigurationError(
                "BackboneFinetuning needs the model (configure_model's) to have an nnx.Module "
                "attribute `backbone`.")
        self.previous_backbone_lr = None
        super().on_fit_start(fit, module)

    def freeze_before_training(self, module) -> None:
        self.freeze(module.model.backbone)

    def finetune_function(self, module, epoch: int, optimizer: ParamGroups) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            initial = (self.backbone_initial_lr if self.backbone_initial_lr is not None
                       else current_lr * self.backbone_initial_ratio_lr)
            self.previous_backbone_lr = initial
            self.unfreeze_and_add_param_group(module.model.backbone, optimizer, initial,
                                              train_bn=self.train_bn,
                                              initial_denom_lr=self.initial_denom_lr)
        elif epoch > self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            nxt = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            nxt = current_lr if (self.should_align and nxt > current_lr) else nxt
            optimizer.param_groups[-1]["lr"] = nxt
            self.previous_backbone_lr = nxt

    def __repr__(self) -> str:
        return (f"BackboneFinetuning(unfreeze_backbone_at_epoch="
                f"{self.unfreeze_backbone_at_epoch})")
