"""Training data: the in-memory `ArrayLoader`, `DataModule`, and what `Fit` accepts besides.

`Fit` takes any iterable of batches (pytrees of NumPy arrays holding the global batch on one
process, this process's share on many), or a `DataModule` that builds them per stage; grain
`DataLoader`s and datasets, whose iterator state goes into checkpoints; and loaders yielding
torch tensors, converted without copies. `DataLoader` is `ArrayLoader` with torch's defaults
(no shuffling, the last partial batch kept). The loop reads through `TrainFeed` (positions for exact
resume) and `Prefetcher` (batches on the devices ahead of the step). See docs/data.md.

May import `hparams`, `distributed` and the root modules (layer 15 of docs/architecture.md).
"""

from jaxlight.data._array import ArrayLoader
from jaxlight.data._convert import to_numpy
from jaxlight.data._dataloader import DataLoader
from jaxlight.data._datamodule import DataModule
from jaxlight.data._records import RecordSource, write_records

__all__ = ["ArrayLoader", "DataLoader", "DataModule", "RecordSource", "to_numpy", "write_records"]
