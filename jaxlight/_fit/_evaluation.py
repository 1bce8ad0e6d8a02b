"""Evaluator: the validation, test and prediction loops.

Evaluation sees whole batches and is exact over the dataset. Every batch reaches
`validation_step` / `test_step` as the loader yielded it: never padded, never split into
examples. Each distinct batch shape compiles once per evaluation kind (`Session.compile_eval_step`,
cached for the fit): usually the full batches and one short last batch. A batch whose global size
the data-parallel degree divides is sharded like a training batch; any other (a short last
batch: 100 examples on 8 devices end with 4) is given whole to every device, which all compute
the same result (`_step.build_eval_step(sharded=False)`). Results are exact either way: scalar
means weighted by each batch's examples (or `self.log(batch_size=...)`), clu metrics merged on
device (`jaxlight.metrics._eval_totals`), read once at the end.

With several processes, the processes agree on each batch's per-process row counts (one small
host exchange per evaluation batch); unequal shares of a last batch are gathered onto every
process (`multihost_utils.process_allgather`) and evaluated whole.

`predict_step` follows the same rules (whole, unpadded batches; one compile per shape per call).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.experimental.multihost_utils
import numpy as np

from jaxlight import distributed as _distributed
from jaxlight._errors import DataError, StepOutputError
from jaxlight._fit._config import FitConfig, batch_limit
from jaxlight._fit._hooks import Hooks, MetricLog
from jaxlight._fit._loop_state import LoopState
from jaxlight._fit._session import Session
from jaxlight.data._convert import check_iterable, numpy_batches
from jaxlight.metrics import _eval_totals
from jaxlight.state._state import TrainState
from jaxlight.step._user_step import tracing_for

_END = -1  # a process whose data ran out, in the per-batch row-count exchange


def several_loaders(data: Any) -> list | None:
    """The loaders of `data` when it is a list/tuple of loaders (Lightning's several validation
    or test dataloaders), else None (one loader, or a list of batches)."""
    if not isinstance(data, list | tuple) or not data:
        return None

    def loader(x: Any) -> bool:
        if isinstance(x, Mapping) or hasattr(x, "shape") or not hasattr(x, "__iter__"):
            return False  # a batch (a dict, an array), or not iterable
        if isinstance(x, list | tuple):  # a list of batches, not a batch tuple of arrays
            return bool(x) and not hasattr(x[0], "shape")
        return True

    return list(data) if all(loader(x) for x in data) else None


def for_evaluation(data: Any) -> Any:
    """`data` as evaluation reads it: an `ArrayLoader` left at training's defaults (shuffle,
    drop the last partial batch) reads every example in order, through a copy that moves no
    training position; anything else as it is."""
    view = getattr(data, "for_evaluation", None)
    return view() if callable(view) else data


def takes_dataloader_idx(fn: Any) -> bool:
    try:
        return "dataloader_idx" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _rows(batch: Any) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves or not np.shape(leaves[0]):
        raise DataError("an evaluation batch needs array leaves with a leading batch dimension; "
                        f"got {jax.tree.map(np.shape, batch)}.")
    return int(np.shape(leaves[0])[0])


def _abstract(batch: Any, scale: int = 1) -> Any:
    def one(x):
        x = np.asarray(x)
        return jax.ShapeDtypeStruct((x.shape[0] * scale, *x.shape[1:]), x.dtype)

    return jax.tree.map(one, batch)


def _shapes(tree: Any) -> list:
    return [(tuple(np.shape(x)), str(x.dtype)) for x in jax.tree.leaves(tree)]


def _gather(batch: Any, counts: list[int]) -> Any:
    """The global batch on every process, from unequal per-process shares (host arrays)."""
    most = max(counts)

    def one(x):
        x = np.asarray(x)
        pad = np.zeros((most - x.shape[0], *x.shape[1:]), x.dtype)
        stacked = np.asarray(jax.experimental.multihost_utils.process_allgather(
            np.concatenate([x, pad]), tiled=False))
        return np.concatenate([stacked[p, :c] for p, c in enumerate(counts)])

    return jax.tree.map(one, batch)


class Evaluator:
    """Runs `validation_step`, `test_step` and `predict_step` loops on the session's state."""

    def __init__(self, config: FitConfig, session: Session, position: LoopState, hooks: Hooks,
                 log: MetricLog):
        self.config = config
        self.session = session
        self.position = position
        self.hooks = hooks
        self.log = log
        self._flags: dict[tuple, jax.Array] = {}

    def run_validation(self, val_data: Iterable, epoch_end: bool = False) -> dict[str, float]:
        """A validation round inside fit: hooks, exact metrics, logged at the current step.

        `epoch_end`: the end-of-epoch validation (an epoch-interval plateau scheduler reads it).
        """
        call = self.hooks
        call("on_validation_start")
        call("on_validation_epoch_start")
        metrics = self.evaluate(val_data, "validation_step", "val", self.config.limit_val_batches,
                                f"validation at step {self.position.global_step}", "val_data")
        schedule = self.session.schedule
        if schedule is not None:
            # Before the end hooks, where checkpoints are taken: they resume it.
            pos = self.position
            self.session.state = schedule.after_validation(
                self.session.state, metrics, pos.batch_idx, pos.epoch, epoch_end)
        self.log.callback_metrics.update(metrics)
        self.log.log(metrics, self.position.global_step, self.session.logger_hidden)
        call("on_validation_epoch_end")
        call("on_validation_end")
        return metrics

    def sanity_check(self, val_data: Iterable | None) -> None:
        """Runs `validation_step` on the first `num_sanity_val_steps` validation batches.

        Before the first training step, so that an error in the step or the validation data
        (a missing key, a wrong shape) shows now and not after an epoch of training. The steps
        it compiles are the ones validation reuses; its metrics are dropped, not logged.
        """
        n = self.config.num_sanity_val_steps
        if val_data is None or n == 0:
            return
        if several_loaders(val_data) is None:
            val_data = for_evaluation(val_data)
        limit = batch_limit(self.config.limit_val_batches, val_data)
        if n > 0:
            limit = n if limit is None else min(n, limit)
        self.hooks("on_sanity_check_start")
        metrics = self.evaluate(val_data, "validation_step", "val", limit,
                                "sanity check before training", "val_data", batch_hooks=False,
                                advice="num_sanity_val_steps=0 skips this check.")
        when = " in the sanity check before training"
        if self.session.schedule is not None:  # a monitor validation never produces
            self.session.schedule.check_monitor(metrics, when)
        for cb in self.hooks.callbacks:  # EarlyStopping's, ModelCheckpoint's
            check = getattr(cb, "check_validation_monitor", None)
            if check is not None:
                check(list(metrics), when)
        self.hooks("on_sanity_check_end")

    def eval_state(self) -> TrainState:
        """The state to evaluate: the training state, else the module's model, else a new one."""
        session = self.session
        if session.state is not None:
            return session.evaluation_state(session.state)
        if session.module.assigned_model is not None:
            return session.state_from_model(session.module.assigned_model)
        session.state = session.init_state()
        return session.state

    def evaluate(self, data: Iterable, method: str, prefix: str, limit_arg,
                 occasion: str = "", data_name: str = "the data", *, batch_hooks: bool = True,
                 advice: str = "") -> dict[str, float]:
        """Exact metrics of `method` over `data`; returned keys prefixed with `prefix`.

        `occasion` and `data_name` name the batch in errors raised while tracing the step, and
        `advice` adds a sentence to them; `batch_hooks=False` calls no per-batch hook.

        Several loaders (a list or tuple of them) are evaluated one after the other, as in
        Lightning: each metric name gets the suffix `/dataloader_idx_N`, and a step with a
        `dataloader_idx` parameter is told N (it compiles once per loader).
        """
        loaders = several_loaders(data)
        self.session.eval_loaders[method] = 1 if loaders is None else len(loaders)
        if loaders is None or len(loaders) == 1:  # one loader: no suffix, as in Lightning
            one = data if loaders is None else loaders[0]
            return self._evaluate_one(one, method, prefix, limit_arg, occasion, data_name,
                                      batch_hooks=batch_hooks, advice=advice)
        pass_idx = takes_dataloader_idx(getattr(self.session.module, method))
        out: dict[str, float] = {}
        for i, loader in enumerate(loaders):
            metrics = self._evaluate_one(loader, method, prefix, limit_arg, occasion,
                                         f"{data_name}[{i}]", batch_hooks=batch_hooks,
                                         advice=advice, dataloader_idx=i if pass_idx else None)
            out.update((f"{k}/dataloader_idx_{i}", v) for k, v in metrics.items())
        return out

    def _evaluate_one(self, data: Iterable, method: str, prefix: str, limit_arg,
                      occasion: str = "", data_name: str = "the data", *,
                      batch_hooks: bool = True, advice: str = "",
                      dataloader_idx: int | None = None) -> dict[str, float]:
        data = for_evaluation(data)
        limit = batch_limit(limit_arg, data)
        if hasattr(data, "set_epoch"):
            data.set_epoch(0)  # every evaluation reads the data from its start, in one order
        state = self.eval_state()
        check_iterable(data, prefix)
        multi = jax.process_count() > 1
        what = "validation" if prefix == "val" else prefix
        where = f"{type(self.session.module).__name__}.{method}"
        totals = pending = None
        batches = iter(numpy_batches(data))
        idx = 0
        while True:
            batch = next(batches, None) if limit is None or idx < limit else None
            counts = self._agree_rows(method, prefix, batch, idx) if multi else None
            if batch is None:
                break
            with tracing_for(f"{what} batch {idx}" + (f" ({occasion})" if occasion else ""),
                             data_name, batch, advice):
                compiled, device_batch, zeros = self._place(method, prefix, batch, state,
                                                            counts, dataloader_idx)
            if totals is None:
                totals = zeros
            elif _shapes(totals) != _shapes(zeros):
                raise StepOutputError(
                    f"{where} reports metrics whose shapes depend on the batch size (batch "
                    f"{idx} of {_rows(batch)} rows: {_shapes(zeros)}; earlier batches: "
                    f"{_shapes(totals)}); totals are merged across batches in fixed shapes. "
                    "Make every metric's state independent of the batch size."
                )
            totals = compiled(state, device_batch, totals, self._flag(pending is None))
            if pending is not None:
                jax.block_until_ready(pending)  # at most two batches in flight
            pending = totals
            if prefix == "val" and batch_hooks:
                self.hooks("on_validation_batch_end", batch, idx)
            idx += 1
        if totals is None:
            raise DataError(f"the {prefix} data yielded no batch; pass a non-empty iterable.")
        return _eval_totals.finish(jax.device_get(totals),
                                   self.session.eval_spec(method, prefix, dataloader_idx), where)

    def _flag(self, value: bool) -> jax.Array:
        """`first` of the eval step, as a replicated device scalar (made once)."""
        strategy = self.session.strategy
        key = (value, strategy.mesh)
        if key not in self._flags:
            self._flags[key] = jax.device_put(np.bool_(value), strategy.replicated())
        return self._flags[key]

    @staticmethod
    def _agree_rows(kind: str, what: str, batch: Any, idx: int) -> list[int]:
        """Every process's row count of its share of batch `idx` (`_END`: its data ended)."""
        counts = _distributed.all_gather_json(f"eval_rows:{kind}",
                                              _END if batch is None else _rows(batch))
        if _END in counts and set(counts) != {_END}:
            ended = [p for p, c in enumerate(counts) if c == _END]
            raise DataError(
                f"the {what} data of process(es) {ended} ended after {idx} batches while the "
                f"others have more (rows per process: {counts}). Every process must yield the "
                "same number of evaluation batches (jaxlight.data.ArrayLoader does)."
            )
        return counts

    def _layout(self, batch: Any, counts: list[int] | None) -> tuple[bool, Any, Any]:
        """`(sharded, whole, abstract)`: whether the batch is sharded like a training batch
        (the data-parallel degree divides it, equal shares per process), else given whole to
        every device; the global host batch for the latter; the global abstract batch."""
        dp = self.session.strategy.data_parallel_size
        if counts is None:
            sharded, whole = _rows(batch) % dp == 0, batch
        else:
            sharded = len(set(counts)) == 1 and sum(counts) % dp == 0
            whole = batch if sharded else _gather(batch, counts)
        return sharded, whole, (_abstract(batch, jax.process_count()) if sharded
                                else _abstract(whole))

    def _put(self, batch: Any, whole: Any, sharded: bool, batch_sh: Any) -> Any:
        if sharded:
            return self.session.strategy.step_input(batch, batch_sh)
        return jax.tree.map(
            lambda x, s: jax.make_array_from_callback(
                np.shape(x), s, lambda index, x=x: np.asarray(x)[index]),
            whole, batch_sh)

    def _place(self, method: str, prefix: str, batch: Any, state: TrainState,
               counts: list[int] | None, dataloader_idx: int | None = None):
        """The compiled step for this batch's shape, the batch on the devices, zero totals."""
        sharded, whole, abstract = self._layout(batch, counts)
        compiled, batch_sh, zeros = self.session.compile_eval_step(
            method, prefix, abstract, state, sharded, batch, dataloader_idx)
        return compiled, self._put(batch, whole, sharded, batch_sh), zeros

    def predict(self, data: Iterable) -> list[Any]:
        """One NumPy pytree of `predict_step` outputs per batch (the global rows, in order).

        Like evaluation, `predict_step` sees every batch whole and unpadded; each batch shape
        compiles once per call.
        """
        session = self.session
        state = self.eval_state()
        data = for_evaluation(data)
        check_iterable(data, "predict")
        multi = jax.process_count() > 1
        outputs: list[Any] = []
        compiled: dict[tuple, tuple] = {}
        batches = iter(numpy_batches(data))
        idx = 0
        while True:
            batch = next(batches, None)
            counts = self._agree_rows("predict", "predict", batch, idx) if multi else None
            if batch is None:
                break
            sharded, whole, abstract = self._layout(batch, counts)
            key = (sharded, tuple(_shapes(abstract)), jax.tree.structure(abstract))
            if key not in compiled:
                with tracing_for(f"predict batch {idx}", "the data passed to Fit.predict", batch):
                    compiled[key] = session.compile_predict_step(abstract, state, sharded, batch)
            step, batch_sh = compiled[key]
            out = step(state, self._put(batch, whole, sharded, batch_sh))
            outputs.append(jax.tree.map(lambda x, sharded=sharded: _host(x, sharded), out))
            self.hooks("on_predict_batch_end", outputs[-1], batch, idx)
            idx += 1
        self.hooks("on_predict_epoch_end")
        return outputs


def _host(x: jax.Array, sharded: bool) -> np.ndarray:
    """A predict output on the host: the global rows, on every process."""
    if jax.process_count() == 1:
        return np.asarray(x)
    if not sharded:  # computed whole on every device: any local copy is the whole output
        return np.asarray(x.addressable_data(0))
    return np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True))
