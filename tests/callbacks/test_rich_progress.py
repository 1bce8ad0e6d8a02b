"""RichProgressBar on a real terminal (a pty): the bar, its count, metrics and steps/s, redraws
bounded by refresh_rate; plain lines in a log file (TQDMProgressBar's); the default bar stays
out when it is given."""

from __future__ import annotations

import re
import sys
import time

import pytest

import jaxlight as jl
from jaxlight import callbacks
from tests.callbacks.test_progress import _data, _fit, _Terminal
from tests.models import Classifier

pytest.importorskip("rich")


def test_rich_bar_on_a_terminal_redraws_at_most_refresh_rate_per_second(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal.stream)
    bar = callbacks.RichProgressBar(refresh_rate=4, leave=True)
    fit = _fit(150, bar, log_every_n_steps=50)
    t0 = time.perf_counter()
    fit.fit(Classifier(), _data(600))
    elapsed = time.perf_counter() - t0
    out = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.close().decode(errors="replace"))
    draws = out.count("epoch 0")
    # A redraw per step would be 150; at most 4 per second (plus the first and last).
    assert 2 <= draws <= elapsed * 4 + 4, (draws, elapsed)
    last = out.rstrip().splitlines()[-1]
    assert "150/150" in last and "steps/s" in last and re.search(r"loss: \d+\.\d{3}\b", last)


def test_rich_bar_in_a_log_file_prints_plain_lines(capsys):
    fit = _fit(20, callbacks.RichProgressBar(), log_every_n_steps=10)
    fit.fit(Classifier(), _data(80))
    err = capsys.readouterr().err
    assert "\x1b" not in err
    assert err.splitlines()[0].startswith("train: started step 0/20 (0%)")
    assert "step 20/20 (100%)" in err.splitlines()[-1]


def test_rich_bar_replaces_the_default_bar_and_refresh_rate_zero_shows_nothing(capsys):
    fit = jl.Fit("single", max_steps=4, callbacks=[callbacks.RichProgressBar(refresh_rate=0)],
                 logger=False, enable_model_summary=False)
    # No TQDMProgressBar; the default ModelCheckpoint (enable_checkpointing=True) comes last.
    assert [type(cb).__name__ for cb in fit.callbacks] == ["RichProgressBar", "ModelCheckpoint"]
    fit.fit(Classifier(), _data(16))
    assert capsys.readouterr().err == ""
    with pytest.raises(jl.ConfigurationError, match="redraws per second"):
        callbacks.RichProgressBar(refresh_rate=-1)
