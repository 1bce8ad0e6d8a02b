"""The resume test starts real training subprocesses: none may outlive its test."""

import pytest

from tests.checkpoint._proc import kill_leftovers


@pytest.fixture(autouse=True)
def _no_leftover_children():
    yield
    kill_leftovers()
