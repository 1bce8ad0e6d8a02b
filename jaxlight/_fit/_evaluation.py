"""Evaluator: the validation, test and prediction loops.

Evaluation sees whole batches and is exact over the dataset. Every batch reaches
`validation_step` / `test_step` as the loader yielded it: never padded, never split into
examples. Each distinct batch shape compiles once per evaluation kind (`Session.compile_eval_step`,
cached for the fit): usually the full batches and one short last batch. A batch whose global size
the data-parallel degree divides is sharded like a training batch; any other (a short last
batch: 100 examples on 8 devices end with 4) is given whole to every device, which all compute
the same result (`_step.build_eval_step(sharded=False)`). Results are exact either way: scalar
means weighted by each batch's examples (or `self.log(batch_size=...)`), clu metrics merged on
device (`jaxlight._metrics`), read once at the end.

With several processes, the processes agree on each batch's per-process row counts (one small
host exchange per evaluation batch); unequal shares of a last batch are gathered onto every
process (`multihost_utils.process_allgather`) and evaluated whole.

Prediction still pads a short last batch to the first batch's size and cuts the outputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.experimental.multihost_utils
import numpy as np

from jaxlight import _metrics
from jaxlight import distributed as _distributed
from jaxlight._errors import DataError, StepOutputError
from jaxlight._fit._config import FitConfig, batch_limit
from jaxlight._fit._hooks import Hooks, MetricLog
from jaxlight._fit._loop_state import LoopState
from jaxlight._fit._session import Session
from jaxlight._state import TrainState
from jaxlight._user_step import tracing_for
from jaxlight.data._convert import check_iterable, numpy_batches

_END = -1  # a process whose data ran out, in the per-batch row-count exchange


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


def pad_batch(batch: Any, size: int, what: str) -> tuple[Any, np.ndarray]:
    """`batch` padded to `size` examples, and the mask of its real examples."""
    n = int(np.shape(jax.tree.leaves(batch)[0])[0])
    if n > size:
        raise DataError(
            f"{what} batch of {n} examples is larger than the first {what} batch ({size}); "
            "the evaluation step is compiled for the first batch's size. Put the largest "
            "batch first or use equal batch sizes."
        )
    mask = np.arange(size) < n
    if n == size:
        return batch, mask
    # Pad with copies of the first example (finite values); the mask drops them. A process
    # can get no example of a short last batch (fewer examples than processes): zeros then.
    def pad(x):
        x = np.asarray(x)
        fill = np.repeat(x[:1], size - n, 0) if n else np.zeros((size, *x.shape[1:]), x.dtype)
        return np.concatenate([x, fill])

    return jax.tree.map(pad, batch), mask


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

    def run_validation(self, val_data: Iterable) -> dict[str, float]:
        """A validation round inside fit: hooks, exact metrics, logged at the current step."""
        call = self.hooks
        call("on_validation_start")
        call("on_validation_epoch_start")
        metrics = self.evaluate(val_data, "validation_step", "val", self.config.limit_val_batches,
                                f"validation at step {self.position.global_step}", "val_data")
        self.log.callback_metrics.update(metrics)
        self.log.log(metrics, self.position.global_step)
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
        limit = batch_limit(self.config.limit_val_batches, val_data)
        if n > 0:
            limit = n if limit is None else min(n, limit)
        self.hooks("on_sanity_check_start")
        self.evaluate(val_data, "validation_step", "val", limit, "sanity check before training",
                      "val_data", batch_hooks=False,
                      advice="num_sanity_val_steps=0 skips this check.")
        self.hooks("on_sanity_check_end")

    def eval_state(self) -> TrainState:
        """The state to evaluate: the training state, else the module's model, else a new one."""
        session = self.session
        if session.state is not None:
            return session.state
        if session.module._model is not None:
            return session.state_from_model(session.module.model)
        session.state = session.init_state()
        return session.state

    def evaluate(self, data: Iterable, method: str, prefix: str, limit_arg,
                 occasion: str = "", data_name: str = "the data", *, batch_hooks: bool = True,
                 advice: str = "") -> dict[str, float]:
        """Exact metrics of `method` over `data`; returned keys prefixed with `prefix`.

        `occasion` and `data_name` name the batch in errors raised while tracing the step, and
        `advice` adds a sentence to them; `batch_hooks=False` calls no per-batch hook.
        """
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
            counts = None
            if multi:
                counts = _distributed.all_gather_json(
                    f"eval_rows:{method}", _END if batch is None else _rows(batch))
                if _END in counts and set(counts) != {_END}:
                    ended = [p for p, c in enumerate(counts) if c == _END]
                    raise DataError(
                        f"the {prefix} data of process(es) {ended} ended after {idx} batches "
                        f"while the others have more (rows per process: {counts}). Every "
                        "process must yield the same number of evaluation batches "
                        "(jaxlight.data.ArrayLoader does)."
                    )
            if batch is None:
                break
            with tracing_for(f"{what} batch {idx}" + (f" ({occasion})" if occasion else ""),
                             data_name, batch, advice):
                compiled, device_batch, zeros = self._place(method, prefix, batch, state,
                                                            counts)
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
        return _metrics.finish(jax.device_get(totals), self.session.eval_spec(method, prefix),
                               where)

    def _flag(self, value: bool) -> jax.Array:
        """`first` of the eval step, as a replicated device scalar (made once)."""
        strategy = self.session.strategy
        key = (value, strategy.mesh)
        if key not in self._flags:
            self._flags[key] = jax.device_put(np.bool_(value), strategy.replicated())
        return self._flags[key]

    def _place(self, method: str, prefix: str, batch: Any, state: TrainState,
               counts: list[int] | None):
        """The compiled step for this batch's shape, the batch on the devices, zero totals."""
        strategy = self.session.strategy
        dp = strategy.data_parallel_size
        if counts is None:
            sharded, whole = _rows(batch) % dp == 0, batch
        else:
            sharded = len(set(counts)) == 1 and sum(counts) % dp == 0
            whole = batch if sharded else _gather(batch, counts)
        abstract = _abstract(batch, jax.process_count()) if sharded else _abstract(whole)
        compiled, batch_sh, zeros = self.session.compile_eval_step(
            method, prefix, abstract, state, sharded, batch)
        if sharded:
            device_batch = strategy.put_batch(batch, batch_sh)
        else:
            device_batch = jax.tree.map(
                lambda x, s: jax.make_array_from_callback(
                    np.shape(x), s, lambda index, x=x: np.asarray(x)[index]),
                whole, batch_sh)
        return compiled, device_batch, zeros

    def predict(self, data: Iterable) -> list[Any]:
        """One NumPy pytree of `predict_step` outputs per batch, padding cut."""
        session = self.session
        state = self.eval_state()
        outputs, compiled = [], None
        check_iterable(data, "predict")
        for batch in numpy_batches(data):
            local = int(np.shape(jax.tree.leaves(batch)[0])[0])
            size = session.eval_size("predict", local)
            batch, _ = pad_batch(batch, size, "predict")
            if compiled is None:
                with tracing_for("predict batch 0", "the data passed to Fit.predict", batch):
                    compiled, batch_sh = session.compile_predict_step(batch, state)
            out = compiled(state, session.strategy.put_batch(batch, batch_sh))
            if jax.process_count() > 1:
                # Process p's rows sit at [p * size, p * size + its count) of the output.
                counts = _distributed.all_gather_json("predict_rows", local)
                rows = np.concatenate([np.arange(p * size, p * size + c)
                                       for p, c in enumerate(counts)])
                out = jax.tree.map(lambda x: np.asarray(
                    jax.experimental.multihost_utils.process_allgather(x, tiled=True))[rows],
                    out)
            else:
                out = jax.tree.map(lambda x: np.asarray(x)[:local], out)
            outputs.append(out)
        return outputs
