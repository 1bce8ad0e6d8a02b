"""`import jaxlight` imports no JAX: the public names are resolved on first use (PEP 562), and
every name it exported before is still there, through `jl.NAME`, `from jaxlight import NAME`,
`dir(jaxlight)` and `__all__`."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import jaxlight
from jaxlight import callbacks, nn

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: What `import jaxlight` exported when it imported everything eagerly (beside the dunders).
PUBLIC = {
    "CheckpointError", "ConfigurationError", "DataError", "DataModule", "DistributedError",
    "Fit", "JaxlightError", "JaxlightWarning", "PortingError", "ShardingError", "StepOutput",
    "StepOutputError", "TrainModule", "TrainState", "TrainingStopped", "Tuner", "UserStepError",
    "__version__", "_errors", "_fit", "_version", "analysis", "callbacks", "checkpoint", "data",
    "distributed", "hparams", "load_checkpoint", "metrics", "module", "nn", "optim",
    "schedules", "sharding", "state", "step", "strategies",
}


def _fresh(code: str) -> list:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_jaxlight_imports_no_jax():
    code = ("import json, sys, jaxlight; print(json.dumps([sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('jax', 'flax', 'optax')), dir(jaxlight)]))")
    loaded, names = _fresh(code)
    assert loaded == []
    assert set(names) >= PUBLIC


def test_a_plain_fit_does_not_import_the_pretrained_families_or_unused_callbacks():
    code = ("import json, sys, jaxlight; jaxlight.Fit; jaxlight.TrainModule; jaxlight.callbacks; "
            "print(json.dumps(sorted(sys.modules)))")
    loaded = set(_fresh(code))
    assert "jax" in loaded and "jaxlight._fit" in loaded
    for lazy in ("jaxlight.nn.pretrained", "jaxlight.posttrain", "jaxlight.callbacks._wandb",
                 "jaxlight.callbacks._finders", "jaxlight.callbacks._rich"):
        assert lazy not in loaded, lazy


def test_every_public_name_resolves():
    for name in jaxlight.__all__:
        assert getattr(jaxlight, name) is not None, name
    assert set(dir(jaxlight)) >= PUBLIC
    assert {"Fit", "TrainModule", "callbacks", "nn", "strategies"} <= set(jaxlight.__all__)
    for name in callbacks.__all__:
        assert isinstance(getattr(callbacks, name), type), name
    for name in nn.__all__:
        assert getattr(nn, name) is not None, name
    from jaxlight import Fit, TrainModule, load_checkpoint  # noqa: F401 - the from-import form
    from jaxlight.callbacks import ModelCheckpoint, WandbLogger  # noqa: F401
    from jaxlight.nn import from_pretrained  # noqa: F401
    assert jaxlight.Fit is jaxlight._fit.Fit
    assert nn.from_pretrained is nn.pretrained.from_pretrained


@pytest.mark.slow  # a fresh process; the fast tier checks laziness in this one
def test_the_command_line_finds_a_callback_by_its_short_name_in_a_fresh_process(tmp_path):
    """`--trainer.logger CSVLogger` is resolved by jsonargparse among the classes already
    imported: with the callbacks loaded lazily, a fresh `jaxlight fit` refused it ('expects bool |
    Callback | Sequence, got CSVLogger') unless an earlier test had imported the class."""
    port = ROOT / "tests" / "conformance" / "_cli_port.py"
    out = subprocess.run(
        [sys.executable, "-m", "jaxlight._cli", "fit", f"{port}:LitClassifier", "--data",
         f"{port}:MyDataModule", "--trainer.logger", "CSVLogger",
         "--trainer.callbacks+=EarlyStopping", "--trainer.callbacks.monitor", "val_loss",
         "--print_config"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "class_path: jaxlight.callbacks.CSVLogger" in out.stdout
    assert "class_path: jaxlight.callbacks.EarlyStopping" in out.stdout
