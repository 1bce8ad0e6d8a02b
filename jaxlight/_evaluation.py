"""Evaluation: `validation_step` / `test_step` over whole batches, exact over the dataset.

Every batch reaches the step as the loader yielded it: never padded, never split into examples.
Each distinct batch shape compiles once (per evaluation kind, cached for the fit): usually the
full batches and one short last batch, so at most one extra compile. A batch whose global size
the data-parallel degree divides is sharded like a training batch; any other (a short last
batch: 100 examples on 8 devices ends with 4) is given whole to every device, which computes the
same result (`_step.build_eval_step(sharded=False)`). Results are exact either way: scalar means
weighted by each batch's examples, clu metrics merged on device (`jaxlight._metrics`), read once
at the end.

With several processes the processes agree on each batch's per-process row counts (one small
host exchange per evaluation batch); unequal shares of a last batch are gathered on every process
(`multihost_utils.process_allgather`) and evaluated whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxlight import _batch, _metrics
from jaxlight import distributed as _distributed
from jaxlight._errors import DataError, StepOutputError
from jaxlight._step import build_eval_step
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


class Evaluator:
    """Runs evaluation kinds (`validation_step`, `test_step`) for one module and strategy.

    Args:
        module: the `TrainModule`.
        strategy: the set-up strategy.
        eval_graphdef: the model's eval-mode graph definition.
        state_shardings: `state -> shardings` of a train state (with or without optimizer).
        abstract_state: `state -> ` its canonical abstract shapes.
        compiling: `kind -> context manager` that counts and times one compile.
    """

    def __init__(self, module, strategy, eval_graphdef, *, state_shardings: Callable,
                 abstract_state: Callable, compiling: Callable):
        self.module, self.strategy, self.eval_graphdef = module, strategy, eval_graphdef
        self._state_shardings = state_shardings
        self._abstract_state = abstract_state
        self._compiling = compiling
        self._compiled: dict[tuple, tuple] = {}
        self._specs: dict[str, _metrics.EvalSpec] = {}
        self._flags: dict[bool, jax.Array] = {}

    @property
    def prog_bar(self) -> set[str]:
        """Names an evaluation step logged with `prog_bar=True`."""
        return set().union(*(s.prog_bar for s in self._specs.values()))

    def run(self, data: Iterable, state, method: str, prefix: str, limit: int | None = None,
            on_batch_end: Callable[[Any, int], None] | None = None, *, occasion: str = "",
            data_name: str = "the data") -> dict[str, float]:
        """Evaluates `method` over `data` (at most `limit` batches); the exact metrics.

        `occasion` ("sanity check", "Fit.validate") and `data_name` name the batch in errors
        raised while the step is traced for it.
        """
        if hasattr(data, "set_epoch"):
            data.set_epoch(0)  # every evaluation reads the data from its start, in one order
        check_iterable(data, prefix)
        spec = self._specs.setdefault(method, _metrics.EvalSpec(prefix))
        multi = jax.process_count() > 1
        totals = pending = None
        it = iter(numpy_batches(data))
        idx = 0
        while True:
            batch = None
            if limit is None or idx < limit:
                batch = next(it, None)
            counts = None
            if multi:
                counts = _distributed.all_gather_json(
                    f"eval_rows:{method}", _END if batch is None else _rows(batch))
                if any(c == _END for c in counts) and not all(c == _END for c in counts):
                    ended = [p for p, c in enumerate(counts) if c == _END]
                    raise DataError(
                        f"the {prefix} data of process(es) {ended} ended after {idx} batches while "
                        f"the others have more (rows per process: {counts}). Every process must "
                        "yield the same number of evaluation batches (jaxlight.data.ArrayLoader "
                        "does)."
                    )
            if batch is None:
                break
            what = "validation" if prefix == "val" else prefix
            with tracing_for(f"{what} batch {idx}" + (f" ({occasion})" if occasion else ""),
                             data_name, batch):
                compiled, put, zeros = self._step_for(method, spec, batch, state, counts)
            if totals is None:
                totals = zeros
            elif _shapes(totals) != _shapes(zeros):
                raise StepOutputError(
                    f"{type(self.module).__name__}.{method} reports metrics whose shapes depend "
                    f"on the batch size (batch {idx} has {_rows(batch)} rows: {_shapes(zeros)}, "
                    f"earlier batches: {_shapes(totals)}); totals are merged across batches in "
                    "fixed shapes. Make every metric's state independent of the batch size."
                )
            totals = compiled(state, put(batch), totals, self._flag(pending is None))
            if pending is not None:
                jax.block_until_ready(pending)  # at most two batches in flight
            pending = totals
            if on_batch_end is not None:
                on_batch_end(batch, idx)
            idx += 1
        if totals is None:
            raise DataError(f"the {prefix} data yielded no batch; pass a non-empty iterable.")
        return _metrics.finish(jax.device_get(totals), spec,
                               f"{type(self.module).__name__}.{method}")

    def _flag(self, value: bool) -> jax.Array:
        if value not in self._flags:
            self._flags[value] = jax.device_put(np.bool_(value), self.strategy.replicated())
        return self._flags[value]

    # -- layout and compiling ------------------------------------------------------------------

    def _step_for(self, method: str, spec, batch: Any, state, counts: list[int] | None):
        """The compiled step, batch placement and zero totals for this batch's shape."""
        nproc = jax.process_count()
        local = _rows(batch)
        dp = self.strategy.data_parallel_size
        if counts is None:
            sharded = local % dp == 0
            global_batch = batch
        else:
            sharded = len(set(counts)) == 1 and sum(counts) % dp == 0
            global_batch = batch if sharded else _gather(batch, counts)
        abstract = _abstract(batch, nproc) if sharded else _abstract(global_batch)
        key = (method, state.opt_state is None, sharded,
               tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(abstract)),
               jax.tree.structure(abstract))
        if key not in self._compiled:
            self._compiled[key] = self._compile(method, spec, abstract, state, sharded, batch)
        compiled, batch_sh, zeros = self._compiled[key]
        if sharded:
            def put(b):
                return self.strategy.put_batch(b, batch_sh)
        else:
            def put(b, whole=global_batch):
                del b
                return jax.tree.map(
                    lambda x, s: jax.make_array_from_callback(
                        np.shape(x), s, lambda index, x=x: np.asarray(x)[index]),
                    whole, batch_sh)
        return compiled, put, zeros

    def _compile(self, method: str, spec, abstract_batch: Any, state, sharded: bool, local):
        strategy = self.strategy
        if sharded:
            _batch.check_batch_agreement(local, f"{method} batch")
            strategy.check_batch(abstract_batch, what=f"{method} batch")
            batch_sh = strategy.batch_shardings(abstract_batch)
            _batch.check_batch_layout(batch_sh, abstract_batch, f"{method} batch")
        else:
            batch_sh = strategy.replicated_like(abstract_batch)
        eval_step, batch_totals = build_eval_step(self.module, self.eval_graphdef, method,
                                                  strategy, spec, sharded=sharded)
        abstract_state = self._abstract_state(state)
        with strategy.trace_context():
            abstract_totals = jax.eval_shape(batch_totals, abstract_state, abstract_batch)
        rep = strategy.replicated()
        flag = jax.ShapeDtypeStruct((), jnp.bool_)
        with self._compiling(f"eval:{method}"):
            compiled = strategy.compile(
                eval_step,
                (abstract_state, abstract_batch, abstract_totals, flag),
                in_shardings=(self._state_shardings(state), batch_sh, rep, rep),
                out_shardings=rep,  # small totals, not donated: the loop can wait on them
            )
        zeros = jax.device_put(
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_totals),
            strategy.replicated_like(abstract_totals),
        )
        return compiled, batch_sh, zeros


def _shapes(tree: Any) -> list:
    return [(tuple(np.shape(x)), str(x.dtype)) for x in jax.tree.leaves(tree)]


def _gather(batch: Any, counts: list[int]) -> Any:
    """The global batch on every process, from unequal per-process shares (host arrays)."""
    most = max(counts)

    def one(x):
        x = np.asarray(x)
        pad = np.zeros((most - x.shape[0], *x.shape[1:]), x.dtype)
        stacked = np.asarray(multihost_utils.process_allgather(np.concatenate([x, pad]),
                                                               tiled=False))
        return np.concatenate([stacked[p, :c] for p, c in enumerate(counts)])

    return jax.tree.map(one, batch)
