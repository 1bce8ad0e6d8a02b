"""The jaxlight version (one place: `jaxlight.__version__` and checkpoints' records read it)."""

__version__ = "0.1.0"
