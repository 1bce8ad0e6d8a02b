"""The command line as a new user meets it: user errors end as `jaxlight: error: ...` with exit
status 2 (never a traceback), --version, output piped into `head`, and the choices the command
makes for the user (sizes of bare strategies, what validate evaluates), each said in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxlight as jl
from jaxlight._cli import main, run

QUIET = ["--enable-progress-bar", "false", "--enable-model-summary", "false", "--logger", "none"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.Popen([sys.executable, "-m", "jaxlight._cli", *args], env=env, **kw)


def test_model_config_error_is_a_user_error(capsys):
    assert main(["fit", "gpt", "--model.num_heads", "3", "--max-steps", "1", *QUIET]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxlight: error: TransformerConfig: embed_dim 64 is not divisible "
                          "by num_heads 3"), err
    assert "nearest: 2 or 4" in err and "Traceback" not in err


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip().startswith(f"jaxlight {jl.__version__} (jax ")


def test_devices_into_a_closed_pipe_ends_without_a_traceback():
    """`jaxlight devices | head -0`: the reader is gone before the first line is written."""
    read, write = os.pipe()
    proc = _cli("devices", stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    os.close(read)
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
    assert proc.returncode == 141


# -- values that would run and do nothing (item 8) -----------------------------------------------


def test_limit_train_batches_zero_is_refused(capsys):
    assert main(["fit", "digits", "--max-steps", "2", "--limit-train-batches", "0", *QUIET]) == 2
    err = capsys.readouterr().err
    assert "limit_train_batches=0 would train on no batch" in err
    assert "--limit-train-batches" in err and "Traceback" not in err


@pytest.mark.parametrize("kw", [{"limit_train_batches": 0}, {"limit_val_batches": 0},
                                {"limit_train_batches": -2}, {"limit_val_batches": 1.5},
                                {"limit_train_batches": 0.0}, {"limit_train_batches": "3"}])
def test_fit_refuses_batch_limits_that_select_nothing(kw):
    [(name, value)] = kw.items()
    with pytest.raises(jl.ConfigurationError, match=rf"{name}={value!r} would"):
        jl.Fit("single", max_steps=1, **kw)


def test_checkpoint_every_zero_steps_is_refused(capsys):
    assert main(["fit", "digits", "--max-steps", "2", "--checkpoint-every-n-steps", "0",
                 *QUIET]) == 2
    assert "--checkpoint-every-n-steps 0 would save no checkpoint" in capsys.readouterr().err
    with pytest.raises(jl.ConfigurationError, match=r"every_n_steps=0"):
        jl.callbacks.ModelCheckpoint("ckpt", every_n_steps=0)


# -- validate without a checkpoint (item 9) ------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "test"])
def test_evaluating_without_a_checkpoint_is_refused(command, capsys):
    assert main([command, "digits", *QUIET]) == 2
    err = capsys.readouterr().err
    assert f"jaxlight {command} digits without --ckpt-path would evaluate a randomly " \
           "initialized model" in err
    assert "--checkpoint-every-n-steps N" in err and "--ckpt-path none" in err
    # With checkpoints under the default root, the message names the flag that finds them.
    os.makedirs("jaxlight_logs/checkpoints")
    assert main([command, "digits", *QUIET]) == 2
    assert "pass --ckpt-path last (the newest checkpoint under jaxlight_logs/checkpoints)" \
        in capsys.readouterr().err


def test_evaluating_the_initialization_on_purpose(capsys):
    result = run("validate", "digits", ["--ckpt-path", "none", "--model.width", "16",
                                        "--model.hidden", "16", *QUIET])
    assert "val_loss" in result.metrics
    assert "warning: --ckpt-path none: validate evaluates the model as configure_model " \
           "initializes it" in capsys.readouterr().out
