"""Which steps validate: the same `Fit` arguments as Lightning's `Trainer` arguments (the
fixture stores them), the same (global_step, epoch, validation batches) at every validation."""

from __future__ import annotations

import pytest

from jaxlight import callbacks
from tests.conformance._cases import assert_sequence, case, claim, covers, fixture
from tests.conformance._jaxlight import Reg, batches, make_fit

G = "validation"


class Validations(callbacks.Callback):
    """lightning_side/validation.py's recorder."""

    def __init__(self):
        self.runs, self.batches, self.sanity = [], 0, 0

    def on_sanity_check_start(self, fit, module):
        self.sanity += 1

    def on_validation_batch_end(self, fit, module, batch, batch_idx):
        self.batches += 1

    def on_validation_end(self, fit, module):
        self.runs.append([fit.global_step, fit.current_epoch, self.batches])
        self.batches = 0


CASES = sorted(fixture(G)["cases"])


@pytest.mark.parametrize("name", CASES)
@claim("validation runs after the same steps, on the same number of batches, for the same "
       "max_epochs / max_steps / limit_*_batches / val_check_interval / "
       "check_val_every_n_epoch / num_sanity_val_steps / fast_dev_run")
@covers("Fit(max_epochs)",
        "Fit(max_steps)",
        "Fit(limit_train_batches)",
        "Fit(limit_val_batches)",
        "Fit(val_check_interval)",
        "Fit(check_val_every_n_epoch)",
        "Fit(num_sanity_val_steps)",
        "Fit(fast_dev_run)",
        "Fit.current_epoch")
def test_validation_schedule(name):
    expected = case(G, name)
    seen = Validations()
    fit = make_fit(callbacks=[seen], **expected["trainer"])
    fit.fit(Reg(G), batches(G), batches(G, "val"))
    assert_sequence(seen.runs, expected["validations"], "validations (step, epoch, batches)")
    assert (fit.global_step, seen.sanity) == (expected["global_step"], expected["sanity_checks"])
