"""Examples on disk as ArrayRecord files, read back as a grain data source (no in-memory array).

`write_records(path, arrays)` stores example i of a dict of arrays as one record (each field's
row, raw bytes, in a fixed layout written next to it as `<path>.json`); `RecordSource(path)` is a
grain random-access source returning example i as a dict of NumPy arrays viewing the record's
bytes. A grain pipeline (`grain.MapDataset.source(RecordSource(path))`, or `grain.DataLoader`)
then shuffles, shards per process, batches and reads in worker processes; each process reads
only the records of its share.

Example:
    >>> import numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "data.array_record")
    >>> write_records(path, {"x": np.arange(6.0).reshape(3, 2), "y": np.arange(3)})
    3
    >>> source = RecordSource(path)
    >>> len(source), source[1]["x"].tolist(), int(source[1]["y"])
    (3, [2.0, 3.0], 1)
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from jaxlight._errors import DataError

__all__ = ["RecordSource", "write_records"]


def _layout_path(path: str) -> str:
    return os.fspath(path) + ".json"


def write_records(path: str | os.PathLike, arrays: dict[str, Any]) -> int:
    """Writes example i of `arrays` (a dict of arrays sharing their first dimension) as record i.

    Returns the number of records written.
    """
    # array_record comes with grain; only needed by users who write records.
    from array_record.python.array_record_module import ArrayRecordWriter

    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    lengths = {k: v.shape[0] for k, v in arrays.items()}
    if not arrays or len(set(lengths.values())) != 1:
        raise DataError(f"write_records needs arrays sharing their first dimension; got {lengths}.")
    layout = [{"name": k, "dtype": v.dtype.str, "shape": list(v.shape[1:])}
              for k, v in arrays.items()]
    n = next(iter(lengths.values()))
    path = os.fspath(path)
    writer = ArrayRecordWriter(path, "group_size:1")  # one record per chunk: cheap random reads
    try:
        for i in range(n):
            writer.write(b"".join(v[i].tobytes() for v in arrays.values()))
    finally:
        writer.close()
    with open(_layout_path(path), "w") as f:
        json.dump({"records": n, "fields": layout}, f)
    return n


class RecordSource:
    """A grain random-access data source over `write_records` files: example i as a dict.

    Args:
        paths: one ArrayRecord file or a list of them (records are numbered across them).
    """

    def __init__(self, paths: str | os.PathLike | list):
        self.paths = [os.fspath(p) for p in (paths if isinstance(paths, list) else [paths])]
        layouts = []
        for p in self.paths:
            try:
                with open(_layout_path(p)) as f:
                    layouts.append(json.load(f))
            except FileNotFoundError:
                raise DataError(
                    f"{p} has no layout file {_layout_path(p)}: RecordSource reads files "
                    "written by jaxlight.data.write_records."
                ) from None
        fields = [la["fields"] for la in layouts]
        if any(f != fields[0] for f in fields):
            raise DataError(f"the record files {self.paths} have different layouts: {fields}.")
        self.fields = fields[0]
        self._num_records = sum(la["records"] for la in layouts)
        self._source = None  # opened lazily: grain pickles sources into its worker processes

    def __len__(self) -> int:
        return self._num_records

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_source": None}

    def _decode(self, record: bytes) -> dict[str, np.ndarray]:
        out, offset = {}, 0
        for field in self.fields:
            dtype, shape = np.dtype(field["dtype"]), tuple(field["shape"])
            count = int(np.prod(shape, dtype=np.int64))
            out[field["name"]] = np.frombuffer(record, dtype, count, offset).reshape(shape)
            offset += count * dtype.itemsize
        return out

    def _records(self):
        if self._source is None:
            import grain  # the reader of ArrayRecord files; only needed for record data

            self._source = grain.sources.ArrayRecordDataSource(self.paths)
        return self._source

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self._decode(self._records()[int(index)])

    def _getitems(self, indices) -> list[dict[str, np.ndarray]]:
        """Examples `indices` in one read of the files (grain's batched-read protocol)."""
        return [self._decode(r) for r in self._records().__getitems__([int(i) for i in indices])]

    def read_batch(self, indices) -> dict[str, np.ndarray]:
        """The examples `indices` stacked into one batch, read from disk in one call.

        Reading a batch's records together is ~40x faster than one call per record (measured:
        3,200 random 65-byte records, 1.75 s one by one, 0.05 s together), so a pipeline that
        batches indices and then reads (`MapDataset.range(n).shuffle(seed).batch(b)
        .map(source.read_batch)`) keeps up with a small model's steps where per-record reads
        would not.
        """
        examples = self._getitems(np.asarray(indices).reshape(-1).tolist())
        return {f["name"]: np.stack([e[f["name"]] for e in examples]) for f in self.fields}

    def __repr__(self) -> str:
        return f"RecordSource({self.paths!r}, records={self._num_records})"
