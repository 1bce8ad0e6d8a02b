"""Saving replicated arrays: orbax's replica-parallel saving slices each replicated array across
its replicas, which compiles a `slice` program per array shape at the first save; jaxlight
writes arrays of fewer than `MIN_REPLICA_SLICE_BYTES` per replica from one replica instead (the
same files), so a small model's first save under data parallelism compiles no slices."""

from __future__ import annotations

import logging
import re

import jax
import numpy as np
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.checkpoint import _writer
from tests.models import Classifier, classification_data


@pytest.fixture
def lowered():
    """The names of the programs JAX lowers while the test runs (jax_log_compiles)."""
    names: list[str] = []

    class Record(logging.Handler):
        def emit(self, record):
            m = re.match(r"Compiling (\S+) with global shapes", record.getMessage())
            if m:
                names.append(m.group(1))

    handler, logger = Record(), logging.getLogger("jax._src.interpreters.pxla")
    logger.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield names
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)


def test_a_data_parallel_save_of_small_arrays_slices_nothing_and_restores(lowered, tmp_path):
    fit = jl.Fit("dp", max_steps=2, enable_progress_bar=False, enable_model_summary=False,
                 logger=False, default_root_dir=str(tmp_path))
    # Widths no other test uses: programs jitted by an earlier test of this process (a digest,
    # a slice) are not lowered again.
    module = Classifier(din=24, hidden=40, classes=8)
    fit.fit(module, jl.data.ArrayLoader(classification_data(din=24, classes=8), 64))
    assert (tmp_path / "checkpoints").is_dir()  # the default checkpoint saved
    assert "jit(slice)" not in lowered, lowered  # one per array shape before
    want = jax.device_get(nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    again = Classifier(din=24, hidden=40, classes=8)
    jl.Fit("dp", max_steps=2, enable_progress_bar=False, enable_model_summary=False,
           logger=False, default_root_dir=str(tmp_path)).validate(
        again, jl.data.ArrayLoader(classification_data(64, din=24, classes=8), 64),
        ckpt_path="last")
    got = jax.device_get(nnx.to_pure_dict(nnx.state(again.model, nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_large_arrays_keep_orbax_replica_parallel_saving():
    """Only small arrays change: the handler is orbax's own with a threshold (this also notices
    an orbax release that renames the setting), the other types keep orbax's handlers."""
    import orbax.checkpoint as ocp

    registry = _writer.type_handlers()
    array, default = registry.get(jax.Array), ocp.type_handlers.get_type_handler(jax.Array)
    assert array._min_slice_bytes_for_replica_parallel == _writer.MIN_REPLICA_SLICE_BYTES
    assert default._min_slice_bytes_for_replica_parallel is None  # orbax's own left as it was
    assert array._use_replica_parallel == default._use_replica_parallel
    for ty in ocp.type_handlers.supported_types():
        if ty is not jax.Array:
            assert registry.get(ty) is ocp.type_handlers.get_type_handler(ty)
