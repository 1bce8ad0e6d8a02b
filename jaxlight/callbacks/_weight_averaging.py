"""WeightAveraging and EMAWeightAveraging: Lightning's averaged model, kept in the step.

The average lives in the optimizer state, in an optax transformation of its own
(`average_parameters`), so it is updated inside the compiled step right after the optimizer's
update, sharded like the parameters (each average leaf has its parameter's path and shape),
saved in checkpoints and resumed bit for bit. Validation during fit and the trained model read
it through `evaluation_state`, as Lightning swaps the averaged weights in for validation and
copies them into the model when training ends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback
from jaxlight.schedules._scheduler import one_state_of, states_of

__all__ = ["EMAWeightAveraging", "WeightAveraging", "average_parameters"]

AvgFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


class AveragingState(NamedTuple):
    """The averaged parameters, how many updates they average, and optimizer steps taken."""

    average: Any
    n_averaged: jax.Array
    count: jax.Array


class AveragedState(NamedTuple):
    averaging: AveragingState
    inner: Any


def swa_average(average: jax.Array, current: jax.Array, n_averaged: jax.Array) -> jax.Array:
    """torch's default (`AveragedModel` without `avg_fn`): the equal-weight running mean."""
    return average + (current - average) / (n_averaged + 1).astype(average.dtype)


def ema_average(decay: float) -> AvgFn:
    """torch's `get_ema_avg_fn(decay)`: `decay * average + (1 - decay) * current`."""
    def average_fn(average, current, n_averaged):
        del n_averaged
        return decay * average + (1 - decay) * current
    return average_fn


def average_parameters(inner: optax.GradientTransformation, avg_fn: AvgFn,
                       should_update: Callable[[jax.Array], jax.Array]
                       ) -> optax.GradientTransformation:
    """`inner`, plus a running average of the parameters it produces (optax style).

    After each update, where `should_update(step_idx)` (step_idx: the zero-based index of this
    optimizer step, a traced int32) is true, the average of the new parameters is updated as
    torch's `AveragedModel.update_parameters` does: the first update copies them, later ones
    apply `avg_fn(average, current, n_averaged)`. Until the first update the average holds the
    initial parameters (Lightning copies the model when fit starts).
    """

    def init(params):
        # The average *is* the parameters here, so that optax.tree_map_params (and with it the
        # strategies' sharding of optimizer slots) recognizes it as parameter-shaped.
        zero = jnp.zeros((), jnp.int32)
        return AveragedState(AveragingState(params, zero, zero), inner.init(params))

    def update(updates, state, params=None):
        if params is None:
            raise ConfigurationError("WeightAveraging needs the parameters in the optimizer's "
                                     "update (jaxlight's step always passes them).")
        updates, inner_state = inner.update(updates, state.inner, params)
        current = optax.apply_updates(params, updates)
        avg = state.averaging
        do = jnp.asarray(should_update(avg.count), jnp.bool_)
        first = avg.n_averaged == 0

        def one(a, c):
            new = jnp.where(first, c, avg_fn(a, c, avg.n_averaged).astype(a.dtype))
            return jnp.where(do, new, a)

        average = jax.tree.map(one, avg.average, current)
        averaging = AveragingState(average, (avg.n_averaged + do).astype(jnp.int32),
                                   avg.count + 1)
        return updates, AveragedState(averaging, inner_state)

    return optax.GradientTransformation(init, update)


