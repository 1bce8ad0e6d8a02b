"""Grain pipelines: exact resume after SIGKILL (one process and two), each process its share.

Real subprocesses (a SIGKILL mid-run, then `ckpt_path="last"`), real grain worker processes,
records read from ArrayRecord files on disk.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

pytest.importorskip("grain")

from jaxlight.distributed._launch import child_env, free_port  # noqa: E402
from tests.checkpoint._proc import Child, kill_leftovers  # noqa: E402
from tests.data import _grain  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "data", "_grain_child.py")
STEPS = 14  # 6 batches per epoch: the run crosses two reshuffles


@pytest.fixture(autouse=True)
def _no_leftover_children():
    yield
    kill_leftovers()


@pytest.fixture
def records(tmp_path):
    path = str(tmp_path / "examples.array_record")
    _grain.write(path)
    return path


def _env(rank: int | None, nprocs: int, port: int) -> dict:
    env = dict(os.environ) if rank is None else child_env(rank, nprocs, port, devices_per_proc=4,
                                                          timeout=60)
    # grain's worker processes unpickle tests.data._grain's source: the repo must be importable.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    return env


def _job(cfg: dict, tmp_path, nprocs: int) -> list[Child]:
    if nprocs == 1:
        return [Child(cfg, str(tmp_path), env=_env(None, 1, 0), script=SCRIPT)]
    port = free_port()
    return [Child(cfg, str(tmp_path), env=_env(rank, nprocs, port), script=SCRIPT)
            for rank in range(nprocs)]


def _finish(children) -> None:
    codes = [c.finish(300) for c in children]
    assert codes == [0] * len(children), [c.stderr()[-4000:] for c in children]


def _load(out: str, rank: int):
    with np.load(f"{out}.{rank}.npz") as f:
        params = {k: f[k] for k in f.files}
    with open(f"{out}.{rank}.json") as f:
        seen = {int(k): v for k, v in json.load(f).items()}
    return params, seen


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def _kill_and_resume(kind: str, nprocs: int, tmp_path, records: str) -> None:
    base = {"kind": kind, "records": records, "max_steps": STEPS, "workers": 1}
    ckpt = str(tmp_path / "ckpt")
    # The uninterrupted reference and the run to kill, side by side.
    # With 2 processes the reference also logs the records each process reads (its share).
    shares_log = str(tmp_path / "ref_reads") if nprocs > 1 else None
    reference = _job({**base, "out": str(tmp_path / "ref"), "log": shares_log}, tmp_path, nprocs)
    # Periodic checkpoints at steps 3 and 6, then step 8's, committed before the kill: the
    # resume takes the last of several.
    killed = _job({**base, "dir": ckpt, "every": 3, "pause_at": 8, "out": str(tmp_path / "x")},
                  tmp_path, nprocs)
    for child in killed:
        child.wait_for("PAUSED", timeout=300)
    for child in killed:
        child.kill_group()
    assert [c.finish() for c in killed] == [-signal.SIGKILL] * nprocs
    _finish(reference)
    if shares_log:
        _assert_each_process_read_its_share(str(tmp_path / "ref"), shares_log, nprocs)
    log = str(tmp_path / "resumed_reads")
    resumed = _job({**base, "dir": ckpt, "ckpt_path": "last", "out": str(tmp_path / "resumed"),
                    "log": log}, tmp_path, nprocs)
    _finish(resumed)
    stream = _grain.EPOCHS * _grain.EXAMPLES // nprocs  # records in one process's whole stream
    local = _grain.GLOBAL_BATCH // nprocs
    for rank in range(nprocs):
        # Resumed from the iterator's saved state, not by reading and skipping 8 batches again.
        reads = _grain.read_log(f"{log}.rank{rank}")
        assert 0 < len(reads) <= stream - 8 * local, len(reads)
        want_params, want_seen = _load(str(tmp_path / "ref"), rank)
        got_params, got_seen = _load(str(tmp_path / "resumed"), rank)
        # The resumed run trained on exactly the records the uninterrupted one did after step 8.
        assert sorted(got_seen) == list(range(9, STEPS + 1))
        assert {s: want_seen[s] for s in got_seen} == got_seen
        _assert_bitwise(got_params, want_params)
    # Shuffled and multi-epoch for real: every epoch is a permutation, epochs differ.
    per_epoch = _grain.EXAMPLES // _grain.GLOBAL_BATCH
    order = [i for s in range(1, 2 * per_epoch + 1) for i in want_seen[s]]
    n = len(order) // 2
    assert sorted(order[:n]) == sorted(order[n:]) and order[:n] != order[n:]
    assert order[:n] != sorted(order[:n])


@pytest.mark.slow
def test_grain_dataloader_resumes_bitwise_after_sigkill(tmp_path, records):
    _kill_and_resume("loader", 1, tmp_path, records)


@pytest.mark.slow
def test_grain_dataset_resumes_bitwise_after_sigkill_in_two_processes(tmp_path, records):
    _kill_and_resume("dataset", 2, tmp_path, records)


def _assert_each_process_read_its_share(out: str, log: str, nprocs: int) -> None:
    """The records each process trained on in the first epoch (steps 1 ... 6) are its shard:
    disjoint, together every record; the process and its grain workers read no record outside
    it (over the whole run)."""
    shares = []
    for rank in range(nprocs):
        _, seen = _load(out, rank)
        shares.append({i for s in range(1, _grain.EXAMPLES // _grain.GLOBAL_BATCH + 1)
                       for i in seen[s]})
        # The process and its grain workers read records of its own shard only (one epoch
        # trains on the whole shard, so the records it trained on are the shard).
        reads = set(_grain.read_log(f"{log}.rank{rank}"))
        assert reads and reads <= shares[rank], (rank, sorted(reads - shares[rank]))
        assert len(shares[rank]) == _grain.EXAMPLES // nprocs
    assert shares[0].isdisjoint(shares[1])
    assert set().union(*shares) == set(range(_grain.EXAMPLES))


# The "dataset" pipeline's shares are checked by
# test_grain_dataset_resumes_bitwise_after_sigkill_in_two_processes on its uninterrupted
# 2-process run (the same job this test would start again).
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["loader"])
def test_each_process_reads_only_its_share(tmp_path, records, kind):
    log = str(tmp_path / "reads")
    steps = 6  # one epoch
    jobs = _job({"kind": kind, "records": records, "max_steps": steps, "workers": 1,
                 "out": str(tmp_path / "run"), "log": log}, tmp_path, 2)
    _finish(jobs)
    _assert_each_process_read_its_share(str(tmp_path / "run"), log, 2)
