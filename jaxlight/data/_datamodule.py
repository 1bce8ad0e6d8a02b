"""DataModule: Lightning's LightningDataModule — preparation, splits and every stage's loaders.

A `DataModule` gathers what a stage needs to read its data: `prepare_data()` (download or
write files; process 0 only), `setup(stage)` (build the splits, on every process), one loader
per stage (`train_dataloader`, `val_dataloader`, `test_dataloader`, `predict_dataloader`),
`teardown(stage)`, and `state_dict` / `load_state_dict` for its own state, which checkpoints
keep so that a resumed fit continues exactly (the loaders' positions are saved on their own,
see jaxlight/data/_feed.py). `Fit.fit(module, datamodule=dm)` and `Fit.test(module,
datamodule=dm)` call them in Lightning's order (`jaxlight._fit._data_source`).
"""

from __future__ import annotations

import json
from typing import Any

from jaxlight._errors import CheckpointError, ConfigurationError
from jaxlight.hparams._hparams import HyperparametersMixin

__all__ = ["LOADERS", "META_KEY", "DataModule", "datamodule_state", "defines"]

#: The loader each stage reads, as Lightning names them.
LOADERS = {"fit": "train_dataloader", "validate": "val_dataloader", "test": "test_dataloader",
           "predict": "predict_dataloader"}
#: The key of a checkpoint's meta record holding the DataModule's `state_dict()`.
META_KEY = "datamodule"


def defines(datamodule: Any, name: str) -> bool:
    """Whether `datamodule`'s class (or the instance) overrides `DataModule.name`."""
    if name in vars(datamodule):
        return True
    for cls in type(datamodule).__mro__:
        if cls is DataModule or cls is object:
            return False
        if name in vars(cls):
            return True
    return False


class DataModule(HyperparametersMixin):
    """Data for every stage in one object, with Lightning's method names; override what you use.

    `Fit` calls `prepare_data()` once, on process 0 (the other processes wait for it), then
    `setup(stage)` on every process, before the callbacks' and the module's `setup` hooks; then
    the stage's loader methods (fit: `val_dataloader` if defined, then `train_dataloader`);
    `teardown(stage)` at the end, before the callbacks' and the module's. A fit without
    `val_dataloader` trains without validation. Loaders are what `Fit` takes directly: any
    iterable of NumPy batches, `jaxlight.data.ArrayLoader` (resumable), grain loaders.

    Constructor arguments are recorded in `hparams`, as on a `TrainModule`
    (`save_hyperparameters()` narrows them).

    Example:
        >>> import numpy as np
        >>> import jaxlight as jl
        >>> class Squares(jl.DataModule):
        ...     def __init__(self, batch_size=4):
        ...         super().__init__()
        ...         self.batch_size = batch_size
        ...     def setup(self, stage):
        ...         x = np.arange(12, dtype=np.float32)[:, None]
        ...         self.train, self.val = {"x": x[:8]}, {"x": x[8:]}
        ...     def train_dataloader(self):
        ...         return jl.data.ArrayLoader(self.train, self.batch_size)
        ...     def val_dataloader(self):
        ...         return jl.data.ArrayLoader(self.val, self.batch_size, shuffle=False)
        >>> dm = Squares(batch_size=2)
        >>> dm.hparams
        {'batch_size': 2}
        >>> dm.setup("fit"); [b["x"].ravel().tolist() for b in dm.val_dataloader()]
        [[8.0, 9.0], [10.0, 11.0]]
    """

    def __init__(self):
        pass

    # -- lifecycle ---------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Downloads or writes what `setup` reads; runs once, on process 0. Do not assign
        state here: the other processes never run it."""

    def setup(self, stage: str) -> None:
        """Builds the splits `stage` ("fit", "validate", "test" or "predict") reads; runs on
        every process."""

    def teardown(self, stage: str) -> None:
        """Releases what `setup(stage)` made; runs when the stage ends, also after an error."""

    # -- loaders -----------------------------------------------------------------------------

    def train_dataloader(self) -> Any:
        """The training data of `Fit.fit`: an iterable of batches."""
        raise _missing(self, "train_dataloader")

    def val_dataloader(self) -> Any:
        """The validation data of `Fit.fit` (optional there) and `Fit.validate`."""
        raise _missing(self, "val_dataloader")

    def test_dataloader(self) -> Any:
        """The data of `Fit.test`."""
        raise _missing(self, "test_dataloader")

    def predict_dataloader(self) -> Any:
        """The data of `Fit.predict`."""
        raise _missing(self, "predict_dataloader")

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This DataModule's own state, saved in every checkpoint of a fit (a JSON-able dict:
        numbers, strings, lists, dicts). The loaders' positions are saved separately."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what `state_dict` returned, when a fit resumes from a checkpoint (after
        `setup("fit")`, before the loaders are asked for)."""


def _missing(datamodule: DataModule, name: str) -> ConfigurationError:
    stage = next(s for s, n in LOADERS.items() if n == name)
    cls = type(datamodule).__name__
    return ConfigurationError(
        f"{cls} does not define {name}, which Fit.{stage} reads its data from: define "
        f"{cls}.{name}(self) returning an iterable of batches (e.g. jaxlight.data.ArrayLoader), "
        f"or pass the data to Fit.{stage} directly."
    )


def datamodule_state(datamodule: DataModule | None) -> dict | None:
    """The DataModule's `state_dict()` for a checkpoint, checked to survive JSON unchanged."""
    if datamodule is None:
        return None
    state = datamodule.state_dict()
    name = f"{type(datamodule).__name__}.state_dict()"
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{name} returned {type(state).__name__}; it must return a dict (JSON-able "
            "values), which checkpoints keep for load_state_dict on resume.")
    try:
        same = json.loads(json.dumps(state)) == state
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{name} returned a value JSON cannot hold ({exc}); checkpoints keep it as JSON: "
            "return numbers, strings, lists and dicts (e.g. array.tolist()).") from None
    if not same:
        raise CheckpointError(
            f"{name} returned {state!r}, which does not come back from JSON unchanged (tuples "
            "become lists, keys become strings); return lists and string keys, so that "
            "load_state_dict gets back what was saved.")
    return state
