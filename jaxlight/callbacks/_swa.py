"""StochasticWeightAveraging: Lightning's SWA callback, its schedule and average in the step.

Lightning 2.6's `StochasticWeightAveraging` does three things, all reproduced here inside the
compiled step (no host work per step):

- from epoch `swa_start` (`swa_epoch_start - 1`, 0-based; a float is `int(max_epochs *
  swa_epoch_start)` first) it replaces the learning rate by torch's `SWALR` schedule, one value
  per epoch: `lr = swa_lr * a + lr0 * (1 - a)` with `a = anneal(min(1, j / annealing_epochs))`
  after `j` SWA epochs (`anneal`: `(1 - cos(pi t)) / 2` or `t`), `lr0` the rate in force when
  SWA started. The step multiplies the optimizer's updates by `lr / current rate` (Adam, SGD
  and AdamW updates are linear in the rate), as the `configure_optimizers` scheduler does;
- at the start of every epoch from `swa_start` to the last, it folds the parameters into an
  equal-weight running average (torch's `AveragedModel`: the first update copies): here the
  first step of such an epoch averages the parameters it starts from;
- when training ends after the last epoch, it copies the average into the model. Validation
  during fit sees the current model (unlike `WeightAveraging`).

The average, its count and `lr0` live in the optimizer state (`SWAState`), sharded like the
parameters, saved in checkpoints and resumed bit for bit. The epoch a step belongs to is its
optimizer count divided by the optimizer steps per epoch, which the callback reads from the
training data's length when the fit starts (as Lightning, SWA needs a sized loader).
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxlight._errors import ConfigurationError, JaxlightWarning
from jaxlight.callbacks._accumulation import GradientAccumulationScheduler, batches_per_step
from jaxlight.callbacks._base import Callback
from jaxlight.callbacks._lr_monitor import LR_NAMES, constant_rates, find_schedules
from jaxlight.callbacks._weight_averaging import AvgFn, swa_average
from jaxlight.schedules._scheduler import current_factor, one_state_of, states_of

__all__ = ["SWAState", "StochasticWeightAveraging", "optimizer_steps_per_epoch"]


class SWAState(NamedTuple):
    """SWA's part of the optimizer state.

    Attributes:
        average: the averaged parameters (the initial parameters until the first update).
        n_averaged: how many parameter sets the average holds (int32).
        count: optimizer steps taken (int32).
        lr0: the learning rate in force at SWA's first step (float32; 0 before).
        lr: the learning rate the last step applied (float32), for inspection and logging.
    """

    average: Any
    n_averaged: jax.Array
    count: jax.Array
    lr0: jax.Array
    lr: jax.Array


class SWAWrapped(NamedTuple):
    swa: SWAState
    inner: Any


def _injected_rates(opt_state: Any) -> list[jax.Array]:
    """The learning rates of the `optax.inject_hyperparams` states in `opt_state`."""
    def is_injected(x) -> bool:
        return isinstance(getattr(x, "hyperparams", None), dict)

    return [leaf.hyperparams[name] for leaf in jax.tree.leaves(opt_state, is_leaf=is_injected)
            if is_injected(leaf) for name in LR_NAMES if name in leaf.hyperparams]


def constant_rate(tx: optax.GradientTransformation) -> float:
    """The optimizer's constant learning rate (`optax.adam(1e-3)`: 1e-3), or an error."""
    rates = constant_rates(tx)
    if len(rates) != 1:
        raise ConfigurationError(
            f"the optimizer's learning rate is needed as a number, but this optax "
            f"transformation holds {len(rates)} constant rates; give a standard optax "
            "optimizer with a numeric rate (optax.adam(1e-3)).")
    return rates[0]


