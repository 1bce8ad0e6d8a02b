"""jaxlight: a PyTorch-Lightning-style training framework for JAX and Flax NNX."""

from jaxlight import callbacks, data, distributed, nn, schedules, strategies
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
from jaxlight._fit import Fit, StepOutput
from jaxlight._version import __version__ as __version__
from jaxlight.callbacks._finders import Tuner
from jaxlight.checkpoint._restore import load_checkpoint
from jaxlight.data._datamodule import DataModule
from jaxlight.module._module import TrainModule
from jaxlight.state._state import TrainState

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
