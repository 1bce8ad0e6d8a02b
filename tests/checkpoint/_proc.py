"""Running `_child.py` in a real subprocess and watching its output."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")


class Child:
    """A training subprocess; its stdout lines are collected by a thread (no pipe stalls)."""

    #: Every child started, so that a failing test leaves no process behind (see conftest).
    started: list[Child] = []

    def __init__(self, cfg: dict, workdir: str, env: dict | None = None, script: str = CHILD):
        self.stderr_path = os.path.join(workdir, f"child-{time.monotonic_ns()}.stderr")
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(
            [sys.executable, script, json.dumps(cfg)], cwd=workdir, stdout=subprocess.PIPE,
            stderr=self._stderr, text=True, env=dict(os.environ) if env is None else env,
            start_new_session=True,  # its own process group: kill_group() ends its workers too
        )
        Child.started.append(self)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if line.startswith(prefix):
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.01)
        self.proc.kill()
        raise AssertionError(f"child never printed {prefix!r}; stdout {self.lines[-5:]}, "
                             f"stderr tail {self.stderr()[-2000:]}")

    def kill_group(self) -> None:
        """SIGKILLs the child and every process it started (grain's worker processes outlive a
        parent killed alone, as they would on a node where only the trainer was killed)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def finish(self, timeout: float = 180.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        finally:
            self._reader.join(5)
            self._stderr.close()
        return rc

    def stderr(self) -> str:
        with open(self.stderr_path) as f:
            return f.read()


def kill_leftovers() -> None:
    """SIGKILLs every child still running (a test failed before it ended them)."""
    while Child.started:
        child = Child.started.pop()
        child.kill_group()
        child.proc.wait()
        if not child._stderr.closed:
            child._stderr.close()