def rate_reader(tx: optax.GradientTransformation) -> Callable[[Any, jax.Array], jax.Array]:
    """`rate(inner_state_after_update, count)`: the optimizer's own learning rate for the update
    at `count`, without the `configure_optimizers` scheduler's factor.

    Read from an optax schedule, an `optax.inject_hyperparams` state, or a constant rate; any
    other optimizer hides its rate, and SWA, which replaces it, is refused.
    """
    schedules = find_schedules(tx)
    if schedules:
        return lambda state, count: jnp.asarray(schedules[0](count), jnp.float32)
    constants = constant_rates(tx)

    def rate(state, count):
        injected = _injected_rates(state)
        if injected:
            return jnp.asarray(injected[0], jnp.float32)
        if len(constants) == 1:
            return jnp.float32(constants[0])
        raise ConfigurationError(
            "StochasticWeightAveraging replaces the optimizer's learning rate, but it cannot "
            f"read it from this optax transformation (found {len(constants)} constant rates, no "
            "schedule and no optax.inject_hyperparams state). Give the rate as a number or "
            "schedule of a standard optax optimizer (optax.sgd(0.1)), or wrap it: "
            "optax.inject_hyperparams(optax.adam)(learning_rate=1e-3).")

    return rate


def _anneal(strategy: str, t: jax.Array) -> jax.Array:
    if strategy == "cos":
        return (1 - jnp.cos(jnp.pi * t)) / 2
    return t


