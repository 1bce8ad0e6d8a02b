"""jaxlight: a PyTorch-Lightning-style training framework for JAX and Flax NNX.

The public names (`jl.Fit`, `jl.TrainModule`, `jl.callbacks`, ...) are resolved on first use
(PEP 562: the module's `__getattr__` imports them with `importlib.import_module` from the table
`_PUBLIC` below), so `import jaxlight` alone imports no JAX and `jaxlight --help` starts at
once; `from jaxlight import Fit`, `import jaxlight.nn` and `jl.callbacks` work as before. This
is the one accepted form of a lazy jaxlight import (tests/test_architecture.py forbids
function-local `import jaxlight...` statements): a table of names, read by `__getattr__`.
"""

import importlib as _importlib

from jaxlight._errors import (
    CheckpointError,
    ConfigurationError,
    DataError,
    DistributedError,
    JaxlightError,
    JaxlightWarning,
    PortingError,
    ShardingError,
    StepOutputError,
    TrainingStopped,
    UserStepError,
)
from jaxlight._errors import MissingAttributeError as _MissingAttributeError
from jaxlight._version import __version__ as __version__

#: Public name -> the module defining it (imported on first use).
_PUBLIC = {
    "Fit": "jaxlight._fit",
    "StepOutput": "jaxlight._fit",
    "Tuner": "jaxlight.callbacks._finders",
    "load_checkpoint": "jaxlight.checkpoint._restore",
    "DataModule": "jaxlight.data._datamodule",
    "TrainModule": "jaxlight.module._module",
    "TrainState": "jaxlight.state._state",
}

#: The subpackages an attribute of `jaxlight` reaches (`jl.callbacks`, `jl.nn`, ...): the public
#: ones of `__all__` and those an eager `import jaxlight` used to leave as attributes.
_SUBPACKAGES = ("_fit", "analysis", "callbacks", "checkpoint", "data", "distributed", "hparams",
                "metrics", "module", "nn", "optim", "schedules", "sharding", "state", "step",
                "strategies")

__all__ = [
    "CheckpointError",
    "ConfigurationError",
    "DataError",
    "DataModule",
    "DistributedError",
    "Fit",
    "JaxlightError",
    "JaxlightWarning",
    "PortingError",
    "ShardingError",
    "StepOutput",
    "StepOutputError",
    "TrainModule",
    "TrainState",
    "TrainingStopped",
    "Tuner",
    "UserStepError",
    "callbacks",
    "data",
    "distributed",
    "load_checkpoint",
    "nn",
    "schedules",
    "strategies",
]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(_PUBLIC[name]), name)
    elif name in _SUBPACKAGES:
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise _MissingAttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain attribute
    return value


#: What `dir(jaxlight)` leaves out: this lazy machinery itself.
_HIDDEN = {"_HIDDEN", "_PUBLIC", "_SUBPACKAGES", "_importlib", "_MissingAttributeError",
           "__getattr__", "__dir__"}


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBPACKAGES} - _HIDDEN)
