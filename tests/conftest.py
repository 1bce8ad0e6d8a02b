"""8 simulated CPU devices for every test, set before JAX starts."""

import os

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
# Tests never write the user's persistent compilation cache (tests/test_cache.py uses its own).
os.environ["JAXLIGHT_COMPILATION_CACHE"] = "off"

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _chdir_tmp(tmp_path, monkeypatch):
    """Default log and checkpoint directories land in the test's temporary folder."""
    monkeypatch.chdir(tmp_path)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"
