"""Stacked: a repeated block whose parameters carry a leading "layers" axis, run as a scan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxlight.nn._pipeline import active_pipeline, run_pipeline

#: The logical name of the stacked-layers axis (the rules table maps it: None on most
#: strategies, the pipeline axis under GPipe).
LAYERS = "layers"

#: What `remat` accepts, by name (`True` means "full", `False` "none"; a callable is a
#: `jax.checkpoint_policies` policy).
REMAT_POLICIES = {
    "none": "store every activation (fastest, most memory)",
    "full": "store only each block's input; recompute the whole block in the backward pass "
            "(least memory, about a third more compute)",
    "dots": "store the outputs of the weight matmuls, recompute the rest (attention scores, "
            "norms, activations): jax.checkpoint_policies.dots_with_no_batch_dims_saveable",
}


def remat_policy(remat: Any) -> tuple[bool, Callable | None]:
    """(whether to rematerialize, the `jax.checkpoint` policy) for a `remat` setting.

    Example:
        >>> remat_policy(False), remat_policy("full")
        ((False, None), (True, None))
        >>> remat_policy("dots")[1] is jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        True
    """
    if remat is None or remat is False or remat == "none":
        return False, None
    if remat is True or remat == "full":
        return True, None
    if remat == "dots":
        return True, jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    if callable(remat):
        return True, remat
    choices = ", ".join(repr(k) for k in REMAT_POLICIES)
    raise ValueError(
        f"remat={remat!r} is not a rematerialization setting; use True/False, one of "
        f"{choices}, or a jax.checkpoint_policies policy."
    )


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
            raise ValueError(f"Stacked needs num_layers >= 1, got {num_layers!r}.")
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
            return run_pipeline(self, pipeline, x, *args)
        return self._run_scan(x, *args)

    def _run_scan(self, x, *args) -> Any:
        """The plain layer loop: `nnx.scan` over the stacked layer axis."""
        return scan_layers(self.layers, x, args, self.remat)


def scan_layers(layers: nnx.Module, x: Any, args: tuple, remat: Any) -> Any:
    """Runs stacked `layers` (leading layer axis) in order as one `nnx.scan` over `x`.

    Shared by `Stacked` and each pipeline stage, so both run the blocks identically.
    """

    def body(block, carry, *rest):
        return block(carry, *rest)

    rematerialize, policy = remat_policy(remat)
    if rematerialize:
        body = nnx.remat(body, policy=policy)

    @nnx.scan(
        in_axes=(0, nnx.Carry) + (None,) * len(args),
        out_axes=nnx.Carry,
        transform_metadata={nnx.PARTITION_NAME: LAYERS},
    )
    def scan_fn(block, carry, *rest):
        return body(block, carry, *rest)

    return scan_fn(layers, x, *args)
