"""Gradient accumulation (Lightning's `accumulate_grad_batches`) and its memory knob,
`Microbatches`: both scan microbatches inside one compiled step for one optimizer update."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import Callback


def _check_count(who: str, k, what: str) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigurationError(
            f"{who} needs a positive integer number of {what}, got {k!r}; use 1 for none."
        )


class Microbatches(Callback):
    """Splits each loader batch into `n` microbatches, summed in fp32, for one optimizer update.

    A memory knob, not Lightning's `accumulate_grad_batches` (that is `GradientAccumulation`):
    the optimizer still steps once per loader batch and the result equals one step on the
    whole batch (up to float summation order), while only one microbatch's activations are
    alive at a time, so temporary memory falls as `n` grows at a fixed batch size.
    Microbatch i holds the rows whose index is i mod n, the same on any number of devices.

    The microbatches run in a `lax.scan` inside the compiled step; the strategy decides how the
    scan is laid out (`Strategy.accumulate_gradients`): under DataParallel, FSDP and Hybrid the
    scan runs per data-parallel replica and the gradient collective runs once per step, after
    the loop; under DDP the replicas scan their own shares and the usual `pmean` follows.
    Either way the batch must be a multiple of n × the data-parallel degree.

    Under FSDP, reducing once per step means each device holds the whole parameters (gathered
    once, at the start of the step) and a whole fp32 gradient accumulator while the step runs,
    as PyTorch FSDP's `no_sync`. For a model too large for that, `sync_every_microbatch=True`
    gathers and reduces per microbatch instead (n times the traffic) and keeps parameters and
    accumulator sharded.

    Args:
        n: microbatches per loader batch. `n=1` still computes per-replica gradients with one
            explicit fp32 reduction, which some layouts prefer.
        sync_every_microbatch: reduce gradients inside the loop, once per microbatch (see
            above); no effect under DDP or on one device.

    Example:
        >>> import jaxlight as jl
        >>> from jaxlight import callbacks
        >>> fit = jl.Fit("single", max_steps=2, callbacks=[callbacks.Microbatches(4)],
        ...              enable_progress_bar=False, logger=False)
    """

    def __init__(self, n: int, *, sync_every_microbatch: bool = False):
        _check_count(f"{type(self).__name__}(n)", n, "microbatches per batch")
        self.k = n
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
        return f"Microbatches(n={self.k}{extra})"


class GradientAccumulation(Microbatches):
    """Lightning's `accumulate_grad_batches=k`: k loader batches per optimizer step.

    As in Lightning 2.6, each loader batch's loss is divided by k and the optimizer steps once
    every k batches, so an epoch of N batches takes ceil(N / k) optimizer steps: at an epoch's
    end the r < k batches left make one more step (their gradient sum still divided by k, as
    Lightning does). `max_steps`, `global_step` and `log_every_n_steps` count optimizer steps;
    `batch_idx` and `limit_train_batches` count loader batches.

    jaxlight keeps it one compiled step with one gradient collective: the loop stacks the k
    batches (`jaxlight._microbatch.stack_batches`) and the step scans them as `Microbatches`
    scans microbatches (the short last group is padded with zero-weight copies, so no second
    step is compiled). `on_train_batch_start`/`on_train_batch_end` run once per optimizer step,
    with the group's last batch and its `batch_idx` (Lightning calls them for every batch).

    Args:
        k: loader batches per optimizer step (`Fit(accumulate_grad_batches=k)` adds this
            callback when k > 1).
        sync_every_microbatch: as for `Microbatches`.

    Example:
        >>> import jaxlight as jl
        >>> from jaxlight import callbacks
        >>> fit = jl.Fit("single", max_steps=2, callbacks=[callbacks.GradientAccumulation(4)],
        ...              enable_progress_bar=False, logger=False)
    """

    def __init__(self, k: int, *, sync_every_microbatch: bool = False):
        _check_count("GradientAccumulation(k)", k, "loader batches per optimizer step")
        super().__init__(k, sync_every_microbatch=sync_every_microbatch)

    @property
    def batches_per_step(self) -> int:
        """Loader batches per optimizer step."""
        return self.k

    def __repr__(self) -> str:
        extra = ", sync_every_microbatch=True" if self.sync_every_microbatch else ""
        return f"GradientAccumulation(k={self.k}{extra})"


def batches_per_step(callbacks: Sequence) -> int:
    """Loader batches per optimizer step under these callbacks (1 without GradientAccumulation)."""
    found = [cb for cb in callbacks if isinstance(cb, Microbatches)]
    if len(found) > 1:
        raise ConfigurationError(
            f"{len(found)} microbatch scans were given ({', '.join(map(repr, found))}): each "
            "replaces the step's gradient computation, so only one can apply. Keep one "
            "(GradientAccumulation(k) for k loader batches per step, Microbatches(n) to split "
            "each batch)."
        )
    found = [cb for cb in found if isinstance(cb, GradientAccumulation)]
    return found[0].batches_per_step if found else 1
