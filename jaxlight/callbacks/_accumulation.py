"""GradientAccumulation: k microbatches scanned inside one compiled step, one optimizer update."""

from __future__ import annotations

from collections.abc import Callable

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback


class GradientAccumulation(Callback):
    """Splits each global batch into `k` microbatches, summed in fp32, for one optimizer update.

    The microbatches run in a `lax.scan` inside the compiled step, so only one microbatch's
    activations are alive at a time: temporary memory falls as `k` grows at a fixed global
    batch, and the result equals one step on the whole batch (up to float summation order).
    Microbatch i holds the rows whose index is i mod k, the same on any number of devices.

    The strategy decides how the scan is laid out (`Strategy.accumulate_gradients`): under
    DataParallel, FSDP and Hybrid the scan runs per data-parallel replica and the gradient
    collective runs once per step, after the loop; under DDP the replicas scan their own
    shares and the usual `pmean` follows. Either way the global batch must be a multiple of
    k × the data-parallel degree.

    Under FSDP, reducing once per step means each device holds the whole parameters (gathered
    once, at the start of the step) and a whole fp32 gradient accumulator while the step runs,
    as PyTorch FSDP's `no_sync`. For a model too large for that, `sync_every_microbatch=True`
    gathers and reduces per microbatch instead (k times the traffic) and keeps parameters and
    accumulator sharded.

    Args:
        k: microbatches per optimizer step (`Fit(accumulate_grad_batches=k)` adds this callback
            when k > 1). `k=1` still computes per-replica gradients with one explicit fp32
            reduction, which some layouts prefer.
        sync_every_microbatch: reduce gradients inside the loop, once per microbatch (see
            above); no effect under DDP or on one device.

    Example:
        >>> import jaxlight as jl
        >>> from jaxlight import callbacks
        >>> fit = jl.Fit("single", max_steps=2, callbacks=[callbacks.GradientAccumulation(4)],
        ...              enable_progress_bar=False, logger=False)
    """

    def __init__(self, k: int, *, sync_every_microbatch: bool = False):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigurationError(
                f"GradientAccumulation(k) needs a positive integer number of microbatches per "
                f"step, got {k!r}; use k=1 (or leave accumulate_grad_batches at 1) for none."
            )
        self.k = k
        self.sync_every_microbatch = bool(sync_every_microbatch)

    def gradient_computation(self, compute: Callable, strategy) -> Callable:
        # The strategy decides how the microbatch scan is laid out over its devices; its
        # gradient collective is part of that layout, so `compute` (its default) is replaced.
        del compute
        k, sync = self.k, self.sync_every_microbatch
        return lambda grad_fn: strategy.accumulate_gradients(grad_fn, k,
                                                             sync_every_microbatch=sync)

    def __repr__(self) -> str:
        extra = ", sync_every_microbatch=True" if self.sync_every_microbatch else ""
        return f"GradientAccumulation(k={self.k}{extra})"
