"""The suite compiles with code-generation flags of its own (tests/conftest.py: `CODEGEN_FLAGS`,
which halve its CPU time); users' programs compile with XLA's defaults. Every strategy's
equivalence with one device (tests/strategies/test_tiny_equivalence.py) runs here again as users
compile it, so a difference that only XLA's default code generation shows still fails the suite."""

import os
import subprocess
import sys

import pytest

from tests.conftest import CODEGEN_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_every_strategy_matches_one_device_under_xla_default_code_generation():
    names = {flag.split("=")[0] for flag in CODEGEN_FLAGS}
    flags = [f for f in os.environ["XLA_FLAGS"].split() if f.split("=")[0] not in names]
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAXLIGHT_TEST_USER_CODEGEN": "1"}
    # The child's conftest keeps the user's flags: only the device count is set.
    seen = subprocess.run([sys.executable, "-c", "import os, tests.conftest; "
                           "print(os.environ['XLA_FLAGS'])"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert seen.stdout.split() == flags, seen.stdout
    assert "--xla_force_host_platform_device_count=8" in flags
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/strategies/test_tiny_equivalence.py", "-q",
         "-o", "addopts=", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "9 passed" in out.stdout, out.stdout[-2000:]
