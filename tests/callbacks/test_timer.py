"""Timer and Fit(max_time=...) (tests/conformance/test_callbacks2.py compares the stops with
Lightning's)."""

from __future__ import annotations

import datetime

import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.callbacks import _timer


def test_durations_parse_as_lightnings():
    assert _timer.parse_duration("01:02:03:04") == 86400 + 7200 + 180 + 4
    assert _timer.parse_duration({"hours": 2}) == 7200
    assert _timer.parse_duration(datetime.timedelta(minutes=3)) == 180
    with pytest.raises(jl.ConfigurationError, match=r"'1:00' is not a duration; write "
                                                    r"DD:HH:MM:SS"):
        callbacks.Timer(duration="1:00")
    with pytest.raises(jl.ConfigurationError, match="'minute'"):
        callbacks.Timer(duration={"minute": 1})
    with pytest.raises(jl.ConfigurationError, match="choose 'step' or 'epoch'"):
        callbacks.Timer(duration="00:00:01:00", interval="batch")


def test_max_time_is_the_shortcut_and_alone_is_enough():
    fit = jl.Fit("single", max_time={"minutes": 5}, enable_progress_bar=False, logger=False)
    (timer,) = [cb for cb in fit.callbacks if isinstance(cb, callbacks.Timer)]
    assert timer.duration == 300
    with pytest.raises(jl.ConfigurationError, match=r"Fit\(max_time=.*callbacks.Timer"):
        jl.Fit("single", max_time="00:00:05:00", callbacks=[callbacks.Timer("00:00:01:00")])


def test_elapsed_time_resumes_from_the_state_dict(monkeypatch):
    class Clock:
        now = 50.0

        def monotonic(self):
            return self.now

    clock = Clock()
    monkeypatch.setattr(_timer, "time", clock)
    timer = callbacks.Timer(duration={"seconds": 100})
    timer.on_train_start(None, None)
    clock.now = 80.0
    state = timer.state_dict()
    assert state["time_elapsed"]["train"] == 30.0
    resumed = callbacks.Timer(duration={"seconds": 100})
    resumed.load_state_dict(state)
    assert resumed.time_elapsed() == 30.0 and resumed.time_remaining() == 70.0
    resumed.on_train_start(None, None)
    clock.now = 90.0
    assert resumed.time_elapsed() == 40.0
