"""Stacked: a repeated block whose parameters carry a leading "layers" axis, run as a scan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from jaxlight._errors import ConfigurationError
from jaxlight.nn._circular import run_circular
from jaxlight.nn._pipeline import active_pipeline, run_pipeline
from jaxlight.nn._scan import LAYERS, REMAT_POLICIES, remat_policy, scan_layers

__all__ = ["LAYERS", "REMAT_POLICIES", "Stacked", "remat_policy", "scan_layers"]

class Stacked(nnx.Module):
    """`num_layers` copies of one block, stored stacked and applied as a scan.

    Every parameter of the block gains a leading dimension of size `num_layers` with the logical
    axis name `"layers"` (for annotated parameters), so the whole stack is one array per
    parameter: the step compiles one block body whatever the depth, and a pipelined strategy can
    split the layer axis over its stages.

    Args:
        make_block: `make_block(rngs) -> nnx.Module`; the block maps `(x, *args) -> x` with `x`
            of an unchanged shape (the scan carry).
        num_layers: how many blocks.
        rngs: random streams; each layer gets its own split of every stream.
        remat: what to recompute in the backward pass instead of storing (`nnx.remat` on
            each block): `False`/"none", `True`/"full" (the whole block: least memory, about a
            third more compute), "dots" (keep the weight matmuls' outputs, recompute the
            rest), or a `jax.checkpoint_policies` policy.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> stack = Stacked(lambda rngs: nnx.Linear(4, 4, rngs=rngs), 3, rngs=nnx.Rngs(0))
        >>> stack.layers.kernel.shape
        (3, 4, 4)
        >>> stack(jnp.ones((2, 4))).shape
        (2, 4)
    """

    def __init__(
        self,
        make_block: Callable[[nnx.Rngs], nnx.Module],
        num_layers: int,
        *,
        rngs: nnx.Rngs,
        remat: bool | str | Callable = False,
    ):
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigurationError(f"Stacked needs an int num_layers >= 1, got {num_layers!r}.")
        remat_policy(remat)  # reject a bad setting here, not at the first trace
        self.num_layers = num_layers
        self.remat = remat

        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
        def create(rngs: nnx.Rngs) -> nnx.Module:
            return make_block(rngs)

        #: The stacked block: one module whose every variable has a leading layer axis.
        self.layers = create(rngs)

    def __call__(self, x, *args) -> Any:
        """Applies the blocks in order; `args` (positions, masks, ...) go to every block."""
        pipeline = active_pipeline()
        if pipeline is not None:
            # A pipelined strategy (GPipe, Hybrid with a pipe axis) is tracing this step: the
            # same layers run as the GPipe schedule over the pipe axis (jaxlight.nn._pipeline).
            if pipeline.repeats > 1:
                return run_circular(self, pipeline, x, *args)
            return run_pipeline(self, pipeline, x, *args)
        return self._run_scan(x, *args)

    def _run_scan(self, x, *args) -> Any:
        """The plain layer loop: `nnx.scan` over the stacked layer axis."""
        return scan_layers(self.layers, x, args, self.remat)
