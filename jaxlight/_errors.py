"""Errors a user can hit. Every message says what was wrong, with the numbers, and what to do."""

from __future__ import annotations

import difflib
import os
import sys


class JaxlightError(Exception):
    """Base class of every error jaxlight raises on purpose."""


class JaxlightWarning(UserWarning):
    """Base class of every warning jaxlight gives on purpose (filter them by this class)."""


class ConfigurationError(JaxlightError, ValueError):
    """An argument or combination of arguments that cannot work (found before compiling)."""


class ConfigurationTypeError(ConfigurationError, TypeError):
    """An argument of the wrong kind (so `except TypeError` also catches it)."""


class DataError(JaxlightError, ValueError):
    """A batch or iterable that does not fit what the step was built for."""


class DataTypeError(DataError, TypeError):
    """A batch whose dtype the model cannot take (so `except TypeError` also catches it)."""


class ShardingError(JaxlightError, ValueError):
    """A mesh, rule or parameter shape that cannot be laid out over the devices."""


class StepOutputError(JaxlightError, TypeError):
    """A user step function that returned something jaxlight cannot use."""


class UserStepError(JaxlightError, RuntimeError):
    """A user step function (`training_step`, `validation_step`, ...) raised while it was traced;
    the message names the step, the data and the batch, and `__cause__` is the original error."""


class CheckpointError(JaxlightError, ValueError):
    """A checkpoint that cannot be found, read or matched to the module."""


class DistributedError(JaxlightError, RuntimeError):
    """Processes of a multi-process job that could not connect, disagree, or lost a peer."""


class PortingError(JaxlightError, TypeError):
    """Lightning code jaxlight cannot run as written; the message names the jaxlight form."""


class MissingDependency(JaxlightError, ModuleNotFoundError):
    """An optional package a feature needs is not installed; the message names the extra."""


class MissingMethodError(JaxlightError, NotImplementedError):
    """A method jaxlight needs (a `TrainModule`'s `configure_model`, `training_step`, ...) that
    the subclass does not implement; the message names its signature."""


class MissingAttributeError(JaxlightError, AttributeError):
    """An attribute that is not there yet or at all (`module.model` before a fit, an unknown
    hyperparameter); `hasattr` and `getattr(..., default)` keep working."""


class NotSetUpError(JaxlightError, RuntimeError):
    """An object used before the step that prepares it (a strategy's layout before `setup`)."""


class TrainingStopped(JaxlightError, RuntimeError):
    """Training was stopped by a guard (for example too many non-finite steps in a row)."""


class TrainingSpikeException(TrainingStopped):
    """`callbacks.SpikeDetection` found a loss spike (Lightning's name); `batch_idx` is the
    spiking batch's index in its epoch."""

    def __init__(self, batch_idx: int, message: str = ""):
        self.batch_idx = batch_idx
        super().__init__(message or f"Training spike detected in batch {batch_idx}")


def suggest(name: str, options) -> str:
    """Returns ' Did you mean X?' for the closest option, or ''."""
    match = difflib.get_close_matches(str(name), [str(o) for o in options], n=1)
    return f" Did you mean {match[0]!r}?" if match else ""


_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_STDLIB = os.path.dirname(os.__file__)


def is_user_file(filename: str) -> bool:
    """Whether `filename` is the user's code: not jaxlight's (its recipes are user code), not
    an installed library's, not the standard library's."""
    path = os.path.abspath(filename)
    if path.startswith(os.path.join(_PACKAGE, "recipes") + os.sep):
        return True
    if path.startswith(_PACKAGE + os.sep) or f"{os.sep}site-packages{os.sep}" in path:
        return False
    return not path.startswith(_STDLIB + os.sep)


def user_frame() -> tuple[str, int] | None:
    """`(filename, line)` of the innermost frame of the user's code now running, for messages
    that name the line (None when no user code is on the stack)."""
    frame = sys._getframe(1)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None
