"""ReduceLROnPlateau: torch.optim.lr_scheduler.ReduceLROnPlateau's rule as an optax transform."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxlight._errors import ConfigurationError


class ReduceLROnPlateauState(NamedTuple):
    """The scheduler's state (float32/int32 scalars; kept in the optimizer state).

    `scale` is the factor the learning rate is multiplied by (1 at the start).
    """

    scale: jax.Array
    best: jax.Array
    num_bad_epochs: jax.Array
    cooldown_counter: jax.Array


def ReduceLROnPlateau(  # noqa: N802 - torch's name, a factory as optax's are
    mode: str = "min",
    factor: float = 0.1,
    patience: int = 10,
    threshold: float = 1e-4,
    threshold_mode: str = "rel",
    cooldown: int = 0,
    min_lr: float = 0.0,
    eps: float = 1e-8,
    *,
    lr: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    """torch's `ReduceLROnPlateau`, counted exactly as torch counts, for the `lr_scheduler` dict.

    Each value fed (`update(updates, state, value=metric)`, once per `interval` of the dict)
    is compared with the best so far: better means `value < best * (1 - threshold)` (`"rel"`)
    or `value < best - threshold` (`"abs"`) in `"min"` mode, `value > best * (1 + threshold)`
    or `value > best + threshold` in `"max"` mode. A value that is not better is a bad epoch;
    when more than `patience` bad epochs have passed in a row (`num_bad_epochs > patience`,
    torch's rule: `patience=1` lowers the rate at the second bad epoch) the rate becomes
    `max(rate * factor, min_lr)` unless that changes it by no more than `eps`, and the next
    `cooldown` values count no bad epoch. NaN is never better.

    `optax.contrib.reduce_on_plateau(factor, patience=p + 1, rtol=threshold, cooldown=...)`
    makes the same decisions in `"min"` mode with `"rel"` thresholds (it lowers at
    `patience` bad values, not after more than `patience`); this one also has `"max"`,
    `"abs"` thresholds, `min_lr` and `eps` as torch has them.

    Args:
        mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps: torch's.
        lr: the optimizer's learning rate, needed only for `min_lr` and `eps`, which torch
            compares with the rate itself (jaxlight scales the optimizer's updates by a
            factor, so it cannot read the rate); without it `min_lr` must be 0 and `eps` is
            not applied.

    Example:
        >>> import optax
        >>> from jaxlight import schedules
        >>> def configure_optimizers(self):
        ...     return {"optimizer": optax.sgd(0.1),
        ...             "lr_scheduler": {"scheduler": schedules.ReduceLROnPlateau(patience=2),
        ...                              "monitor": "val_loss", "interval": "epoch"}}
    """
    if mode not in ("min", "max"):
        raise ConfigurationError(f"ReduceLROnPlateau(mode={mode!r}): mode is 'min' or 'max'.")
    if threshold_mode not in ("rel", "abs"):
        raise ConfigurationError(
            f"ReduceLROnPlateau(threshold_mode={threshold_mode!r}): give 'rel' or 'abs'.")
    if not 0.0 < factor < 1.0:
        raise ConfigurationError(
            f"ReduceLROnPlateau(factor={factor}): the factor must be in (0, 1), as torch "
            "requires (factor < 1.0); 0.1 is the default.")
    for name, value in (("patience", patience), ("cooldown", cooldown)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(
                f"ReduceLROnPlateau({name}={value!r}): give a non-negative integer.")
    if min_lr < 0 or threshold < 0 or eps < 0:
        raise ConfigurationError(
            f"ReduceLROnPlateau(min_lr={min_lr}, threshold={threshold}, eps={eps}): none may "
            "be negative.")
    if min_lr > 0 and lr is None:
        raise ConfigurationError(
            f"ReduceLROnPlateau(min_lr={min_lr}) needs the optimizer's learning rate: pass "
            f"lr=<the rate given to the optimizer>, e.g. ReduceLROnPlateau(min_lr={min_lr}, "
            "lr=0.1) (jaxlight scales the optimizer's updates, so the rate itself is not "
            "visible to the scheduler).")
    sign = 1.0 if mode == "min" else -1.0
    min_scale = 0.0 if lr is None else min_lr / lr

    def init(params: Any) -> ReduceLROnPlateauState:
        del params
        return ReduceLROnPlateauState(scale=jnp.ones((), jnp.float32),
                                      best=jnp.full((), jnp.inf, jnp.float32),
                                      num_bad_epochs=jnp.zeros((), jnp.int32),
                                      cooldown_counter=jnp.zeros((), jnp.int32))

    def update(updates, state: ReduceLROnPlateauState, params=None, *, value, **extra):
        del params, extra
        v = jnp.asarray(value, jnp.float32)
        a = sign * v  # compared as "min" from here on; `best` is stored negated in max mode
        if threshold_mode == "rel":
            improved = (a < state.best * (1.0 - threshold)) if mode == "min" else \
                (a < state.best * (1.0 + threshold))
        else:
            improved = a < state.best - threshold
        best = jnp.where(improved, a, state.best)
        bad = jnp.where(improved, 0, state.num_bad_epochs + 1)
        in_cooldown = state.cooldown_counter > 0
        cooldown_counter = jnp.where(in_cooldown, state.cooldown_counter - 1,
                                     state.cooldown_counter)
        bad = jnp.where(in_cooldown, 0, bad)
        reduce = bad > patience
        new_scale = jnp.maximum(state.scale * factor, min_scale)
        if lr is not None:  # torch skips a change of the rate by no more than eps
            reduce_by = reduce & ((state.scale - new_scale) * lr > eps)
        else:
            reduce_by = reduce & (new_scale < state.scale)
        scale = jnp.where(reduce_by, new_scale, state.scale)
        cooldown_counter = jnp.where(reduce, cooldown, cooldown_counter)
        bad = jnp.where(reduce, 0, bad)
        new = ReduceLROnPlateauState(scale=scale.astype(jnp.float32), best=best,
                                     num_bad_epochs=bad.astype(jnp.int32),
                                     cooldown_counter=cooldown_counter.astype(jnp.int32))
        return jax.tree.map(lambda u: u * new.scale, updates), new

    return optax.GradientTransformationExtraArgs(init, update)
