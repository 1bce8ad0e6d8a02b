"""Calls into the user's step functions: an error raised while one is traced names the step, the
data and the batch it was traced for (a bare `KeyError: 'y'` names none of them).

The loop says which batch a step is being traced for with `tracing_for(...)`; the step builders
call the user's `training_step`/`validation_step`/... through `call_user_step`, which turns any
exception that is not already a `JaxlightError` into a `UserStepError` whose `__cause__` is the
original (its traceback still points into the user's code); a traced value used as a Python
value (`if loss > 1:`) becomes a `PortingError` with the jax form. The trace-time guards
(`jaxlight.step._guards`) watch every such call.
"""

from __future__ import annotations

import contextlib
import contextvars
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from jaxlight._errors import JaxlightError, PortingError, UserStepError, is_user_file
from jaxlight.step import _guards

_TRACING_FOR: contextvars.ContextVar[tuple[str, str, str] | None] = contextvars.ContextVar(
    "jaxlight_tracing_for", default=None)


def describe_batch(batch: Any) -> str:
    """`{['x']: (32, 16) float32, ['y']: (32,) int32}`: each leaf's path, shape and dtype."""
    parts = []
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        dtype = getattr(x, "dtype", None)
        dtype = np.asarray(x).dtype if dtype is None else dtype
        parts.append(f"{jax.tree_util.keystr(path) or 'batch'}: {tuple(np.shape(x))} {dtype}")
    return "{" + ", ".join(parts) + "}"


@contextlib.contextmanager
def tracing_for(batch_name: str, data_name: str, batch: Any = None,
                advice: str = "") -> Iterator[None]:
    """While the block traces a step, errors in the user's step name this batch.

    Args:
        batch_name: which batch, for example 'validation batch 0 (sanity check)'.
        data_name: which data, for example 'the val_data passed to Fit.fit'.
        batch: the batch itself (host or abstract), whose leaves the message lists.
        advice: one more sentence for the message (for example how to skip a sanity check).
    """
    desc = describe_batch(batch) if batch is not None else ""
    token = _TRACING_FOR.set((f"{batch_name} of {data_name}", desc, advice))
    try:
        yield
    finally:
        _TRACING_FOR.reset(token)


def call_user_step(fn: Callable, where: str, *args: Any) -> Any:
    """`fn(*args)` (the user's step), its errors wrapped as `UserStepError` with the context.

    Args:
        fn: the bound user method, for example `module.validation_step`.
        where: its name for messages, for example 'Classifier.validation_step'.
        *args: what it is called with (model, batch).
    """
    try:
        # Host state the step changes, and what it reads from self: _guards' docstring.
        owner = getattr(getattr(fn, "func", fn), "__self__", None)  # a bound step, or a partial
        with _guards.watch(owner, where, fn):
            return fn(*args)
    except JaxlightError:
        raise  # jaxlight's own errors already say what to do
    except Exception as err:  # noqa: BLE001 - re-raised with context, original as __cause__
        porting = traced_on_host(err, where)
        if porting is not None:
            raise porting from err
        context = _TRACING_FOR.get()
        on, advice = "", ""
        if context is not None:
            batch, desc, advice = context
            on = f" on {batch}" + (f", a batch {desc}" if desc else "")
        raise UserStepError(
            f"{where} raised {type(err).__name__}: {err} while jaxlight traced it{on}. The "
            "original error and its traceback are shown above this one: fix the step, or the "
            "data if it lacks what the step reads." + (f" {advice}" if advice else "")
        ) from err


def _traceback_location(err: BaseException) -> str | None:
    for summary in reversed(traceback.extract_tb(err.__traceback__)):
        if is_user_file(summary.filename):
            return _guards.location(summary.filename, summary.lineno)
    return None


_HOST_READS = (jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError,
               jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError)


def traced_on_host(err: BaseException, where: str) -> PortingError | None:
    """The jaxlight message for a traced value used as a Python value (None for other errors)."""
    if not isinstance(err, _HOST_READS):
        return None
    at = _traceback_location(err)
    at = f" at {at}" if at else ""
    if isinstance(err, jax.errors.TracerBoolConversionError):
        what = (f"{where} branches with Python on a traced value{at}: the step is traced once "
                "and compiled, so a Python `if`, `while`, `and`/`or` or `assert` cannot see each "
                "step's value. Compute both sides and choose with jnp.where(cond, a, b) (for "
                "example loss = jnp.where(loss > 1, loss / 2, loss)), or run one side with "
                "jax.lax.cond(cond, true_fn, false_fn, *operands); loops over traced counts are "
                "jax.lax.while_loop / fori_loop")
    else:
        what = (f"{where} turns a traced value into a host value{at} (int(x), float(x), "
                "x.item(), np.asarray(x), or a host function given it): the step is traced "
                "once and compiled, so there is no per-step value to read there. Keep the "
                "computation in jax.numpy inside the step; host work that needs the model's "
                "output (an environment step, a replay buffer) belongs in a hook "
                "(on_train_batch_start, where self.model(x) runs the current model) or in the "
                "data, not in the step (docs/rl.md)")
    return PortingError(f"{what}. JAX's error: {type(err).__name__}. See {_guards.GUIDE}.")
