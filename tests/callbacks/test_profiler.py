"""Profiler: trace files of the chosen steps, host timing per step, compile times, warnings."""

import gzip
import json
import os

import pytest

import jaxlight as jl
from jaxlight import callbacks
from tests.models import Classifier, classification_data


def _fit(profiler, max_steps=6, **kw):
    fit = jl.Fit("single", max_steps=max_steps, log_every_n_steps=2, val_check_interval=3,
                 callbacks=[profiler],
                 enable_progress_bar=False, enable_model_summary=False,
                 enable_checkpointing=False, **kw)
    fit.fit(Classifier(), jl.data.ArrayLoader(classification_data(256), 32),
            jl.data.ArrayLoader(classification_data(64, seed=1), 32))
    return fit


def test_profiler_traces_chosen_steps_and_times_the_host(tmp_path, capsys):
    profiler = callbacks.Profiler(start_step=3, num_steps=2, logdir=str(tmp_path / "prof"))
    fit = _fit(profiler)

    # Trace files exist, are non-empty, and the Perfetto trace holds the traced steps.
    files = profiler.trace_files
    assert any(f.endswith(".xplane.pb") for f in files)
    assert any(f.endswith(".trace.json.gz") for f in files)
    assert all(os.path.getsize(f) > 0 for f in files)
    [trace] = [f for f in files if f.endswith(".trace.json.gz")]
    with gzip.open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert {e.get("name") for e in events} >= {"train"}  # the StepTraceAnnotation

    # Host timing: one entry per traced step; the parts add up to the step.
    timings = profiler.step_timings
    assert [t["step"] for t in timings] == [3, 4]
    for t in timings:
        assert min(t["data_wait_ms"], t["dispatch_ms"], t["device_ms"]) >= 0
        assert t["step_ms"] == pytest.approx(t["data_wait_ms"] + t["dispatch_ms"]
                                             + t["device_ms"])
    with open(tmp_path / "prof" / "host_timing.json") as f:
        report = json.load(f)
    assert [s["step"] for s in report["steps"]] == [3, 4]
    # Compile times of every compiled function, the evaluation step included (teardown).
    assert fit.compile_times.keys() == {"init", "train", "eval:validation_step"}
    assert all(v > 0 for v in fit.compile_times.values())
    assert report["compile_times_s"] == pytest.approx(fit.compile_times)
    assert fit.logged_metrics["compile_time/train"] == fit.compile_times["train"]
    assert fit.logged_metrics["profiler/step_ms"] == pytest.approx(
        sum(t["step_ms"] for t in timings) / 2)
    assert "profiled steps 3-4" in capsys.readouterr().err


def test_profiler_start_beyond_max_steps_warns(tmp_path):
    profiler = callbacks.Profiler(start_step=10, num_steps=2, logdir=str(tmp_path / "prof"))
    with pytest.warns(UserWarning, match=r"start_step=10\) is beyond max_steps=4"):
        _fit(profiler, max_steps=4, logger=False)
    assert profiler.trace_files == [] and profiler.step_timings == []


def test_profiler_window_past_the_end_warns_and_stops_cleanly(tmp_path):
    profiler = callbacks.Profiler(start_step=3, num_steps=5, logdir=str(tmp_path / "prof"))
    with pytest.warns(UserWarning, match=r"only 2 step\(s\) will be traced"):
        _fit(profiler, max_steps=4, logger=False)
    assert [t["step"] for t in profiler.step_timings] == [3, 4]
    assert profiler.trace_files  # stopped at the end of training


@pytest.mark.parametrize("kwargs", [{"start_step": 0}, {"num_steps": 0}, {"start_step": 1.5}])
def test_profiler_bad_arguments(kwargs):
    with pytest.raises(jl.ConfigurationError, match="must be an integer >= 1"):
        callbacks.Profiler(**kwargs)
