"""`self.log` in the training batch hooks (`on_train_batch_start`, `on_train_batch_end`): host
values logged with that step's metrics at `log_every_n_steps`, as Lightning logs them, and the
warning for `self.trainer.log_metrics` there (which logs at once, apart from the step's)."""

from __future__ import annotations

import contextlib
import contextvars
import sys
import warnings
from collections.abc import Iterator
from typing import Any

from jaxlight._errors import ConfigurationError, JaxlightWarning, StepOutputError


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar, value: Any) -> Iterator[Any]:
    """Sets the context variable `var` to `value` inside the block."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


class HostLogs:
    """What `self.log` recorded in one training batch's hooks (`on_train_batch_start`,
    `on_train_batch_end`): host values, logged with that step's metrics at its log interval,
    as Lightning logs a hook's `self.log` (read on the host only when the step is logged).

    `with logs:` around a hook makes `self.log` there write to `logs` (a plain context manager:
    the loop enters one twice per step, so it costs a context variable's set and reset)."""

    __slots__ = ("values", "hidden", "_token")

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        #: The names logged with logger=False (callback_metrics only, as Lightning's).
        self.hidden: set[str] = set()
        self._token = None

    def __enter__(self) -> HostLogs:
        self._token = _HOST.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _HOST.reset(self._token)

    def add(self, name: str, value: Any, *, prog_bar: bool, on_step: bool | None,
            on_epoch: bool | None, batch_size: Any, reduce_fx: Any, logger: bool = True) -> None:
        # One value per step: nothing to weigh or reduce; it reaches the loggers and
        # callback_metrics (not the progress bar, whose fields the traced steps fix).
        del batch_size, reduce_fx, prog_bar
        where = f"self.log({name!r}, ...) in a training batch hook"
        if on_epoch or on_step is False:
            raise ConfigurationError(
                f"{where} sets on_step={on_step}, on_epoch={on_epoch}: a value logged from "
                "on_train_batch_start / on_train_batch_end is logged with its step's metrics "
                "(on_step). For an epoch's mean, log the value from training_step with "
                "on_epoch=True, or keep it on the host and send it from on_train_epoch_end "
                "with self.trainer.log_metrics({...})."
            )
        if callable(getattr(value, "merge", None)) or getattr(value, "shape", ()) != ():
            raise StepOutputError(f"{where}: log a scalar, got {type(value).__name__}.")
        if name in self.values:
            raise ConfigurationError(f"{where} logs {name!r} twice for one step; log it once.")
        self.values[name] = value
        if not logger:
            self.hidden.add(name)


#: Where `self.log` in a training batch hook writes (None outside those hooks).
_HOST: contextvars.ContextVar[HostLogs | None] = contextvars.ContextVar("jaxlight_host_logs",
                                                                        default=None)


def warn_direct_log(step: int) -> None:
    """`self.trainer.log_metrics(...)` from a module's training batch hook (a Lightning port's
    stand-in for `self.log`): it logs at once, at every call, apart from the step's metrics."""
    frame = sys._getframe(2)  # the caller of Fit.log_metrics
    hook, owner = frame.f_code.co_name, frame.f_locals.get("self")
    batch_hook = hook in ("on_train_batch_start", "on_train_batch_end")
    if _HOST.get() is None or not hasattr(owner, "training_step") or not batch_hook:
        return
    loss_step = step + 1 if hook == "on_train_batch_start" else step
    warnings.warn_explicit(
        f"{type(owner).__name__}.{hook} calls self.trainer.log_metrics, which logs at once, at "
        f"step {step}, at every step: apart from this step's metrics (its loss is logged at step "
        f"{loss_step}, every log_every_n_steps). To log with the step's metrics, as Lightning's "
        "self.log in this hook does, write self.log(name, value) (or self.log_dict).",
        JaxlightWarning, frame.f_code.co_filename, frame.f_lineno)


def batch_collector() -> HostLogs | None:
    """Where `self.log` writes in the training batch hooks running now (None outside them)."""
    return _HOST.get()
