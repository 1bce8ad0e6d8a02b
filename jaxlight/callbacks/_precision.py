"""MixedPrecision: the dtype policy of the training step (Lightning's `precision=` names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.callbacks._base import Callback

#: Valid policies, and what they mean.
POLICIES = {
    "32-true": "float32 everywhere (the default)",
    "bf16-mixed": "float32 master parameters and optimizer state; bfloat16 forward and backward",
    "bf16-true": "bfloat16 parameters, optimizer state, forward and backward",
}

#: Lightning's shorter spellings.
ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed"}


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
    - `"32-true"`: nothing changes.

    Non-trainable variables (`rest`: batch statistics, frozen weights) keep their stored dtype
    and are cast back to it after the step. Evaluation steps run as stored (float32 master
    parameters under "bf16-mixed"). Integer inputs (token ids, labels) are never cast.

    Args:
        precision: one of `"32-true"`, `"bf16-mixed"`, `"bf16-true"` (also `"32"`, `32`, `"bf16"`).

    Example:
        >>> from jaxlight import callbacks
        >>> callbacks.MixedPrecision("bf16-mixed").precision
        'bf16-mixed'
    """

    def __init__(self, precision: str | int = "bf16-mixed"):
        resolved = ALIASES.get(precision, precision)
        if resolved not in POLICIES:
            valid = ", ".join(f"{name!r} ({what})" for name, what in POLICIES.items())
            raise ConfigurationError(
                f"unknown precision {precision!r}; valid values are {valid}. float16 is not "
                f"supported (bfloat16 needs no loss scaling).{suggest(precision, POLICIES)}"
            )
        self.precision = resolved
        self.compute_dtype = jnp.float32 if resolved == "32-true" else jnp.bfloat16
        self.param_dtype = jnp.bfloat16 if resolved == "bf16-true" else jnp.float32

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

    def transform_step(self, step_fn: Callable) -> Callable:
        if self.precision == "32-true":
            return step_fn

        def dtype_stable_step(state, batch):
            # Optimizers may promote (bf16 state + f32 hyperparameters); the compiled step's
            # outputs must keep the input dtypes, or the next call would not match it.
            new_state, metrics = step_fn(state, batch)
            return _cast_like(new_state, state), metrics

        return dtype_stable_step

    def __repr__(self) -> str:
        return f"MixedPrecision({self.precision!r})"
