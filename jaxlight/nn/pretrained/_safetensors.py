"""Reading slices of, and writing, `*.safetensors` files (Hugging Face's weight format).

The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to
`{"dtype", "shape", "data_offsets"}`, then the raw row-major bytes. It is read here directly
(`os.pread` of exactly the rows a slice needs) rather than through the `safetensors` package:
its NumPy API cannot return bfloat16 (`TypeError: data type 'bfloat16' not understood`), and a
memory map would count every page of the file in the process's resident memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from jaxlight._errors import CheckpointError

#: safetensors dtype names and their NumPy dtypes.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class TensorInfo:
    """Where one tensor lives in a file: its dtype, shape and byte range."""

    __slots__ = ("dtype", "file", "name", "shape", "start")

    def __init__(self, file: str, name: str, dtype: np.dtype, shape: tuple[int, ...],
                 start: int):
        self.file, self.name, self.dtype, self.shape, self.start = file, name, dtype, shape, start


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one file (name -> `TensorInfo`) and its `__metadata__`."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: not a safetensors file (shorter than 8 bytes).")
            (size,) = struct.unpack("<Q", raw)
            if size > 100 * 2**20:
                raise CheckpointError(f"{path}: not a safetensors file (header of {size} bytes).")
            header = json.loads(f.read(size))
    except (OSError, ValueError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"{path}: cannot read a safetensors header: {err}.") from None
    base = 8 + size
    metadata = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, entry in header.items():
        dtype = DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {entry.get('dtype')!r}, which jaxlight does "
                f"not read; readable dtypes: {sorted(DTYPES)}.")
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = entry["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} of shape {shape} and dtype {entry['dtype']} needs "
                f"{math.prod(shape) * dtype.itemsize} bytes but its header gives {end - begin}; "
                "the file is damaged.")
        tensors[name] = TensorInfo(path, name, dtype, shape, base + int(begin))
    return tensors, metadata


def read_slice(info: TensorInfo, index: tuple[slice, ...], fd: int | None = None) -> np.ndarray:
    """`tensor[index]` (one slice per dimension, step 1) reading only the rows it needs."""
    shape = info.shape
    if not shape:
        return _pread(info, fd, info.start, info.dtype.itemsize).view(info.dtype).reshape(())
    first = index[0] if index else slice(None)
    r0, r1, _ = first.indices(shape[0])
    row = math.prod(shape[1:]) * info.dtype.itemsize
    data = _pread(info, fd, info.start + r0 * row, (r1 - r0) * row)
    block = data.view(info.dtype).reshape((r1 - r0, *shape[1:]))
    rest = tuple(index[1:])
    return np.ascontiguousarray(block[(slice(None), *rest)]) if rest else block


def _pread(info: TensorInfo, fd: int | None, offset: int, size: int) -> np.ndarray:
    own = fd is None
    if own:
        fd = os.open(info.file, os.O_RDONLY)
    try:
        out = np.empty(size, np.uint8)
        view = memoryview(out)
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(
                    f"{info.file}: tensor {info.name!r} ends early (wanted {size} bytes at "
                    f"offset {offset}); the file is truncated.")
            done += n
        return out
    finally:
        if own:
            os.close(fd)


def write_file(path: str, tensors: Iterable[tuple[str, np.ndarray]],
               metadata: Mapping[str, str] | None = None) -> None:
    """Writes `(name, array)` pairs (consumed one at a time) as one safetensors file.

    The header needs every shape first, so the pairs are given as a list or a re-iterable of
    arrays that are already in host memory; `write_lazy` writes from callables instead.
    """
    items = list(tensors)
    write_lazy(path, [(n, a.shape, a.dtype, (lambda a=a: a)) for n, a in items], metadata)


def write_lazy(path: str, entries: list[tuple[str, tuple[int, ...], Any, Any]],
               metadata: Mapping[str, str] | None = None) -> None:
    """Writes tensors given as `(name, shape, dtype, fetch)`: `fetch()` returns the array when
    its bytes are written, so only one tensor is in host memory at a time."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, shape, dtype, _ in entries:
        dtype = np.dtype(dtype)
        if dtype not in _NAMES:
            raise CheckpointError(f"cannot write tensor {name!r} of dtype {dtype} as safetensors; "
                                  f"writable dtypes: {sorted(str(d) for d in _NAMES)}.")
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data 8-byte aligned, as the reference writer has it
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape, dtype, fetch in entries:
            array = np.ascontiguousarray(np.asarray(fetch(), dtype=np.dtype(dtype)))
            if tuple(array.shape) != tuple(shape):
                raise CheckpointError(f"tensor {name!r}: expected shape {tuple(shape)} while "
                                      f"writing, got {array.shape}.")
            f.write(array.tobytes())
    os.replace(tmp, path)


def checkpoint_tensors(path: str) -> dict[str, TensorInfo]:
    """name -> `TensorInfo` over every safetensors file of a model directory (sharded or not)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        present = sorted(os.listdir(path))
        hint = (" It holds PyTorch .bin weights: convert them once with transformers "
                "(model.save_pretrained(dir, safe_serialization=True))."
                if any(n.endswith(".bin") for n in present) else "")
        raise CheckpointError(f"{path}: no *.safetensors weights (files: {present[:12]}).{hint}")
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{index} names {name}, which is missing from {path}.")
        found, _ = read_header(file)
        tensors.update(found)
    return tensors
