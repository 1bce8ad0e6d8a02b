"""8 simulated CPU devices for every test, set before JAX starts."""

import os
import shutil
import tempfile

# The suite is dominated by XLA compiling small programs; LLVM's optimizations of the CPU code
# cost more than they save here (2.5x faster on tests/strategies/test_equivalence.py). HLO
# passes (sharding, collectives) are unaffected; benchmarks do not use this file.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite never writes the user's persistent compilation cache: it shares one of its own, a
# fresh directory per run, which the test processes it starts inherit. Many tests compile the
# same programs (the same small models under the same strategies); each compiles once per run.
# tests/test_cache.py uses directories of its own; a test that counts XLA's compiles turns the
# cache off for its fits (Fit(compilation_cache=False)).
if "JAXLIGHT_TEST_XLA_CACHE" not in os.environ:
    os.environ["JAXLIGHT_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxlight-test-xla-")
    _OWN_CACHE = True
else:  # a worker or child of a run that made it
    _OWN_CACHE = False
os.environ["JAXLIGHT_COMPILATION_CACHE"] = os.environ["JAXLIGHT_TEST_XLA_CACHE"]

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _chdir_tmp(tmp_path, monkeypatch):
    """Default log and checkpoint directories land in the test's temporary folder."""
    monkeypatch.chdir(tmp_path)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAXLIGHT_TEST_XLA_CACHE"], ignore_errors=True)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
