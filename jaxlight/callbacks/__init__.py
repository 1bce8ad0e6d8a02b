"""Callbacks: host-side hooks with Lightning's names and step-transforming pieces."""

from jaxlight.callbacks._base import Callback, LambdaCallback
from jaxlight.callbacks._csv import CSVLogger
from jaxlight.callbacks._progress import TQDMProgressBar
from jaxlight.callbacks._summary import ModelSummary

__all__ = ["CSVLogger", "Callback", "LambdaCallback", "ModelSummary", "TQDMProgressBar"]
