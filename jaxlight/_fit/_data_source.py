"""Where a stage's data comes from: the loaders given to `Fit`, or a `DataModule`'s hooks.

`DataSource.resolve` checks the arguments of `Fit.fit` / `validate` / `test` / `predict` before
anything runs (data and `datamodule=` both, neither, the wrong type, a loader method the stage
needs but the DataModule lacks, Lightning's keyword names). The stage then calls, in Lightning's
order: `prepare(stage)` (the DataModule's `prepare_data` on process 0, then `setup(stage)`;
before the callbacks' and the module's `setup`), `restore(meta)` on resume (its
`load_state_dict`), `loaders()` (fit: `val_dataloader` then `train_dataloader`) and
`teardown(stage)` (before the callbacks' and the module's `teardown`).
"""

from __future__ import annotations

from typing import Any

from jaxlight import distributed as _distributed
from jaxlight._errors import ConfigurationError
from jaxlight.data._datamodule import LOADERS, META_KEY, DataModule, defines
from jaxlight.module._porting import GUIDE, unknown_keywords

#: Lightning's keyword names for the data arguments, and jaxlight's for each stage.
LIGHTNING_KEYWORDS = {"train_dataloaders": "train_data", "val_dataloaders": "val_data",
                      "dataloaders": "data"}


def refuse_keywords(stage: str, unknown: dict[str, Any], valid: list[str]) -> None:
    """Refuses keyword arguments a stage does not take: Lightning's with jaxlight's name."""
    for name in unknown:
        if name in LIGHTNING_KEYWORDS:
            ours = "train_data" if stage == "fit" and name == "dataloaders" else \
                LIGHTNING_KEYWORDS[name]
            raise ConfigurationError(
                f"Fit.{stage}({name}=...) is Lightning's keyword; jaxlight's is {ours}= "
                f"(Fit.{stage}({', '.join(valid)})), or datamodule=dm for a jaxlight.DataModule. "
                f"See {GUIDE}."
            )
    raise unknown_keywords(f"Fit.{stage}", unknown, valid)


def _describe(value: Any) -> str:
    return value.__name__ if isinstance(value, type) else type(value).__name__


def _datamodule_like(value: Any) -> bool:
    """A DataModule or its class, or Lightning's LightningDataModule (instance or class)."""
    cls = value if isinstance(value, type) else type(value)
    return any(c is DataModule or c.__name__ == "LightningDataModule" for c in cls.__mro__)


def _check_type(stage: str, datamodule: Any) -> None:
    if isinstance(datamodule, DataModule):
        return
    name = _describe(datamodule)
    if isinstance(datamodule, type) and issubclass(datamodule, DataModule):
        fix = f"it is the class; pass an instance: datamodule={name}(...)"
    elif _datamodule_like(datamodule):
        fix = ("it is Lightning's LightningDataModule; subclass jaxlight.DataModule instead "
               "(the same methods: prepare_data, setup, *_dataloader, state_dict), with loaders "
               "of NumPy batches such as jaxlight.data.ArrayLoader")
    else:
        fix = (f"pass a jaxlight.DataModule, or give the data itself: "
               f"Fit.{stage}(module, {'train_data, val_data' if stage == 'fit' else 'data'})")
    raise ConfigurationError(
        f"Fit.{stage}(datamodule=...) takes a jaxlight.DataModule, got {name}: {fix}. "
        f"See {GUIDE}.")


