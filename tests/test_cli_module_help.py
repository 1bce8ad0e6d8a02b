"""`python -m jaxlight._cli --help` (what benchmarks/cli_startup.py times) takes the console
script's path: the top-level help without importing JAX."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from jaxlight._cli import _help

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_python_m_jaxlight_cli_help_imports_no_jax():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxlight._cli", "--help"],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == _help.TOP_HELP + "\n"
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:")]
    assert "jaxlight._cli" in imported
    assert not [m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "flax", "optax")]
