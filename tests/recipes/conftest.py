"""Recipe tests compile many small programs: skip XLA's expensive optimization passes.

Set per test (not for the process), so tests elsewhere compile as users do. The math is the same;
every comparison in these tests is between runs compiled the same way.
"""

import jax
import pytest


@pytest.fixture(autouse=True)
def _quick_compiles():
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)
