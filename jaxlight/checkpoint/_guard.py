"""What keeps a checkpoint directory safe: one writing run at a time, disk faults named.

- `DirectoryLock`: the lock file a writing run holds in its checkpoint directory (host, pid),
  so that a second launch into the same directory is refused before orbax touches it;
- `disk_fault`: why a save failed, in jaxlight's words (a full disk with the free bytes and the
  bytes a checkpoint needs, a read-only disk), instead of the OS's or tensorstore's text.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import warnings

from jaxlight import distributed as _distributed
from jaxlight._errors import CheckpointError, JaxlightWarning
from jaxlight.checkpoint._paths import complete_steps

# -- disk faults ------------------------------------------------------------------------------

#: Errors that mean "no room": a full disk, a quota, a file size limit (RLIMIT_FSIZE).
_NO_ROOM = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
            errno.EFBIG: "File too large"}
_READ_ONLY = {errno.EROFS: "Read-only file system", errno.EACCES: "Permission denied",
              errno.EPERM: "Operation not permitted"}


def _os_error(exc: BaseException) -> tuple[int | None, str]:
    """The OS error behind `exc` (its chain, or tensorstore's text): `(errno, its words)`."""
    seen: BaseException | None = exc
    while seen is not None:
        code = getattr(seen, "errno", None)
        if code in _NO_ROOM or code in _READ_ONLY:
            return code, _NO_ROOM.get(code) or _READ_ONLY[code]
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    for table in (_NO_ROOM, _READ_ONLY):
        for code, words in table.items():
            if words in text:
                return code, words
    return None, ""


def _size_on_disk(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # deleted meanwhile
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def disk_fault(exc: BaseException, dirpath: str, array_bytes: int) -> str:
    """Why a save failed, in jaxlight's words: a full disk names the free bytes and the bytes
    the save needs; a read-only one the directory; anything else the error's first line."""
    code, words = _os_error(exc)
    if code in _NO_ROOM:
        steps = complete_steps(dirpath)
        saved = _size_on_disk(os.path.join(dirpath, str(steps[-1]))) if steps else 0
        need = max(saved, array_bytes)
        basis = (f"step {steps[-1]} takes {saved:,} bytes on disk" if saved >= array_bytes
                 else "the train state's arrays")
        needs = f"a checkpoint needs about {need:,} bytes ({basis})"
        if code == errno.EFBIG:
            return (f"a file grew past this process's file size limit ({words}; ulimit -f): "
                    f"{needs}. Raise the limit, or save smaller checkpoints")
        try:
            stat = os.statvfs(dirpath)
            free = f"{stat.f_bavail * stat.f_frsize:,} bytes are free"
        except OSError:
            free = "the free space is unknown"
        return (f"the disk is full ({words}): {free} on the filesystem of {dirpath}, and "
                f"{needs}. Free space there, keep fewer checkpoints "
                "(ModelCheckpoint(save_top_k=...)), or save to a larger disk "
                "(ModelCheckpoint(dirpath=...))")
    if code in _READ_ONLY:
        return (f"{dirpath} cannot be written ({words}): the disk was made read-only or the "
                "directory's permissions changed. Make it writable, or save to another "
                "directory (ModelCheckpoint(dirpath=...))")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:500]}"


# -- one run per directory -----------------------------------------------------------------------

#: The lock file a writing run holds in its checkpoint directory (orbax ignores it: not a step).
LOCK_NAME = ".jaxlight-writer.lock"


class DirectoryLock:
    """An exclusive `flock` on `<dir>/.jaxlight-writer.lock`, naming the host and pid holding it.

    Two runs saving into one directory delete each other's unfinished saves, so the second is
    refused. The operating system releases the lock when its process dies, however it dies
    (SIGKILL, a lost node), so a stale lock file never blocks a resume: only a live holder
    does. With several processes, process 0 holds it for the job and tells the others.
    """

    def __init__(self, path: str, fd: int | None):
        self.path, self._fd = path, fd

    @classmethod
    def for_job(cls, dirpath: str) -> DirectoryLock:
        path = os.path.join(dirpath, LOCK_NAME)
        lock, refusal = cls(path, None), None
        if _distributed.process_index() == 0:
            try:
                lock = cls.acquire(path)
            except CheckpointError as exc:
                refusal = str(exc)
            except OSError as exc:  # the directory cannot be made or written
                refusal = (f"cannot open the checkpoint directory {dirpath}: "
                           f"{disk_fault(exc, dirpath, 0)}.")
        refusals = _distributed.all_gather_json("checkpoint_directory_lock", refusal)
        if refusals[0] is not None:
            raise CheckpointError(refusals[0])
        return lock

    @classmethod
    def acquire(cls, path: str) -> DirectoryLock:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for _ in range(10):
            # Held through a read-only descriptor: an open writable file would keep the disk
            # from being remounted read-only (the write below uses its own, closed at once).
            fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise CheckpointError(_in_use(os.path.dirname(path), path, holder)) from None
            except OSError as exc:
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                warnings.warn(  # a filesystem without locks: write on, unguarded
                    f"cannot lock the checkpoint directory {os.path.dirname(path)} ({exc}): a "
                    "second run started into it would not be refused.", JaxlightWarning,
                    stacklevel=4)
            try:  # a holder that was closing may have unlinked the file we opened: retry
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            with open(path, "w") as f:
                json.dump({"host": socket.gethostname(), "pid": os.getpid(),
                           "since": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
            return cls(path, fd)
        raise CheckpointError(f"cannot lock the checkpoint directory {os.path.dirname(path)}: "
                              f"{path} keeps changing; is another run starting there?")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):  # the directory is gone (removed, read-only)
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)  # while still holding it: a waiting opener retries
        os.close(fd)


def _read_holder(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return {}


def _in_use(dirpath: str, path: str, holder: dict) -> str:
    host, pid = holder.get("host", "an unknown host"), holder.get("pid", "unknown")
    since = f", since {holder['since']}" if holder.get("since") else ""
    same = host == socket.gethostname() and pid == os.getpid()
    fix = ("two ModelCheckpoint callbacks of this run save there: give each its own dirpath"
           if same else
           f"stop the other run (kill {pid} on {host}) or give this one its own directory "
           "(ModelCheckpoint(dirpath=...) or Fit(default_root_dir=...))")
    return (f"the checkpoint directory {dirpath} is in use by another run: host {host}, pid "
            f"{pid}{since} holds its lock file {path}. Two runs saving into one directory "
            f"delete each other's unfinished saves and corrupt it, so this run does not start: "
            f"{fix}. (A lock left by a run that died is released by the system and does not "
            "block a resume.)")