def swa_transform(inner: optax.GradientTransformation, callback: StochasticWeightAveraging
                  ) -> optax.GradientTransformation:
    """`inner` with SWA's learning rate and running average (see the module docstring).

    The schedule's constants (`callback.swa_start`, `swa_end`, `steps_per_epoch`) are read when
    the step is traced, which happens after `on_fit_start` fixed them.
    """
    rate_of = rate_reader(inner)
    cb = callback

    def init(params):
        # The average *is* the parameters, so that optax.tree_map_params (and with it the
        # strategies' sharding of optimizer slots) recognizes it as parameter-shaped.
        zero = jnp.zeros((), jnp.int32)
        return SWAWrapped(SWAState(params, zero, zero, jnp.zeros((), jnp.float32),
                                   jnp.zeros((), jnp.float32)), inner.init(params))

    def update(updates, state, params=None, **extra):
        if params is None:
            raise ConfigurationError("StochasticWeightAveraging needs the parameters in the "
                                     "optimizer's update (jaxlight's step always passes them).")
        spe, start, end = cb.schedule_constants()
        swa = state.swa
        updates, inner_state = inner.update(updates, state.inner, params, **extra)
        factors = current_factor(inner_state)
        current = rate_of(inner_state, swa.count) * (factors[0] if factors else 1.0)
        epoch = swa.count // spe
        in_swa = epoch >= start
        if end is not None:
            in_swa = in_swa & (epoch <= end)
        first = in_swa & (swa.lr0 == 0)  # SWALR starts from the rate in force
        lr0 = jnp.where(first, current, swa.lr0)
        # SWALR: anneal_epochs=0 starts at swa_lr (torch: step = max(1, step)).
        j = (epoch - start).astype(jnp.float32)
        if cb.annealing_epochs == 0:
            j = jnp.maximum(j, 1.0)
        t = jnp.clip(j / max(1, cb.annealing_epochs), 0.0, 1.0)
        alpha = _anneal(cb.annealing_strategy, t)
        alpha = jnp.where(t >= 1.0, 1.0, alpha)
        target = cb.swa_lr * alpha + lr0 * (1 - alpha)
        # After SWA's last epoch (a max_steps run past max_epochs cannot reach it) the SWA rate
        # stays, as SWALR does.
        after = epoch >= start
        scale = jnp.where(after, target / jnp.where(current == 0, 1.0, current), 1.0)
        updates = jax.tree.map(lambda u: (u * scale).astype(u.dtype), updates)
        applied = jnp.where(after, target, current)
        # The average: at the first step of each SWA epoch, of the parameters it starts from.
        do = in_swa & (swa.count % spe == 0)
        take_first = swa.n_averaged == 0

        def one(a, p):
            new = jnp.where(take_first, p, cb.avg_fn(a, p, swa.n_averaged).astype(a.dtype))
            return jnp.where(do, new.astype(a.dtype), a)

        average = jax.tree.map(one, swa.average, params)
        new = SWAState(average, (swa.n_averaged + do).astype(jnp.int32), swa.count + 1,
                       jnp.asarray(lr0, jnp.float32), jnp.asarray(applied, jnp.float32))
        return updates, SWAWrapped(new, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def optimizer_steps_per_epoch(fit, who: str) -> int:
    """Optimizer steps per epoch of this fit (after limit_train_batches and accumulation), for
    a callback that counts epochs inside the compiled step (`who` names it in errors)."""
    try:
        n = len(fit.train_data)
    except TypeError:
        raise ConfigurationError(
            f"{who} counts epochs inside the compiled step, so it needs training data with "
            "len() (as Lightning's SWA needs a sized loader).") from None
    limit = fit.limit_train_batches
    if isinstance(limit, float):
        limit = max(1, int(n * limit))
    n = min(n, int(limit)) if limit else n
    schedulers = [cb for cb in fit.callbacks if isinstance(cb, GradientAccumulationScheduler)
                  and len(set(cb.scheduling.values())) > 1]
    if schedulers:
        raise ConfigurationError(
            f"{who} with {schedulers[0]!r}: it counts epochs inside the step by a fixed number "
            "of optimizer steps per epoch, which a changing accumulate_grad_batches breaks. Use "
            "one accumulate_grad_batches with it.")
    return max(1, math.ceil(n / batches_per_step(fit.callbacks)))


class StochasticWeightAveraging(Callback):
    """Lightning's `StochasticWeightAveraging`: SWA's learning rate from `swa_epoch_start` on,
    the equal-weight average of the parameters at each later epoch's start, and the average
    copied into the model when training ends (after the last epoch).

    Args:
        swa_lrs: the SWA learning rate (a float; a list of one float, Lightning's per parameter
            group form, is accepted).
        swa_epoch_start: an int >= 1: SWA starts in epoch `swa_epoch_start - 1` (0-based, as
            Lightning counts it); a float in [0, 1]: `int(max_epochs * swa_epoch_start)` first.
        annealing_epochs: epochs of annealing from the rate in force to `swa_lrs`.
        annealing_strategy: `"cos"` or `"linear"`.
        avg_fn: `avg_fn(average, current, n_averaged) -> average` per parameter array; default
            the equal-weight mean.
        device: the average lives with the parameters, sharded like them: only None or "cpu"
            (Lightning's default) are accepted and mean that.

    Departures (docs/porting.md): models with batch normalization get no extra epoch that
    recomputes the batch statistics for the averaged weights (a warning says so); validation
    and checkpoints read the current model during fit, as in Lightning.

    Example:
        >>> from jaxlight import callbacks
        >>> swa = callbacks.StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=0.75)
    """

    def __init__(self, swa_lrs: float | list[float], swa_epoch_start: int | float = 0.8,
                 annealing_epochs: int = 10, annealing_strategy: str = "cos",
                 avg_fn: AvgFn | None = None, device: Any = "cpu"):
        if isinstance(swa_epoch_start, bool) or not isinstance(swa_epoch_start, int | float) \
                or (isinstance(swa_epoch_start, int) and swa_epoch_start < 1) \
                or (isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1):
            raise ConfigurationError(
                f"StochasticWeightAveraging(swa_epoch_start={swa_epoch_start!r}) should be an "
                "integer >= 1 (the 1-based epoch SWA starts in) or a float between 0 and 1 (a "
                "fraction of max_epochs).")
        lrs = swa_lrs if isinstance(swa_lrs, list) else [swa_lrs]
        if len(lrs) != 1 or isinstance(lrs[0], bool) \
                or not isinstance(lrs[0], numbers.Real) or lrs[0] <= 0:
            raise ConfigurationError(
                f"StochasticWeightAveraging(swa_lrs={swa_lrs!r}) should be a positive float "
                "(jaxlight has one parameter group per optimizer, so a list holds one value).")
        if annealing_strategy not in ("cos", "linear"):
            raise ConfigurationError(
                f"StochasticWeightAveraging(annealing_strategy={annealing_strategy!r}) should be "
                "'cos' or 'linear'.")
        if isinstance(annealing_epochs, bool) or not isinstance(annealing_epochs, int) \
                or annealing_epochs < 0:
            raise ConfigurationError(
                f"StochasticWeightAveraging(annealing_epochs={annealing_epochs!r}) should be a "
                "non-negative integer.")
        if avg_fn is not None and not callable(avg_fn):
            raise ConfigurationError("StochasticWeightAveraging(avg_fn=...) should be callable.")
        if device not in (None, "cpu"):
            raise ConfigurationError(
                f"StochasticWeightAveraging(device={device!r}): the average lives with the "
                "parameters, sharded like them; there is no other device to put it on.")
        self.swa_lr = float(lrs[0])
        self.swa_lrs = swa_lrs
        self.swa_epoch_start = swa_epoch_start
        self.annealing_epochs = annealing_epochs
        self.annealing_strategy = annealing_strategy
        self.avg_fn = avg_fn or swa_average
        self._constants: tuple[int, int, int | None] | None = None
        self._transfer = False

    # -- the schedule's constants, fixed when the fit starts --------------------------------

    def schedule_constants(self) -> tuple[int, int, int | None]:
        """(optimizer steps per epoch, first SWA epoch, last SWA epoch or None), 0-based."""
        if self._constants is None:
            raise ConfigurationError(
                "StochasticWeightAveraging's step needs the epoch length, known once a fit "
                "starts (Fit.fit); it cannot be compiled outside a fit (Fit.plan).")
        return self._constants

    @property
    def swa_start(self) -> int:
        return self.schedule_constants()[1]

    def on_fit_start(self, fit, module) -> None:
        max_epochs = fit.max_epochs
        start = self.swa_epoch_start
        if isinstance(start, float):
            if max_epochs is None:
                raise ConfigurationError(
                    f"StochasticWeightAveraging(swa_epoch_start={start}) is a fraction of "
                    "max_epochs, but the fit has none; give max_epochs or an integer "
                    "swa_epoch_start.")
            start = int(max_epochs * start)
        spe = optimizer_steps_per_epoch(fit, "StochasticWeightAveraging")
        end = None if max_epochs is None else max_epochs - 1
        constants = (spe, max(start - 1, 0), end)
        if self._constants is not None and self._constants != constants \
                and fit.compile_counts.get("train", 0):
            raise ConfigurationError(
                f"StochasticWeightAveraging: this Fit's step was compiled for (steps per "
                f"epoch, first, last SWA epoch) = {self._constants}; this fit needs "
                f"{constants}. Use a new Fit and callback.")
        self._constants = constants
        self._transfer = False
        if any(isinstance(m, nnx.BatchNorm) for _, m in nnx.iter_graph(module.model)):
            warnings.warn(
                "StochasticWeightAveraging: the model has BatchNorm; Lightning trains one more "
                "epoch to recompute its statistics for the averaged weights, jaxlight does not "
                "(the final model keeps the last statistics). See docs/porting.md.",
                JaxlightWarning, stacklevel=2)

    # -- the step --------------------------------------------------------------------------

    def transform_optimizer(self, tx):
        return swa_transform(tx, self)

    # -- training end: the average becomes the model -------------------------------------

    def on_train_end(self, fit, module) -> None:
        # Lightning: when the last epoch (swa_end) was trained, or max_epochs is unbounded.
        _, _, end = self.schedule_constants()
        self._transfer = end is None or fit.current_epoch - 1 == end

    def evaluation_state(self, state):
        # Validation during fit reads the current model; only the end of training (after
        # on_train_end decided) reads the average.
        if not self._transfer or state.opt_state is None \
                or not states_of(state.opt_state, SWAState):
            return state
        swa = one_state_of(state.opt_state, SWAState, "StochasticWeightAveraging",
                           "SWA states")
        return state.replace(params=swa.average)

    def __repr__(self) -> str:
        return (f"StochasticWeightAveraging(swa_lrs={self.swa_lrs}, swa_epoch_start="
                f"{self.swa_epoch_start}, annealing_epochs={self.annealing_epochs}, "
                f"annealing_strategy={self.annealing_strategy!r})")