class DataSource:
    """One stage's data: `given` (the loaders passed) or a `datamodule` (None: loaders)."""

    def __init__(self, stage: str, given: tuple, datamodule: DataModule | None,
                 module: Any = None):
        self.stage = stage
        self.given = given
        #: The DataModule the stage reads from (None: loaders were given).
        self.datamodule = datamodule
        #: The TrainModule whose own `*_dataloader` methods give the data (Lightning allows
        #: them on the LightningModule), or None.
        self.module = module

    @classmethod
    def resolve(cls, stage: str, data: Any, datamodule: Any, val_data: Any = None,
                module: Any = None) -> DataSource:
        """Checks `Fit.<stage>`'s data arguments; `data` is `train_data` for fit. Without data
        and DataModule, `module`'s own `train_dataloader` (etc.) gives it, as in Lightning."""
        first = "train_data" if stage == "fit" else "data"
        form = (f"Fit.{stage}(module, {'train_data, val_data' if stage == 'fit' else 'data'}) "
                f"or Fit.{stage}(module, datamodule=dm)")
        if _datamodule_like(val_data):
            raise ConfigurationError(
                f"Fit.fit got a {_describe(val_data)} as val_data; a DataModule gives both "
                f"splits: Fit.fit(module, datamodule=dm). See {GUIDE}.")
        if _datamodule_like(data):  # Lightning accepts it in the loaders' place
            if datamodule is not None or val_data is not None:
                given = "datamodule" if datamodule is not None else "val_data"
                raise ConfigurationError(
                    f"Fit.{stage} got a DataModule as {first} and {given} as well; pass the "
                    f"DataModule alone: Fit.{stage}(module, datamodule=dm). See {GUIDE}.")
            data, datamodule = None, data
        if datamodule is None:
            if data is None and module is not None and callable(
                    getattr(module, LOADERS[stage], None)):
                return cls(stage, (None, val_data) if stage == "fit" else (None,), None, module)
            if data is None:
                raise ConfigurationError(
                    f"Fit.{stage} got no data: call {form}, or define "
                    f"{LOADERS[stage]}(self) on the module.")
            return cls(stage, (data, val_data) if stage == "fit" else (data,), None)
        if data is not None or val_data is not None:
            passed = [n for n, v in ((first, data), ("val_data", val_data)) if v is not None]
            raise ConfigurationError(
                f"Fit.{stage} got both {' and '.join(passed)} and datamodule=; the DataModule's "
                f"{LOADERS[stage]} gives the data: pass one, {form}. See {GUIDE}.")
        _check_type(stage, datamodule)
        if not defines(datamodule, LOADERS[stage]):
            cls_name = type(datamodule).__name__
            raise ConfigurationError(
                f"{cls_name} does not define {LOADERS[stage]}, which Fit.{stage}(datamodule=...) "
                f"reads its data from: define {cls_name}.{LOADERS[stage]}(self) returning an "
                f"iterable of batches (e.g. jaxlight.data.ArrayLoader). See {GUIDE}.")
        return cls(stage, (), datamodule)

    # -- the stage's calls, in order ---------------------------------------------------------

    def prepare(self) -> None:
        """`prepare_data()` on process 0 (the others wait), then `setup(stage)` everywhere."""
        dm = self.datamodule
        if dm is None:
            return
        if _distributed.process_index() == 0:
            dm.prepare_data()
        _distributed.all_gather_json("datamodule_prepare_data", None)  # a barrier
        dm.setup(self.stage)

    def restore(self, meta: dict | None) -> None:
        """Gives the DataModule its state from a checkpoint's meta record (if it saved one)."""
        if self.datamodule is not None and meta is not None and META_KEY in meta:
            self.datamodule.load_state_dict(meta[META_KEY])

    def loaders(self, val_first: bool = False) -> tuple:
        """fit: `(train, val)` (val None without `val_dataloader`); other stages: `(data,)`.

        A DataModule's loaders are asked for in Lightning's order: `train_dataloader` first,
        unless a sanity check will run (`val_first`), which asks `val_dataloader` before."""
        dm = self.datamodule
        if self.module is not None:  # the module's own loaders (after its setup, as Lightning)
            name = LOADERS[self.stage]
            first = self._checked(getattr(self.module, name)(), name, self.module)
            if self.stage != "fit":
                return (first,)
            val = self.given[1]
            if val is None and callable(getattr(self.module, "val_dataloader", None)):
                val = self.module.val_dataloader()
            return first, val
        if dm is None:
            return self.given
        if self.stage == "fit":
            def val():
                return dm.val_dataloader() if defines(dm, "val_dataloader") else None

            first = val() if val_first else None
            train = self._checked(dm.train_dataloader(), "train_dataloader")
            return train, (first if val_first else val())
        name = LOADERS[self.stage]
        return (self._checked(getattr(dm, name)(), name),)

    def _checked(self, loader: Any, name: str, owner: Any = None) -> Any:
        if loader is None:
            owner = self.datamodule if owner is None else owner
            raise ConfigurationError(
                f"{type(owner).__name__}.{name}() returned None; return an iterable "
                "of batches (e.g. jaxlight.data.ArrayLoader). Was setup(stage) meant to build "
                "the split it reads?")
        return loader

    def teardown(self) -> None:
        if self.datamodule is not None:
            self.datamodule.teardown(self.stage)

