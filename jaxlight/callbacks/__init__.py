"""Callbacks: host-side hooks with Lightning's names and step-transforming pieces.

May import `checkpoint`, `optim`, `schedules`, `sharding`, `analysis`, `distributed` and the root
modules (layer 17 of docs/architecture.md); the module and the fit sit above.
"""

from jaxlight._errors import MissingAttributeError
from jaxlight.callbacks._accumulation import (
    GradientAccumulation,
    GradientAccumulationScheduler,
    Microbatches,
)
from jaxlight.callbacks._base import Callback, LambdaCallback
from jaxlight.callbacks._batch_size_finder import BatchSizeFinder
from jaxlight.callbacks._checkpoint import ModelCheckpoint
from jaxlight.callbacks._clipping import GradientClipping
from jaxlight.callbacks._csv import CSVLogger
from jaxlight.callbacks._early_stopping import EarlyStopping
from jaxlight.callbacks._finetuning import BackboneFinetuning, BaseFinetuning
from jaxlight.callbacks._lightning_names import NOT_IN_JAXLIGHT, missing
from jaxlight.callbacks._lr_finder import LearningRateFinder
from jaxlight.callbacks._lr_monitor import LearningRateMonitor
from jaxlight.callbacks._mlflow import MLFlowLogger
from jaxlight.callbacks._nonfinite import NonFiniteGuard, NonFiniteState
from jaxlight.callbacks._on_exception import OnExceptionCheckpoint
from jaxlight.callbacks._precision import MixedPrecision
from jaxlight.callbacks._prediction_writer import BasePredictionWriter
from jaxlight.callbacks._profiler import Profiler
from jaxlight.callbacks._progress import TQDMProgressBar
from jaxlight.callbacks._rich import RichModelSummary, RichProgressBar, RichProgressBarTheme
from jaxlight.callbacks._spike import SpikeDetection, TrainingSpikeException
from jaxlight.callbacks._summary import ModelSummary
from jaxlight.callbacks._swa import StochasticWeightAveraging
from jaxlight.callbacks._tensorboard import TensorBoardLogger
from jaxlight.callbacks._throughput import DeviceStatsMonitor, ThroughputMonitor
from jaxlight.callbacks._timer import Timer
from jaxlight.callbacks._wandb import WandbLogger
from jaxlight.callbacks._weight_averaging import EMAWeightAveraging, WeightAveraging

__all__ = [
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "BatchSizeFinder",
    "CSVLogger",
    "Callback",
    "DeviceStatsMonitor",
    "EMAWeightAveraging",
    "EarlyStopping",
    "GradientAccumulation",
    "GradientAccumulationScheduler",
    "Microbatches",
    "GradientClipping",
    "LambdaCallback",
    "LearningRateFinder",
    "LearningRateMonitor",
    "MLFlowLogger",
    "MixedPrecision",
    "ModelCheckpoint",
    "ModelSummary",
    "NonFiniteGuard",
    "NonFiniteState",
    "OnExceptionCheckpoint",
    "Profiler",
    "RichModelSummary",
    "RichProgressBar",
    "RichProgressBarTheme",
    "SpikeDetection",
    "StochasticWeightAveraging",
    "TQDMProgressBar",
    "TensorBoardLogger",
    "ThroughputMonitor",
    "Timer",
    "TrainingSpikeException",
    "WandbLogger",
    "WeightAveraging",
]


def __getattr__(name: str):
    # Lightning's names jaxlight lacks: say what to use instead (an AttributeError still).
    if name in NOT_IN_JAXLIGHT:
        raise missing(name)
    raise MissingAttributeError(f"module 'jaxlight.callbacks' has no attribute {name!r}")