class WeightAveraging(Callback):
    """Lightning's `WeightAveraging`: an averaged copy of the parameters, updated after every
    optimizer step where `should_update(step_idx)` says so; validation during fit and the final
    model use the average (`module.model` after `fit` holds it, as Lightning copies it into the
    module when training ends).

    Inside the compiled step (no host work per step); the average is kept in the optimizer
    state, sharded like the parameters and saved in checkpoints, so a resumed fit continues it
    bit for bit.

    Args:
        avg_fn: `avg_fn(average, current, n_averaged) -> average` per parameter array (torch's
            `avg_fn`); default the equal-weight mean (SWA).
        use_buffers: Lightning's default True also averages buffers; jaxlight averages the
            trainable parameters only (non-trainable variables such as batch statistics stay
            the current model's): see docs/porting.md. Pass False to say so explicitly.

    Override `should_update(self, step_idx)` to choose the steps: `step_idx` is a traced
    int32, so combine conditions with `jnp.logical_and` rather than `and`.

    Example:
        >>> from jaxlight import callbacks
        >>> swa = callbacks.WeightAveraging()
    """

    def __init__(self, avg_fn: AvgFn | None = None, *, use_buffers: bool = True,
                 device: Any = None, **kwargs: Any):
        if device is not None:
            raise ConfigurationError(
                f"{type(self).__name__}(device={device!r}): the average lives with the "
                "parameters, sharded like them; there is no other device to put it on.")
        if kwargs:
            raise ConfigurationError(
                f"{type(self).__name__} got {sorted(kwargs)}: of torch's AveragedModel "
                "arguments jaxlight takes avg_fn (multi_avg_fn has no jaxlight form).")
        self.avg_fn = avg_fn or swa_average
        self.use_buffers = use_buffers

    def should_update(self, step_idx: jax.Array) -> jax.Array:
        """Whether to average after the optimizer step `step_idx` (zero-based); every step."""
        del step_idx
        return jnp.asarray(True)

    def transform_optimizer(self, tx):
        return average_parameters(tx, self.avg_fn, self.should_update)

    def evaluation_state(self, state):
        if state.opt_state is None or not states_of(state.opt_state, AveragingState):
            return state  # a model without the optimizer (evaluating a restored model)
        averaging = one_state_of(state.opt_state, AveragingState, type(self).__name__,
                                 "averaging states")
        return state.replace(params=averaging.average)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class EMAWeightAveraging(WeightAveraging):
    """Lightning's `EMAWeightAveraging`: an exponential moving average of the parameters.

    `average = decay * average + (1 - decay) * current` after every `update_every_n_steps`-th
    optimizer step from `update_starting_at_step` on (the first update copies the
    parameters), as in Lightning 2.6. Validation and the final model use the average.

    Args:
        decay: the EMA decay (torch's `get_ema_avg_fn`), in [0, 1].
        update_every_n_steps: average after steps whose zero-based index is a multiple of it.
        update_starting_at_step: the first zero-based step index that may update (None: 0).
        update_starting_at_epoch: Lightning's epoch-end updates are not compiled into the step;
            refused (see docs/porting.md).

    Example:
        >>> from jaxlight import callbacks
        >>> ema = callbacks.EMAWeightAveraging(decay=0.99)
    """

    def __init__(self, device: Any = None, use_buffers: bool = True, decay: float = 0.999,
                 update_every_n_steps: int = 1, update_starting_at_step: int | None = None,
                 update_starting_at_epoch: int | None = None):
        if not 0.0 <= decay <= 1.0:
            raise ConfigurationError(f"EMAWeightAveraging(decay={decay}) must be in [0, 1].")
        if update_starting_at_epoch is not None:
            raise ConfigurationError(
                "EMAWeightAveraging(update_starting_at_epoch=...) updates at epoch ends in "
                "Lightning; jaxlight averages inside the compiled step only. Use "
                "update_starting_at_step=<epoch * steps per epoch> instead.")
        super().__init__(ema_average(decay), use_buffers=use_buffers, device=device)
        self.decay = decay
        self.update_every_n_steps = int(update_every_n_steps)
        self.update_starting_at_step = update_starting_at_step

    def should_update(self, step_idx: jax.Array) -> jax.Array:
        # Lightning: (start is None or step_idx >= start) and every > 0 and step_idx % every == 0
        if self.update_every_n_steps <= 0:
            return jnp.asarray(False)
        ok = step_idx % self.update_every_n_steps == 0
        if self.update_starting_at_step is not None:
            ok = jnp.logical_and(ok, step_idx >= self.update_starting_at_step)
        return ok

    def __repr__(self) -> str:
        return (f"EMAWeightAveraging(decay={self.decay}, update_every_n_steps="
                f"{self.update_every_n_steps}, update_starting_at_step="
                f"{self.update_starting_at_step})")
