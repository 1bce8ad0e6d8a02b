"""GradientClipping: clip the global gradient norm (or each value) and log the norm."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.callbacks._base import Callback
from jaxlight.step._microbatch import widened

ALGORITHMS = ("norm", "value")


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves together, accumulated at least in float32 (float64 gradients
    in float64, as torch's clip_grad_norm_ computes a norm in the gradients' dtype).

    Under FSDP or tensor parallelism each leaf is a sharded global array; XLA sums the local
    squares and all-reduces one scalar, so this is the norm over every shard.
    """
    squares = [jnp.sum(jnp.square(widened(g))) for g in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares, jnp.zeros((), jnp.float32)))


class GradientClipping(Callback):
    """Clips gradients after the cross-replica reduction and logs their norm as `grad_norm`.

    - `algorithm="norm"`: if the global L2 norm over all parameters (every shard) exceeds
      `max_norm`, all gradients are scaled by `max_norm / norm` (as `optax.clip_by_global_norm`).
    - `algorithm="value"`: each gradient element is clipped to `[-max_norm, max_norm]`.

    `grad_norm` is always the norm before clipping, in float32 (float64 for float64 gradients).

    With named optimizers (automatic optimization), `algorithm="norm"` clips each optimizer's
    gradients by the global norm of its own parameters, logged as `grad_norm-<name>`
    (docs/models.md, "Several optimizers").

    Args:
        max_norm: the threshold, > 0 (`Fit(gradient_clip_val=...)` adds this callback).
        algorithm: `"norm"` or `"value"` (`Fit(gradient_clip_algorithm=...)`).

    Example:
        >>> from jaxlight import callbacks
        >>> callbacks.GradientClipping(1.0).max_norm
        1.0
    """

    def __init__(self, max_norm: float, algorithm: str = "norm"):
        if (isinstance(max_norm, bool) or not isinstance(max_norm, int | float)
                or not math.isfinite(max_norm) or max_norm <= 0):
            raise ConfigurationError(
                f"GradientClipping needs a finite max_norm > 0, got {max_norm!r}; a norm of "
                "1.0 is a common choice. To turn clipping off, leave gradient_clip_val=None."
            )
        if algorithm not in ALGORITHMS:
            raise ConfigurationError(
                f"unknown gradient clipping algorithm {algorithm!r}; valid values are "
                f"{list(ALGORITHMS)}.{suggest(algorithm, ALGORITHMS)}"
            )
        self.max_norm = float(max_norm)
        self.algorithm = algorithm
        self.groups: Any = None

    def bind_optimizer_groups(self, labels: Any) -> None:
        """Per parameter, its named optimizer's name (None: one optimizer). Called by the fit
        when it builds the optimizer, before the step is traced."""
        self.groups = labels

    def _scale(self, norm: jax.Array) -> jax.Array:
        # Divide only when clipping, so a zero norm never divides.
        return jnp.where(norm > self.max_norm, self.max_norm / jnp.maximum(norm, 1e-30), 1.0)

    def process_gradients(self, grads: Any, metrics: dict) -> tuple[Any, dict]:
        norm = global_norm(grads)
        metrics = {**metrics, "grad_norm": norm}
        if self.groups is not None:
            # Named optimizers: each optimizer's parameters are clipped by their own norm
            # (Lightning's self.clip_gradients(optimizer, ...) per optimizer).
            names = sorted(set(jax.tree.leaves(self.groups)))
            norms = {}
            for name in names:
                own = [g for g, label in zip(jax.tree.leaves(grads),
                                             jax.tree.leaves(self.groups), strict=True)
                       if label == name]
                norms[name] = global_norm(own)
                metrics[f"grad_norm-{name}"] = norms[name]
            if self.algorithm == "norm":
                scales = {name: self._scale(n) for name, n in norms.items()}
                grads = jax.tree.map(lambda g, label: (g * scales[label]).astype(g.dtype),
                                     grads, self.groups)
                return grads, metrics
        if self.algorithm == "norm":
            scale = self._scale(norm)
            grads = jax.tree.map(lambda g: (g * scale).astype(g.dtype), grads)
        else:
            grads = jax.tree.map(lambda g: jnp.clip(g, -self.max_norm, self.max_norm), grads)
        return grads, metrics

    def __repr__(self) -> str:
        return f"GradientClipping({self.max_norm}, algorithm={self.algorithm!r})"
