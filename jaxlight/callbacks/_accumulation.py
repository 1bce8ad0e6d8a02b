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
    batches (`jaxlight.step._microbatch.stack_batches`) and the step scans them as `Microbatches`
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


class GradientAccumulationScheduler(GradientAccumulation):
    """Lightning's `GradientAccumulationScheduler(scheduling={epoch: k})`: `accumulate_grad_batches`
    changing by epoch (0-based epochs; before the first listed epoch, 1).

    Each k keeps `GradientAccumulation`'s meaning (k loader batches per optimizer step, each
    loss divided by k, ceil(N / k) steps per epoch). The loop stacks an epoch's k batches into
    one compiled step that scans them, so each distinct k is one more compiled step kind, once
    per fit: `compile_counts["train"]` for epoch 0's k, `compile_counts["train_accumulate_<k>"]`
    for each other k (k = 1 is the plain step, which also trains a last partial batch).

    Args:
        scheduling: {epoch: k}, epochs >= 0, k >= 1 (as Lightning: {4: 2} accumulates 2 batches
            from the fifth epoch on, 1 before).

    Example:
        >>> from jaxlight import callbacks
        >>> accumulator = callbacks.GradientAccumulationScheduler(scheduling={4: 2})
        >>> accumulator.batches_at(3), accumulator.batches_at(4)
        (1, 2)
    """

    def __init__(self, scheduling: dict[int, int]):
        if not isinstance(scheduling, dict) or not scheduling:
            raise ConfigurationError(
                f"GradientAccumulationScheduler(scheduling={scheduling!r}) needs a non-empty "
                "dict {epoch: accumulate_grad_batches}, e.g. {0: 1, 4: 2}.")
        bad_keys = [e for e in scheduling if isinstance(e, bool) or not isinstance(e, int) or e < 0]
        if bad_keys:
            raise ConfigurationError(
                "GradientAccumulationScheduler: epochs should be integers >= 0 (0-based); got "
                f"{list(scheduling)}.")
        bad = [k for k in scheduling.values()
               if isinstance(k, bool) or not isinstance(k, int) or k < 1]
        if bad:
            raise ConfigurationError(
                "GradientAccumulationScheduler: accumulation factors should be integers > 0; got "
                f"{list(scheduling.values())}.")
        self.scheduling = {0: 1, **scheduling} if min(scheduling) != 0 else dict(scheduling)
        self.epochs = sorted(self.scheduling)
        super().__init__(self.batches_at(0))

    def batches_at(self, epoch: int) -> int:
        """Loader batches per optimizer step in (0-based) `epoch`."""
        return self.scheduling[max(e for e in self.epochs if e <= epoch)]

    def use_epoch(self, epoch: int) -> int:
        """Sets the k the step is built with to `epoch`'s (the loop calls it before building a
        step kind for that k); returns it."""
        self.k = self.batches_at(epoch)
        return self.k

    def gradient_computation(self, compute: Callable, strategy) -> Callable:
        # k = 1: the plain step (Lightning's accumulate_grad_batches=1).
        return compute if self.k == 1 else super().gradient_computation(compute, strategy)

    def __repr__(self) -> str:
        return f"GradientAccumulationScheduler(scheduling={self.scheduling})"


def batches_per_step(callbacks: Sequence, epoch: int | None = None) -> int:
    """Loader batches per optimizer step under these callbacks (1 without GradientAccumulation);
    with a `GradientAccumulationScheduler` and an `epoch`, that epoch's (and the scheduler is
    set to it)."""
    found = [cb for cb in callbacks if isinstance(cb, Microbatches)]
    if len(found) > 1:
        raise ConfigurationError(
            f"{len(found)} microbatch scans were given ({', '.join(map(repr, found))}): each "
            "replaces the step's gradient computation, so only one can apply. Keep one "
            "(GradientAccumulation(k) for k loader batches per step, Microbatches(n) to split "
            "each batch)."
        )
    found = [cb for cb in found if isinstance(cb, GradientAccumulation)]
    if found and epoch is not None and isinstance(found[0], GradientAccumulationScheduler):
        return found[0].use_epoch(epoch)
    return found[0].batches_per_step if found else 1
