"""Callbacks: host-side hooks with Lightning's names and step-transforming pieces.

May import `checkpoint`, `optim`, `schedules`, `sharding`, `analysis`, `distributed` and the root
modules (layer 17 of docs/architecture.md); the module and the fit sit above.

The callbacks are resolved on first use (PEP 562: `__getattr__` imports each from its module with
`importlib.import_module`, through the table `_PUBLIC`), so a fit loads the callbacks it uses and
not the loggers, finders and profilers it does not; `from jaxlight.callbacks import
WandbLogger` works as before.
"""

import importlib as _importlib

from jaxlight._errors import MissingAttributeError
from jaxlight.callbacks._lightning_names import NOT_IN_JAXLIGHT, missing

#: Public name -> the module defining it (imported on first use, PEP 562: `__getattr__`).
_PUBLIC = {
    "GradientAccumulation": "jaxlight.callbacks._accumulation",
    "GradientAccumulationScheduler": "jaxlight.callbacks._accumulation",
    "Microbatches": "jaxlight.callbacks._accumulation",
    "Callback": "jaxlight.callbacks._base",
    "LambdaCallback": "jaxlight.callbacks._base",
    "ModelCheckpoint": "jaxlight.callbacks._checkpoint",
    "GradientClipping": "jaxlight.callbacks._clipping",
    "CSVLogger": "jaxlight.callbacks._csv",
    "EarlyStopping": "jaxlight.callbacks._early_stopping",
    "BatchSizeFinder": "jaxlight.callbacks._batch_size_finder",
    "LearningRateFinder": "jaxlight.callbacks._lr_finder",
    "BackboneFinetuning": "jaxlight.callbacks._finetuning",
    "BaseFinetuning": "jaxlight.callbacks._finetuning",
    "LearningRateMonitor": "jaxlight.callbacks._lr_monitor",
    "MLFlowLogger": "jaxlight.callbacks._mlflow",
    "NonFiniteGuard": "jaxlight.callbacks._nonfinite",
    "NonFiniteState": "jaxlight.callbacks._nonfinite",
    "OnExceptionCheckpoint": "jaxlight.callbacks._on_exception",
    "MixedPrecision": "jaxlight.callbacks._precision",
    "BasePredictionWriter": "jaxlight.callbacks._prediction_writer",
    "Profiler": "jaxlight.callbacks._profiler",
    "TQDMProgressBar": "jaxlight.callbacks._progress",
    "RichModelSummary": "jaxlight.callbacks._rich",
    "RichProgressBar": "jaxlight.callbacks._rich",
    "RichProgressBarTheme": "jaxlight.callbacks._rich",
    "SpikeDetection": "jaxlight.callbacks._spike",
    "TrainingSpikeException": "jaxlight.callbacks._spike",
    "ModelSummary": "jaxlight.callbacks._summary",
    "StochasticWeightAveraging": "jaxlight.callbacks._swa",
    "TensorBoardLogger": "jaxlight.callbacks._tensorboard",
    "DeviceStatsMonitor": "jaxlight.callbacks._throughput",
    "ThroughputMonitor": "jaxlight.callbacks._throughput",
    "Timer": "jaxlight.callbacks._timer",
    "WandbLogger": "jaxlight.callbacks._wandb",
    "EMAWeightAveraging": "jaxlight.callbacks._weight_averaging",
    "WeightAveraging": "jaxlight.callbacks._weight_averaging",
}

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
    if name in _PUBLIC:
        value = getattr(_importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # the next access is a plain attribute
        return value
    # Lightning's names jaxlight lacks: say what to use instead (an AttributeError still).
    if name in NOT_IN_JAXLIGHT:
        raise missing(name)
    raise MissingAttributeError(f"module 'jaxlight.callbacks' has no attribute {name!r}")


def __dir__() -> list[str]:
    hidden = {"_PUBLIC", "_importlib", "__getattr__", "__dir__"}
    return sorted({*globals(), *__all__} - hidden)
