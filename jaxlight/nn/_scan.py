"""The plain layer loop shared by `Stacked` and each pipeline stage (a leaf of `jaxlight.nn`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jaxlight._errors import ConfigurationError

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
    raise ConfigurationError(
        f"remat={remat!r} is not a rematerialization setting; use True/False, one of "
        f"{choices}, or a jax.checkpoint_policies policy."
    )


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
