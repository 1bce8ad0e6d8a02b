"""Deliberate departures that need a Lightning number (the others sit in their groups):
evaluation in float32 under bf16-mixed, and the loader's batch as the global batch."""

from __future__ import annotations

import numpy as np

import jaxlight as jl
from tests.conformance._cases import case, covers, departure
from tests.conformance._jaxlight import RTOL, Reg, assert_weights, batches, make_fit

G = "departures"


@departure("under precision='bf16-mixed' evaluation runs in float32 (the master parameters): "
           "val_loss equals the float32 run's; Lightning's autocast evaluates in bfloat16",
           section="Deliberate departures")
@covers("Fit(precision)")
def test_bf16_mixed_evaluation():
    lightning = case(G, "bf16_mixed_evaluation")["val_loss"]
    assert abs(lightning["bf16-mixed"] - lightning["32-true"]) > 1e-4 * lightning["32-true"]
    got = make_fit(max_epochs=1, precision="bf16-mixed").validate(
        Reg(G), batches(G, "val", batch_size=6))["val_loss"]
    np.testing.assert_allclose(got, lightning["32-true"], rtol=RTOL)


@departure("a loader's batch is the global batch, split over the devices: batch 8 on 2 devices "
           "trains as Lightning's one process with DataLoader(batch_size=8) (Lightning's "
           "batch_size is per process: 2 processes would train on 16)",
           section="Deliberate departures")
@covers("Fit(strategy)",
        "Fit(devices)")
def test_global_batch():
    expected = case(G, "global_batch")
    module = Reg(G)
    fit = jl.Fit("dp", devices=2, max_epochs=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, num_sanity_val_steps=0,
                 enable_checkpointing=False)
    fit.fit(module, batches(G, batch_size=expected["batch_size"]))
    assert fit.global_step == expected["global_step"]
    assert_weights(module, expected["weights"])
