"""Evaluator: the validation, test and prediction loops.

Evaluation metrics are exact over the whole dataset: every batch is padded to the first
batch's (data-parallel divisible) size and a mask drops the padding, so one step is compiled
per kind and padding never changes a result.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.experimental.multihost_utils
import numpy as np

from jaxlight import distributed as _distributed
from jaxlight._errors import DataError
from jaxlight._fit._config import FitConfig, batch_limit
from jaxlight._fit._hooks import Hooks, MetricLog
from jaxlight._fit._loop_state import LoopState
from jaxlight._fit._session import Session
from jaxlight._state import TrainState
from jaxlight._user_step import tracing_for
from jaxlight.data._convert import check_iterable, numpy_batches


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
        (a missing key, a wrong shape) shows now and not after an epoch of training. The step
        it compiles is the one every validation reuses; its metrics are dropped, not logged.
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
        """Exact means of `method`'s metrics over `data`, keys prefixed with `prefix`.

        `occasion` and `data_name` name the batch in errors raised while tracing the step, and
        `advice` adds a sentence to them; `batch_hooks=False` calls no per-batch hook.
        """
        session = self.session
        limit = batch_limit(limit_arg, data)
        if hasattr(data, "set_epoch"):
            data.set_epoch(0)  # every evaluation reads the data from its start, in one order
        state = self.eval_state()
        totals = None
        compiled = None
        pending = None
        check_iterable(data, prefix)
        for idx, batch in enumerate(numpy_batches(data)):
            if limit is not None and idx >= limit:
                break
            local = int(np.shape(jax.tree.leaves(batch)[0])[0])
            size = session.eval_size(method, local)
            batch, mask = pad_batch(batch, size, prefix)
            if compiled is None:
                what = "validation" if prefix == "val" else prefix
                with tracing_for(f"{what} batch {idx}" + (f" ({occasion})" if occasion else ""),
                                 data_name, batch, advice):
                    compiled, batch_sh, mask_sh, totals = session.compile_eval_step(
                        method, batch, state)
            device_batch = session.strategy.put_batch(batch, batch_sh)
            device_mask = session.strategy.put_batch(mask, mask_sh)
            totals = compiled(state, device_batch, device_mask, totals)
            if pending is not None:
                jax.block_until_ready(pending)
            pending = totals
            if prefix == "val" and batch_hooks:
                self.hooks("on_validation_batch_end", batch, idx)
        if totals is None:
            raise DataError(f"the {prefix} data yielded no batch; pass a non-empty iterable.")
        host = jax.device_get(totals)
        count = float(host.pop("__count__"))
        return {(k if k.startswith(prefix) else f"{prefix}_{k}"): float(v) / count
                for k, v in host.items()}

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
