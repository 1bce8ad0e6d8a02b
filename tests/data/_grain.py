"""Grain pipelines over records on disk for the data tests (also imported by `_grain_child.py`).

The source logs every record it reads (`<log>.<pid>`, one index per line) so that a test can
tell which records each process, and its grain worker processes, touched.
"""

from __future__ import annotations

import os

import grain
import numpy as np

import jaxlight as jl
from tests.models import classification_data

EXAMPLES = 96
GLOBAL_BATCH = 16  # 6 global batches per epoch
EPOCHS = 3


def write(path: str) -> None:
    data = classification_data(EXAMPLES)
    jl.data.write_records(path, {**data, "index": np.arange(EXAMPLES, dtype=np.int32)})


class LoggingSource(jl.data.RecordSource):
    """A RecordSource that appends each index it reads to `<log>.<pid>`."""

    def __init__(self, path: str, log: str | None):
        super().__init__(path)
        self.log = log

    def __getitem__(self, index):
        if self.log is not None:
            with open(f"{self.log}.{os.getpid()}", "a") as f:
                f.write(f"{int(index)}\n")
        return super().__getitem__(index)


def read_log(log: str) -> list[int]:
    folder, prefix = os.path.split(log)
    out = []
    for name in os.listdir(folder):
        if name.startswith(os.path.basename(prefix) + "."):
            with open(os.path.join(folder, name)) as f:
                out.extend(int(line) for line in f)
    return out


def pipeline(kind: str, path: str, log: str | None = None, workers: int = 1):
    """A shuffled, 3-epoch pipeline; each process gets its shard (grain's ShardByJaxProcess).

    kind "loader": grain.DataLoader with an IndexSampler and `workers` worker processes.
    kind "dataset": MapDataset sharded, reshuffled per epoch, batched, with mp_prefetch workers.
    """
    source = LoggingSource(path, log)
    shard = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    local = GLOBAL_BATCH // shard.shard_count
    if kind == "loader":
        sampler = grain.samplers.IndexSampler(len(source), shard_options=shard, shuffle=True,
                                              num_epochs=EPOCHS, seed=7)
        return grain.DataLoader(data_source=source, sampler=sampler, worker_count=workers,
                                operations=[grain.transforms.Batch(local, drop_remainder=True)])
    ds = grain.MapDataset.source(source)[shard.shard_index::shard.shard_count]
    ds = ds.shuffle(seed=7).repeat(EPOCHS).batch(local, drop_remainder=True)
    if workers:
        return ds.to_iter_dataset().mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    return ds
