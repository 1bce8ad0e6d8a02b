"""Reads an offline W&B run back from its `.wandb` file (test helper; no network).

wandb 0.31 no longer ships a Python reader for its transaction log, so this follows the format
its Go core writes: a 7-byte header (":W&B", magic 0xBEE1, version 0) and then LevelDB log
records (https://github.com/google/leveldb/blob/main/doc/log_format.md) in 32 KiB blocks, each
record a serialized `wandb.proto.wandb_internal_pb2.Record`, checked with its CRC-32.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time
import zlib

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: str):
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):  # zero padding up to the block end
            pos += left
            continue
        payload = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, pos
        pos += HEADER + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""


def _key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


class Run:
    """The parts of a run the tests check: config, history rows, summary, artifacts."""

    def __init__(self, path: str):
        from wandb.proto import wandb_internal_pb2

        self.path = path
        self.config: dict = {}
        self.history: list[dict] = []
        self.summary: dict = {}
        self.artifacts: list = []
        self.run = None
        self.exited = False
        for payload in raw_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self._config(record.run.config)
            elif kind == "config":
                self._config(record.config)
            elif kind == "history":
                self.history.append({_key(i): json.loads(i.value_json)
                                     for i in record.history.item})
            elif kind == "summary":
                for item in record.summary.update:
                    self.summary[_key(item)] = json.loads(item.value_json)
            elif kind == "artifact":
                self.artifacts.append(record.artifact)
            elif kind == "exit":
                self.exited = True

    def _config(self, config) -> None:
        for item in config.update:
            self.config[_key(item)] = json.loads(item.value_json)

    def rows(self) -> dict[int, dict]:
        """History by step, wandb's bookkeeping keys (_step, _runtime, ...) dropped."""
        return {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")}
                for row in self.history}


def read_run(path: str, timeout: float = 60.0) -> Run:
    """The run at `path` once its `exit` record is on disk.

    `run.finish()` returns when wandb's service has the run's last records, and the service
    writes them to the file a moment later; reading at once can see a partial log.
    """
    deadline = time.monotonic() + timeout
    while True:
        run = Run(path)
        if run.exited or time.monotonic() > deadline:
            return run
        time.sleep(0.05)


def find_runs(root: str) -> list[str]:
    """The `.wandb` files of the runs under `<root>/wandb` (not the `latest-run` link)."""
    paths = glob.glob(os.path.join(root, "wandb", "*run-*", "run-*.wandb"))
    return sorted(p for p in paths if not os.path.islink(os.path.dirname(p)))
