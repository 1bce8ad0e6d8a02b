"""TQDMProgressBar: redraws bounded by mininterval on a real terminal (a pty), plain periodic
lines in a log file, a total under max_epochs, and one line saying why training stopped."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import sys
import termios
import threading
import time

import numpy as np
import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight._fit._preemption import Preempted
from tests.models import Classifier, classification_data, saves_checkpoints


def _fit(max_steps=None, bar=None, extra=(), **kw) -> jl.Fit:
    kw.setdefault("log_every_n_steps", 50)
    return jl.Fit("single", max_steps=max_steps, enable_progress_bar=False, logger=False,
                  enable_model_summary=False, enable_checkpointing=saves_checkpoints(extra),
                  callbacks=[bar or callbacks.TQDMProgressBar(), *extra], **kw)


def _data(n=512, batch=4):
    return jl.data.ArrayLoader(classification_data(n), batch, seed=0)


class _Terminal:
    """A real pseudo-terminal as stderr; everything written to it is collected."""

    def __init__(self):
        master, slave = os.openpty()
        # 24 rows x 120 columns, as a terminal window has (a new pty is 0 x 0).
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        self.master, self.stream = master, os.fdopen(slave, "w")
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # the slave end closed
                return
            if not chunk:
                return
            self.chunks.append(chunk)

    def close(self) -> bytes:
        self.stream.close()
        self.reader.join(timeout=10)
        os.close(self.master)
        return b"".join(self.chunks)


def test_terminal_redraws_at_most_once_per_mininterval(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal.stream)
    fit = _fit(300, callbacks.TQDMProgressBar(mininterval=0.25))
    t0 = time.perf_counter()
    fit.fit(Classifier(), _data(1200))
    elapsed = time.perf_counter() - t0
    out = terminal.close()
    redraws = out.count(b"\r")
    # Before: a refresh() every step, 300+ redraws whatever the interval.
    assert redraws <= elapsed / 0.25 + 5, (redraws, elapsed)
    assert b"300/300" in out


def test_log_file_gets_plain_periodic_lines(capsys):
    fit = _fit(300, callbacks.TQDMProgressBar(print_interval=0.0))
    fit.fit(Classifier(), _data(1200))
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert "\r" not in err and "\x1b" not in err  # no terminal control in a log file
    # A line when training starts, one per log interval (every 50 steps), one at the end.
    assert [line.split(",")[0] for line in lines] == [
        "train: started step 0/300 (0%)", *[f"train: step {s}/300 ({100 * s / 300:.0f}%)"
                                            for s in range(50, 301, 50)],
        lines[-1].split(",")[0]]
    assert lines[-1].startswith("train: finished in ") and "step 300/300 (100%)" in lines[-1]
    assert "loss " in lines[1] and "steps/s " in lines[1]


def test_log_file_lines_are_throttled_by_print_interval(capsys):
    t0 = time.perf_counter()
    _fit(300, callbacks.TQDMProgressBar()).fit(Classifier(), _data(1200))  # every 30 s
    elapsed = time.perf_counter() - t0
    lines = capsys.readouterr().err.splitlines()
    assert 2 <= len(lines) <= 2 + elapsed // 30, lines


def test_total_under_max_epochs(capsys):
    # 16 batches per epoch, 5 of them (limit_train_batches), 3 epochs: 15 steps.
    _fit(None, callbacks.TQDMProgressBar(print_interval=0.0), max_epochs=3,
         limit_train_batches=5).fit(Classifier(), _data(64))
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("train: started step 0/15 (0%)")
    assert "step 15/15 (100%)" in lines[-1]


def test_says_why_early_stopping_stopped(capsys):
    # Two batches per epoch; an improvement of 1e9 never comes: stops at the second epoch end.
    stop = callbacks.EarlyStopping("loss", patience=1, min_delta=1e9)
    _fit(None, extra=[stop], max_epochs=10).fit(Classifier(), _data(8))
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("training stopped at step 4/20 (20%): EarlyStopping: loss did not "
                           "improve by more than 1000000000.0 for 1 checks"), last


def test_says_why_the_nonfinite_guard_stopped(capsys):
    data = classification_data(32)
    data["x"][:] = np.nan
    fit = _fit(10, extra=[callbacks.NonFiniteGuard(2)], log_every_n_steps=1)
    with pytest.raises(jl.TrainingStopped):
        fit.fit(Classifier(), jl.data.ArrayLoader(data, 4, seed=0))
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("training stopped at step ") and "/10 (" in last
    assert "NonFiniteGuard: 2 training steps in a row (steps 1 to 2) had NaN or Inf" in last


def test_says_why_preemption_stopped(capsys):
    def send(fit, module, outputs, batch, batch_idx):
        if fit.global_step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    fit = _fit(10, extra=[callbacks.ModelCheckpoint("ckpt", every_n_steps=100),
                          callbacks.LambdaCallback(on_train_batch_end=send)])
    with pytest.raises(Preempted):
        fit.fit(Classifier(), _data(64))
    assert "training stopped at step 3/10 (30%): preempted by SIGUSR1" in \
        capsys.readouterr().err.splitlines()
