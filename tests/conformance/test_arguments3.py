"""Display, monitoring and logger arguments, beside lightning_side/arguments3.py:
TQDMProgressBar(refresh_rate, leave), ModelSummary(max_depth), the weight averages'
use_buffers / device, DeviceStatsMonitor, ThroughputMonitor, TensorBoardLogger's run directory."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from tests.conformance._cases import case, claim, covers, departure
from tests.conformance._jaxlight import Reg, _mse, batches, make_fit

G = "arguments3"
SECTION = "Differences the coverage cases pin"


def _bar_run(capsys, **kw):
    bar = callbacks.TQDMProgressBar(**kw)
    capsys.readouterr()
    make_fit(max_epochs=2, limit_train_batches=4, enable_progress_bar=True,
             callbacks=[bar]).fit(Reg(G), batches(G))
    out = capsys.readouterr()
    text = out.out + out.err
    return bar, text


@claim("TQDMProgressBar(refresh_rate=3) draws the bar and reads refresh_rate back")
@covers("TQDMProgressBar.refresh_rate")
def test_tqdm_refresh_rate(capsys):
    want = case(G, "tqdm_progress_bar")["refresh_3_leave"]
    bar, text = _bar_run(capsys, refresh_rate=3, leave=True)
    assert [bar.refresh_rate, "epoch 0" in text.lower()] == [want["refresh_rate"], want["drawn"]]


@departure("TQDMProgressBar(refresh_rate=0) is refused (Lightning: the bar is disabled, nothing "
           "drawn); leave changes nothing visible in jaxlight's one bar for the whole fit "
           "(measured, output not a terminal: 2 lines with leave=True or False), where "
           "Lightning's bar per epoch is kept or cleared (3 lines, 1)",
           section=SECTION)
@covers("TQDMProgressBar(refresh_rate)", "TQDMProgressBar(leave)")
def test_tqdm_display(capsys):
    want = case(G, "tqdm_progress_bar")
    assert want["refresh_0"]["disabled"] and not want["refresh_0"]["drawn"]
    with pytest.raises(jl.ConfigurationError, match="refresh_rate"):
        callbacks.TQDMProgressBar(refresh_rate=0)
    lines = {leave: _bar_run(capsys, refresh_rate=3, leave=leave)[1].count("\n")
             for leave in (True, False)}
    assert [want["refresh_3_leave"]["epoch_lines"],
            want["refresh_3_no_leave"]["epoch_lines"]] == [3, 1]
    assert lines == {True: 2, False: 2}


class Nested(Reg):
    def configure_model(self, rngs):
        return nnx.Dict(layer=nnx.Linear(4, 2, rngs=rngs), encoder=nnx.Sequential(
            nnx.Linear(4, 8, rngs=rngs), nnx.Sequential(nnx.Linear(8, 8, rngs=rngs))))

    def training_step(self, model, batch):
        return jnp.mean((model["layer"](batch["x"]) - batch["y"]) ** 2)


@departure("ModelSummary(max_depth) and RichModelSummary(max_depth): jaxlight's summary is a "
           "table of parameter arrays (max_depth=-1, its default) or clu's overview (>= 0); "
           "Lightning's default is 1 and lists modules to that depth (measured rows: 2 at depth "
           "1, 4 at 2, 6 at -1)",
           section=SECTION)
@covers("ModelSummary(max_depth)", "RichModelSummary(max_depth)")
def test_model_summary_depth(capsys):
    want = case(G, "model_summary")
    assert [len(want[d]["rows"]) for d in ("1", "2", "-1")] == [2, 4, 6]
    assert callbacks.ModelSummary().max_depth == -1
    capsys.readouterr()
    make_fit(max_epochs=1, limit_train_batches=1, enable_model_summary=False,
             callbacks=[callbacks.ModelSummary(max_depth=-1)]).fit(Nested(G), batches(G))
    text = capsys.readouterr().out
    # one row per parameter array, at every depth (Lightning's depth 1 stops at `encoder`)
    assert text.count("kernel") == 3 and "encoder" in text


class BnNet(Reg):
    def configure_model(self, rngs):
        return nnx.Sequential(nnx.BatchNorm(4, momentum=0.9, epsilon=1e-5, rngs=rngs),
                              super().configure_model(rngs))

    def training_step(self, model, batch):
        return _mse(model, batch)


@departure("the weight averages' use_buffers and device change nothing: the average holds the "
           "trainable parameters only, where they are sharded (BatchNorm's running mean after "
           "the fit is the same with use_buffers=True or False); Lightning averages buffers "
           "with use_buffers=True (measured: running means differ by up to 0.06) and keeps the "
           "average on `device`. EMAWeightAveraging(device='cpu') is refused (there is no other "
           "device for the average); Lightning's takes it",
           section="Where jaxlight departs from Lightning on purpose")
@covers("EMAWeightAveraging(use_buffers)", "EMAWeightAveraging(device)",
        "WeightAveraging(use_buffers)", "WeightAveraging(device)",
        "StochasticWeightAveraging(device)")
def test_averaging_buffers_and_device():
    want = case(G, "averaging_buffers")
    assert not np.allclose(want["True"]["running_mean"], want["False"]["running_mean"])
    means = {}
    with pytest.raises(jl.ConfigurationError, match="device='cpu'"):
        callbacks.EMAWeightAveraging(device="cpu")
    for kw in ({"use_buffers": True, "device": None}, {"use_buffers": False, "device": None}):
        module = BnNet(G)
        make_fit(max_epochs=1, limit_train_batches=3, callbacks=[
            callbacks.EMAWeightAveraging(decay=0.5, **kw)]).fit(module, batches(G))
        means[kw["use_buffers"]] = np.asarray(module.model.layers[0].mean[...])
    np.testing.assert_array_equal(means[True], means[False])
    swa = {d: callbacks.StochasticWeightAveraging(swa_lrs=0.05, device=d) for d in ("cpu", None)}
    assert all(cb.swa_lrs == 0.05 for cb in swa.values())


@departure("DeviceStatsMonitor logs JAX's device memory statistics; Lightning's on CPU needs "
           "psutil (absent from the oracle environment: ModuleNotFoundError) and logs torch's "
           "names. ThroughputMonitor counts examples from the batch itself (no batch_size_fn) "
           "and logs other names than Lightning's train/samples, train/device/samples_per_sec",
           section=SECTION)
@covers("DeviceStatsMonitor", "ThroughputMonitor")
def test_monitors(tmp_path):
    want = case(G, "monitors")
    assert want["device_stats"] == "ModuleNotFoundError: True"
    logger = callbacks.CSVLogger(tmp_path)
    make_fit(max_epochs=1, limit_train_batches=4, logger=logger, log_every_n_steps=1,
             callbacks=[callbacks.ThroughputMonitor()]).fit(Reg(G), batches(G))
    with open(os.path.join(logger.log_dir, "metrics.csv")) as f:
        columns = set(f.readline().strip().split(","))
    lightning = set(want["throughput_columns"]) - {"epoch", "step", "train_loss"}
    assert lightning and not lightning & columns, sorted(columns)


def _tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    out = {}
    for name, kw in {"auto": {}, "int": {"version": 3}, "str": {"version": "v7"}}.items():
        tb = callbacks.TensorBoardLogger(tmp_path / "tb", name="exp", **kw)
        make_fit(max_steps=1, logger=tb).fit(Reg(G), batches(G))  # the directory: at setup
        out[name] = {"log_dir": os.path.relpath(tb.log_dir, tmp_path),
                     "save_dir": os.path.relpath(tb.save_dir, tmp_path), "name": tb.name,
                     "version": tb.version}
    tb = callbacks.TensorBoardLogger(tmp_path / "tb", name="exp")
    make_fit(max_steps=1, logger=tb).fit(Reg(G), batches(G))
    out["second_auto"] = tb.version
    return out


@claim("TensorBoardLogger(save_dir, name, version) names Lightning's run directory "
       "(<save_dir>/<name>/version_<n>, the next free n when version is None) and reads back "
       "save_dir, name, version and log_dir")
@covers("TensorBoardLogger(save_dir)", "TensorBoardLogger(name)", "TensorBoardLogger.save_dir",
        "TensorBoardLogger.name", "TensorBoardLogger.version")
def test_tensorboard_dirs(tmp_path):
    want = case(G, "tensorboard_dirs")
    got = _tensorboard(tmp_path)
    diffs = {k: (got[k], want[k]) for k in want if k != "str" and got[k] != want[k]}
    assert not diffs, diffs


@departure("TensorBoardLogger(version='v7') writes to <save_dir>/<name>/version_v7 (Lightning: "
           ".../v7), and its log_dir and version are known once a fit has set it up (Lightning's "
           "at construction)",
           section=SECTION)
@covers("TensorBoardLogger(version)", "TensorBoardLogger.log_dir")
def test_tensorboard_str_version(tmp_path):
    want = case(G, "tensorboard_dirs")["str"]
    assert want["log_dir"] == os.path.join("tb", "exp", "v7")
    assert callbacks.TensorBoardLogger(tmp_path / "tb", name="exp").log_dir is None
    got = _tensorboard(tmp_path)["str"]
    assert got["log_dir"] == os.path.join("tb", "exp", "version_v7")
