"""TrainLoop: the training loop of `Fit.fit`.

The loop's performance contract (DESIGN.md):
- the train step is compiled once per fit, ahead of time, with shardings fixed before the call;
- the state is donated to every step;
- at most `MAX_IN_FLIGHT` steps are queued: after dispatching step t the loop waits for the
  oldest unfinished one (unbounded queues deadlock XLA's CPU collectives; a bounded queue costs
  nothing on an accelerator while one step stays queued);
- metrics reach the host only at log intervals, and then those of an already finished step.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from jaxlight._errors import DataError, TrainingStopped
from jaxlight._fit._config import (
    FitConfig,
    batch_limit,
    check_validation_interval,
    validates_after_step,
    validation_interval,
)
from jaxlight._fit._evaluation import Evaluator
from jaxlight._fit._hooks import Hooks, MetricLog
from jaxlight._fit._loop_state import LoopState
from jaxlight._fit._partial import PartialStep
from jaxlight._fit._session import Session, abstract_global_batch
from jaxlight.callbacks._accumulation import batches_per_step
from jaxlight.data._convert import check_dtypes
from jaxlight.data._feed import TrainFeed
from jaxlight.data._prefetch import Prefetcher, prefetch_depth
from jaxlight.metrics._host_logs import HostLogs
from jaxlight.metrics._metrics import EpochAccumulator
from jaxlight.sharding import _batch
from jaxlight.step._guards import check_reads
from jaxlight.step._microbatch import GroupTransfer, stack_batches
from jaxlight.step._user_step import tracing_for

#: Steps dispatched to the device that the host has not waited for, at most (module docstring).
MAX_IN_FLIGHT = 2


def _grouped(pairs: Iterator, k: int) -> Iterator[tuple[list, Any]]:
    """`(batches, position after the last)`: k loader batches at a time (fewer at the end)."""
    group: list = []
    position = None
    for batch, position in pairs:
        group.append(batch)
        if len(group) == k:
            yield group, position
            group = []
    if group:
        yield group, position


class _Pending:
    """A dispatched step whose metrics the host has not looked at yet."""

    __slots__ = ("step", "metrics", "log", "host")

    def __init__(self, step: int, metrics: dict, log: bool, host: HostLogs):
        # host: what `self.log` recorded in this batch's hooks (logged with the step's metrics)
        self.step, self.metrics, self.log, self.host = step, metrics, log, host


class StepOutput:
    """What `on_train_batch_end` receives: the step number and its metrics (device arrays)."""

    __slots__ = ("step", "metrics")

    def __init__(self, step: int, metrics: dict):
        self.step, self.metrics = step, metrics

    def __getitem__(self, key):
        return self.metrics[key]


class TrainLoop:
    """Runs epochs of training steps with hooks, logging, validation and stop agreement."""

    def __init__(self, config: FitConfig, session: Session, position: LoopState, hooks: Hooks,
                 log: MetricLog, evaluator: Evaluator, feed: TrainFeed,
                 after_step: Callable[[], None]):
        self.config = config
        self.session = session
        self.position = position
        self.hooks = hooks
        self.log = log
        self.evaluator = evaluator
        self.feed = feed
        #: Runs after every step's `on_train_batch_end` hooks (the preemption check).
        self.after_step = after_step
        #: Loader batches per optimizer step (`GradientAccumulation(k)`: k; this epoch's under
        #: a `GradientAccumulationScheduler`, set at each epoch's start).
        self.batches_per_step = batches_per_step(session.callbacks, position.epoch)
        #: k -> (compiled step, batch shardings): one step kind per k (`_step_for`).
        self._steps: dict[int, tuple] = {}

    # -- stopping ------------------------------------------------------------------------------

    def hit_max_steps(self) -> bool:
        return (self.config.max_steps is not None
                and self.position.global_step >= self.config.max_steps)

    def epoch_exhausted(self, data, limit) -> bool:
        if (n := _batch.len_or_none(data)) is None:
            return False
        n = min(n, limit) if limit else n
        return self.position.batch_idx >= n

    def done(self) -> bool:
        if self.position.effective_stop is not None or self.hit_max_steps():
            return True
        return self.config.max_epochs is not None and self.position.epoch >= self.config.max_epochs

    # -- batches -------------------------------------------------------------------------------

    def _epoch_batches(self, limit: int | None) -> Iterator:
        """This epoch's `(batch, position)` pairs, never reading past what will be trained;
        with `GradientAccumulation(k)`, `(batches, position)` groups of k loader batches."""
        pos, k = self.position, self.batches_per_step
        budget = (None if self.config.max_steps is None
                  else (self.config.max_steps - pos.global_step) * k)
        if limit is not None:
            left = limit - pos.batch_idx
            budget = left if budget is None else min(budget, left)
        pairs = self.feed.epoch(pos.epoch, pos.batch_idx, budget)
        return pairs if k == 1 else _grouped(pairs, k)

    def _check_batch(self, batch: Any, reference: _batch.BatchSignature, index: int,
                     partial: PartialStep | None = None) -> None:
        if _batch.matches(batch, reference):
            return
        where = f"training batch {index} of epoch {self.position.epoch}"
        if partial is not None and partial.accepts(batch, where):
            return
        _batch.check_same_signature(
            batch, reference, where,
            "Every training batch must have the same structure and shapes (drop a last partial "
            "batch, for example ArrayLoader(drop_remainder=True)).")

    def _check_group(self, group: list, reference: _batch.BatchSignature, start: int) -> None:
        """The k loader batches of one accumulated step (stacked; no last partial batch)."""
        k = self.batches_per_step
        for index, batch in enumerate(group, start):
            if _batch.matches(batch, reference):
                continue
            if (rows := _batch.partial_rows(batch, reference)) is not None:
                full = jax.tree.leaves(group[0])[0].shape[0]
                raise DataError(
                    f"training batch {index} of epoch {self.position.epoch} is a partial batch "
                    f"of {rows} examples (full batches have {full}): with "
                    f"accumulate_grad_batches={k} the {k} loader batches of one optimizer step "
                    "are stacked into one input and must have one shape. Drop the last partial "
                    "batch (jaxlight.data.DataLoader(..., drop_last=True); ArrayLoader drops it "
                    "by default), or choose a batch size that divides the number of examples.")
            self._check_batch(batch, reference, index)

    # -- metrics -------------------------------------------------------------------------------

    def _retire(self, pending: _Pending, final: bool = False) -> _Pending | None:
        """Waits for a step; logs its metrics at log intervals or a stop, as Lightning (else,
        for a round's newest, `final`, only the metric dicts)."""
        jax.block_until_ready(pending.metrics)
        if pending.log or final:
            host = self.session.log_spec.step_values(jax.device_get(pending.metrics))
            metrics = {"loss": float(host.pop("loss"))} if "loss" in host else {}
            metrics.update((k, float(v)) for k, v in host.items())
            metrics.update((k, float(v)) for k, v in pending.host.values.items())
            # Loggers also get the epoch (as Lightning's do); callback_metrics, as Lightning's,
            # hold no "epoch", and the bare name of an on_step+on_epoch value.
            self.log.callback_metrics.update(self.session.log_spec.with_bare_names(metrics))
            hidden = self.session.logger_hidden | pending.host.hidden
            if pending.log or self.position.should_stop:
                metrics["epoch"] = float(self.position.epoch)
                self.log.log(metrics, pending.step, hidden)
            else:
                self.log.record(metrics, hidden, pending.step)
            pending.log = False
        return None if final else pending

    def _retire_all(self, in_flight: collections.deque) -> None:
        """Waits for every dispatched step; the newest one's metrics reach the metric dicts."""
        while in_flight:  # the arguments run in order: `final` is read after the pop
            self._retire(in_flight.popleft(), final=not in_flight)

    def _step_for(self, k: int, one: Any, name: str) -> tuple:
        """The compiled step for k loader batches per step (`one`: a loader batch): "train"
        for epoch 0's k, "train_accumulate_<k>" for a scheduler's other ks, once each."""
        if k not in self._steps:
            abstract = abstract_global_batch(one if k == 1 else stack_batches([one], k))
            kind = ("train" if k == batches_per_step(self.session.callbacks, 0)
                    else f"train_accumulate_{k}")
            batches_per_step(self.session.callbacks, self.position.epoch)  # back to this k
            with tracing_for(name, "train_data", one):
                self._steps[k] = self.session.compile_train_step(abstract, kind=kind)
        return self._steps[k]

    # -- the loop ------------------------------------------------------------------------------

    def run(self, train_data: Iterable, val_data: Iterable | None) -> None:
        config, session, pos, call = self.config, self.session, self.position, self.hooks
        if self.done():
            # Resumed at its limit (a finished job requeued): nothing to train, and no training
            # hook runs, as in Lightning (on_fit_start and on_fit_end only).
            return
        limit = batch_limit(config.limit_train_batches, train_data)
        val_every = validation_interval(config, train_data)
        if val_data is not None:
            check_validation_interval(config, train_data)
        pairs = self._epoch_batches(limit)
        try:
            first, first_position = next(pairs)
        except StopIteration:
            raise DataError(
                "the training data yielded no batch: the iterable is empty (or exhausted, if it "
                "is a one-shot iterator). Pass a non-empty iterable of batches."
            ) from None
        # Every process must feed an equal share, or they compile different steps and hang.
        # With GradientAccumulation(k) the step takes k loader batches stacked as one input.
        k = self.batches_per_step
        one = first if k == 1 else first[0]
        _batch.check_batch_agreement(one, "training batch", _batch.len_or_none(train_data))
        first_name = f"training batch {pos.batch_idx} of epoch {pos.epoch}"
        check_dtypes(one, first_name)  # later batches: the signature check below
        reference = _batch.batch_signature(one, first_name)
        if k > 1:  # the first group is stacked right here: check it before
            self._check_group(first, reference, pos.batch_idx)
        abstract_batch = abstract_global_batch(one if k == 1 else stack_batches(first, k))
        with tracing_for(first_name, "train_data", one):
            session.choose_layout(abstract_batch)
        session.strategy.check_batch(abstract_batch)
        if session.state is None:
            session.state = session.init_state()
        # Validation's errors show before training, not at the first validation.
        self.evaluator.sanity_check(val_data)
        if self.done():
            # Done before the first step (a Timer's limit, max_steps reached by the resumed
            # checkpoint): Lightning skips the training loop, its hooks included.
            return
        compiled, batch_sh = self._step_for(k, one, first_name)
        # self.log(..., on_epoch=True) values: summed on device after each step, read at the
        # epoch's end (nothing to do for a module that logs none).
        epoch_metrics = EpochAccumulator(session.log_spec)
        call("on_train_start")

        full_rows = jax.tree.leaves(one)[0].shape[0] if jax.tree.leaves(one) else 0
        partial = PartialStep(session, reference, full_rows)

        def is_partial(batch) -> bool:
            leaves = jax.tree.leaves(batch)
            return partial.rows is not None and bool(leaves) and leaves[0].shape[0] != full_rows

        # Read ahead in a thread: put on the devices there. Read in this thread: as the
        # compiled step takes it (host arrays that its call places, `step_input`).
        depth = prefetch_depth(train_data, config.prefetch_batches)
        transfer = session.strategy.put_batch if depth else session.strategy.step_input
        put_group = GroupTransfer(transfer)  # k > 1: k batches as one input

        def put(batch):
            k = self.batches_per_step
            batch_sh = self._step_for(k, one, first_name)[1]
            if k > 1:
                return put_group(batch, k, batch_sh)
            return transfer(batch, partial.shardings if is_partial(batch) else batch_sh)

        def check(batch, n: int, start: int) -> None:
            if self.batches_per_step == 1:
                self._check_batch(batch, reference, start + n, partial)
            else:
                self._check_group(batch, reference, start + n * k)

        # Steps not yet waited for, oldest first; the newest is the one just dispatched.
        in_flight: collections.deque[_Pending] = collections.deque()
        first_epoch = True
        # Resumed from a checkpoint taken mid-epoch: that epoch's on_train_epoch_start has run
        # already (Lightning restarts mid-epoch without it).
        resumed_mid_epoch = pos.batch_idx > 0
        if pos.multi_process:
            pos.agree_stop()
        while not self.done():
            if first_epoch:
                pairs = itertools.chain([(first, first_position)], pairs)
            else:
                # A GradientAccumulationScheduler's k for this epoch (its own compiled step).
                k = self.batches_per_step = batches_per_step(session.callbacks, pos.epoch)
                compiled = self._step_for(k, one, first_name)[0]
                pairs = self._epoch_batches(limit)
            if not (first_epoch and resumed_mid_epoch):
                call("on_train_epoch_start")
            start = pos.batch_idx
            batches = Prefetcher(pairs, put, depth, lambda b, n, s=start: check(b, n, s))
            first_epoch = False
            got_any = False
            try:
                for batch, device_batch, position in batches:
                    got_any = True
                    # Accumulating: the hooks get the group's last loader batch and its index.
                    taken = 1 if k == 1 else len(batch)
                    batch = batch if k == 1 else batch[-1]
                    host_logs = HostLogs()  # self.log in this batch's hooks
                    with host_logs:
                        call("on_train_batch_start", batch, pos.batch_idx + taken - 1)
                    step = (partial.step(f"training batch {pos.batch_idx} of epoch "
                                         f"{pos.epoch}") if k == 1 and is_partial(batch)
                            else compiled)
                    session.state, metrics = step(session.state, device_batch)
                    epoch_metrics.add(metrics, jax.tree.leaves(batch)[0].shape[0] * taken)
                    self.feed.consumed(position)
                    pos.global_step += 1
                    pos.batch_idx += taken
                    # A log interval's metrics reached the callbacks: a stop agreement point.
                    logged = False
                    while len(in_flight) >= MAX_IN_FLIGHT - 1 and in_flight:
                        oldest = in_flight.popleft()
                        logged = logged or oldest.log
                        self._retire(oldest)
                    log = pos.global_step % config.log_every_n_steps == 0
                    in_flight.append(_Pending(pos.global_step, metrics, log, host_logs))
                    with host_logs:
                        call("on_train_batch_end", StepOutput(pos.global_step, metrics), batch,
                             pos.batch_idx - 1)
                    self.after_step()
                    if val_data is not None and validates_after_step(
                            config, val_every, pos.global_step, pos.epoch, pos.batch_idx, taken):
                        self._retire_all(in_flight)
                        self.evaluator.run_validation(val_data)
                        logged = True
                    if pos.multi_process and logged:
                        pos.agree_stop()
                    if self.done():
                        break
            finally:
                batches.close()
            if not got_any and pos.batch_idx == 0:
                raise DataError(
                    f"the training data yielded no batch in epoch {pos.epoch} (it gave batches "
                    "before): a one-shot iterator cannot be iterated twice. Pass a re-iterable "
                    "(a list, jaxlight.data.ArrayLoader) or set max_steps within one pass."
                )
            self._retire_all(in_flight)
            # Stopped at max_steps mid-epoch: as Lightning, the epoch-end hooks run (and the
            # checkpoints they take resume mid-epoch), but no end-of-epoch validation and no
            # epoch-interval scheduler step; the position stays in the epoch.
            mid_epoch = self.hit_max_steps() and not self.epoch_exhausted(train_data, limit)
            epoch_values = epoch_metrics.compute()
            if epoch_values:  # before the hooks, which may monitor them (as in Lightning)
                self.log.callback_metrics.update(session.log_spec.with_bare_names(epoch_values))
                self.log.log(epoch_values, pos.global_step, session.logger_hidden)

            def validation_due() -> bool:
                # A stop requested mid-epoch (EarlyStopping at a val_check_interval) skips the
                # end-of-epoch validation, as Lightning does: the epoch did not end.
                stopped_early = pos.should_stop and not self.epoch_exhausted(train_data, limit)
                return bool(val_data is not None and val_every is None and not mid_epoch
                            and config.check_val_every_n_epoch
                            and (pos.epoch + 1) % config.check_val_every_n_epoch == 0
                            and not stopped_early)

            if session.schedule is not None and not mid_epoch:
                # Epoch-interval schedulers advance before the epoch-end hooks, where
                # checkpoints are taken, so that a resumed fit continues them exactly.
                session.state = session.schedule.at_epoch_end(session.state, pos.epoch,
                                                              validation_due())
            # The epoch's validation runs before its on_train_epoch_end hooks, as in Lightning
            # 2.x (its test_hooks.py): epoch-end hooks, and what they save, see this epoch's
            # validation metrics.
            if validation_due():
                self.evaluator.run_validation(val_data, epoch_end=True)
            call("on_train_epoch_end")
            # What a compiled step read from the module must be what it was traced with (a
            # network re-synced in place from a hook never reaches it): once per epoch.
            check_reads(session.module, f"the end of epoch {pos.epoch} (step {pos.global_step})")
            if pos.multi_process:
                pos.agree_stop()
            if mid_epoch:
                break
            pos.epoch += 1
            pos.batch_idx = 0
        self._retire_all(in_flight)
        if pos.multi_process:
            pos.agree_stop()  # a guard's last-moment error must end every process alike
        if pos.stop_reason is not None and pos.stop_reason.startswith("error:"):
            raise TrainingStopped(pos.stop_reason[len("error:"):].strip())
        call("on_train_end")
        # Training ends with the parameters evaluation reads (WeightAveraging's average is
        # copied into the model, as in Lightning), as fresh arrays (a state is donated to the
        # steps it enters). After on_train_end, whose checkpoints keep the current parameters
        # beside the average, so that resuming one continues the run as it was.
        final = session.evaluation_state(session.state)
        if final is not session.state:
            session.state = session.state.replace(params=jax.tree.map(jnp.copy, final.params),
                                                  rest=jax.tree.map(jnp.copy, final.rest))
