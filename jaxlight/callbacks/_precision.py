"""MixedPrecision: the dtype policy of the training step (Lightning's `precision=` names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.callbacks import _loss_scale
from jaxlight.callbacks._base import Callback

#: Valid policies, and what they mean.
POLICIES = {
    "32-true": "float32 everywhere (the default)",
    "bf16-mixed": "float32 master parameters and optimizer state; bfloat16 forward and backward",
    "bf16-true": "bfloat16 parameters, optimizer state, forward and backward",
    "16-mixed": "float32 master parameters and optimizer state; float16 forward and backward "
                "with dynamic loss scaling (for GPUs without bfloat16)",
}

#: Lightning's shorter spellings.
ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}

_COMPUTE = {"32-true": jnp.float32, "bf16-mixed": jnp.bfloat16, "bf16-true": jnp.bfloat16,
            "16-mixed": jnp.float16}


def _cast_floats(tree: Any, dtype) -> Any:
    """Casts floating leaves to `dtype`; other leaves (ints, bools, PRNG keys) pass through."""

    def one(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(one, tree)


def _cast_like(tree: Any, reference: Any) -> Any:
    """Casts each leaf of `tree` to the dtype of the matching leaf of `reference`."""
    def one(x, r):
        return x if x.dtype == r.dtype else x.astype(r.dtype)

    return jax.tree.map(one, tree, reference)


class MixedPrecision(Callback):
    """The dtype policy for parameters, compute and outputs of the training step.

    - `"bf16-mixed"`: parameters and optimizer state stay float32 (master copies). Inside the
      loss, parameters and floating batch inputs are cast to bfloat16, so matrix multiplies run
      in bfloat16; the loss comes back as float32, and gradients arrive in float32 (the cast's
      transpose) to be clipped and applied in float32. With `GradientAccumulation` (any k,
      even 1) the cross-replica reduction is an explicit float32 psum after the microbatch
      loop; without it, SPMD strategies let XLA place the reduction at the weight-gradient
      dot, in that dot's output type (float32 on CPU, where XLA upcasts bfloat16 dots; it may
      be bfloat16 on accelerators). DDP reduces the float32 gradients.
    - `"bf16-true"`: parameters are stored in bfloat16 (`transform_params`), so the optimizer
      state is too; half the memory of "bf16-mixed", at the cost of bfloat16 updates.
    - `"16-mixed"`: as "bf16-mixed" with float16 compute, for GPUs without bfloat16. float16's
      narrow range needs dynamic loss scaling (`jaxlight.callbacks._loss_scale`, torch's
      `GradScaler` rules): the loss's cotangent is multiplied by a scale at the start of the
      backward pass and the gradients divided by it as they leave it, before clipping or
      anything else reads them; a step whose gradients overflow (Inf/NaN) is skipped
      (parameters and optimizer state kept bit for bit) and the scale multiplied by
      `backoff_factor`; after `growth_interval` finite steps in a row it is multiplied by
      `growth_factor`. The scale, its counter and the skip live in one optax transformation
      wrapping the optimizer (`_loss_scale.dynamic_loss_scale`), so checkpoints carry them;
      the loss reads this step's scale from the optimizer state the step starts from
      (`transform_loss_for_step`). The metrics `loss_scale` (the scale this step used) and
      `overflow_skipped` (steps skipped so far) report it. A `NonFiniteGuard` listed after
      this callback leaves overflow steps to the loss scale and counts only non-finite steps
      at a scale below 1 (see `NonFiniteGuard`).
    - `"32-true"`: nothing changes.

    Non-trainable variables (`rest`: batch statistics, frozen weights) keep their stored dtype
    and are cast back to it after the step. Evaluation steps run as stored (float32 master
    parameters under "bf16-mixed"). Integer inputs (token ids, labels) are never cast.

    Args:
        precision: one of `"32-true"`, `"bf16-mixed"`, `"bf16-true"`, `"16-mixed"` (also
            `"32"`, `32`, `"bf16"`, `"16"`, `16`).
        init_scale, growth_interval, growth_factor, backoff_factor: "16-mixed"'s loss scaling
            (torch's `GradScaler` defaults).

    Example:
        >>> from jaxlight import callbacks
        >>> callbacks.MixedPrecision("bf16-mixed").precision
        'bf16-mixed'
    """

    def __init__(self, precision: str | int = "bf16-mixed", *, init_scale: float = 2.0 ** 16,
                 growth_interval: int = 2000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5):
        resolved = ALIASES.get(precision, precision)
        if resolved not in POLICIES:
            valid = ", ".join(f"{name!r} ({what})" for name, what in POLICIES.items())
            hint = (" float16 with float16 parameters ('16-true') is not supported: use "
                    "'16-mixed'." if resolved in ("16-true", "fp16") else "")
            raise ConfigurationError(
                f"unknown precision {precision!r}; valid values are {valid}.{hint}"
                f"{suggest(precision, POLICIES)}"
            )
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1):
            raise ConfigurationError(
                f"MixedPrecision loss scaling needs init_scale > 0, growth_factor > 1 and "
                f"0 < backoff_factor < 1; got init_scale={init_scale}, growth_factor="
                f"{growth_factor}, backoff_factor={backoff_factor}."
            )
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) \
                or growth_interval < 1:
            raise ConfigurationError(
                f"MixedPrecision(growth_interval) must be a positive integer (finite steps "
                f"before the loss scale grows), got {growth_interval!r}."
            )
        self.precision = resolved
        self.compute_dtype = _COMPUTE[resolved]
        self.param_dtype = jnp.bfloat16 if resolved == "bf16-true" else jnp.float32
        self.init_scale = float(init_scale)
        self.growth_interval = growth_interval
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)

    @property
    def loss_scaling(self) -> bool:
        return self.precision == "16-mixed"

    def transform_optimizer(self, tx):
        if not self.loss_scaling:
            return tx
        return _loss_scale.dynamic_loss_scale(tx, self.init_scale, self.growth_interval,
                                              self.growth_factor, self.backoff_factor)

    def transform_params(self, params: Any) -> Any:
        if self.precision != "bf16-true":
            return params
        return _cast_floats(params, jnp.bfloat16)

    def transform_loss(self, loss_fn: Callable) -> Callable:
        if self.precision == "32-true":
            return loss_fn
        compute = self.compute_dtype

        def loss_in_compute_dtype(params, rest, batch):
            loss, (metrics, new_rest) = loss_fn(
                _cast_floats(params, compute), rest, _cast_floats(batch, compute)
            )
            return loss.astype(jnp.float32), (metrics, _cast_like(new_rest, rest))

        return loss_in_compute_dtype

    def transform_loss_for_step(self, loss_fn: Callable, state) -> Callable:
        loss_fn = self.transform_loss(loss_fn)
        if not self.loss_scaling:
            return loss_fn
        # The scale this step uses is the one its starting optimizer state holds.
        return _loss_scale.scaled_loss(loss_fn, _loss_scale.find(state.opt_state).scale)

    def transform_step(self, step_fn: Callable) -> Callable:
        if self.precision == "32-true":
            return step_fn

        def dtype_stable_step(state, batch):
            # Optimizers may promote (bf16 state + f32 hyperparameters); the compiled step's
            # outputs must keep the input dtypes, or the next call would not match it.
            new_state, metrics = step_fn(state, batch)
            return _cast_like(new_state, state), metrics

        if not self.loss_scaling:
            return dtype_stable_step

        def loss_scaled_step(state, batch):
            new_state, metrics = dtype_stable_step(state, batch)
            olds = _loss_scale.find_all(state.opt_state)
            news = _loss_scale.find_all(new_state.opt_state)
            # `dynamic_loss_scale` skipped this step exactly when it counted one more skip; it
            # applied an update of -0.0, and the select keeps the parameters bit for bit. The
            # model's other variables (batch statistics) advance, as in torch's GradScaler.
            applied = [n.skipped == o.skipped for o, n in zip(olds, news, strict=True)]
            if len(news) == 1:
                params = jax.tree.map(
                    lambda p_new, p_old: jax.lax.select(applied[0], p_new, p_old),
                    new_state.params, state.params)
                opt_state = new_state.opt_state
            else:
                # Named optimizers: one backward pass, so one scale. Each optimizer skipped
                # only its own update when its gradients overflowed; the shared scale backs off
                # when any of them overflowed and grows after growth_interval steps in which
                # none did. Each optimizer keeps its own `skipped` count.
                shared = _loss_scale.next_state(
                    olds[0], jnp.all(jnp.stack(applied)), self.growth_interval,
                    self.growth_factor, self.backoff_factor)
                opt_state = _loss_scale.replace_all(
                    new_state.opt_state, [shared._replace(skipped=n.skipped) for n in news])
                params = new_state.params
            skipped = sum(n.skipped for n in news)
            metrics = {**metrics, "loss_scale": olds[0].scale,
                       "overflow_skipped": skipped.astype(jnp.float32)}
            return new_state.replace(params=params, opt_state=opt_state), metrics

        return loss_scaled_step

    def __repr__(self) -> str:
        return f"MixedPrecision({self.precision!r})"
