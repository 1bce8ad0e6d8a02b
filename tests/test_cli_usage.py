"""The command line as a new user meets it: user errors end as `jaxlight: error: ...` with exit
status 2 (never a traceback), --version, output piped into `head`, and the choices the command
makes for the user (sizes of bare strategies, what validate evaluates), each said in one line."""

from __future__ import annotations

import os
import subprocess
import sys

import jaxlight as jl
from jaxlight._cli import main

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
