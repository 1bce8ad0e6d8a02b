"""fit at and past its limit (a requeued job that already finished trains nothing and returns),
and mid-epoch resume."""

from __future__ import annotations

import pytest

from jaxlight import callbacks
from tests.conformance._cases import case, claim, departure
from tests.conformance._jaxlight import Reg, assert_weights, batches, make_fit

G = "resume"


class Seen(callbacks.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, fit, module, batch, batch_idx):
        self.seen.append([batch_idx, round(float(batch["x"][0, 0]), 4)])


def _first(tmp_path, **kw):
    ck = callbacks.ModelCheckpoint(tmp_path / "ck", save_top_k=-1, save_last=True,
                                   **kw.pop("ck", {}))
    module = Reg(G)
    fit = make_fit(callbacks=[ck], **kw)
    fit.fit(module, batches(G))
    return ck, module


def _resume(name, ckpt):
    expected = case(G, name)
    seen, module = Seen(), Reg(G)
    fit = make_fit(callbacks=[seen], **expected["resume"])
    fit.fit(module, batches(G), ckpt_path=ckpt)
    return expected, seen, fit, module


LIMITS = {"fit_again_at_max_epochs": dict(max_epochs=2),
          "fit_past_max_epochs": dict(max_epochs=2),
          "fit_again_at_max_steps": dict(max_steps=10),
          "fit_past_max_steps": dict(max_steps=10)}


@pytest.mark.parametrize("name", sorted(LIMITS))
@claim("fit from a checkpoint at or past its max_epochs / max_steps trains nothing and returns "
       "the checkpoint's weights")
def test_fit_at_or_past_limit(name, tmp_path):
    ck, _ = _first(tmp_path, **LIMITS[name])
    expected, seen, fit, module = _resume(name, ck.last_model_path)
    assert seen.seen == expected["seen"] == []
    assert fit.global_step == expected["global_step"]
    assert_weights(module, expected["weights"])


@departure("mid-epoch resume continues with the batch after the checkpoint's (a loader without "
           "a resumable position is fast-forwarded), so the resumed run equals the "
           "uninterrupted one; Lightning restarts such a loader at its first batch while "
           "counting on from batch_idx 5",
           section="Deliberate departures")
def test_mid_epoch_resume(tmp_path):
    ck, _ = _first(tmp_path, max_steps=5, ck={"every_n_steps": 5})
    expected, seen, fit, module = _resume("mid_epoch_resume", ck.last_model_path)
    first_inputs = [b["x"][0, 0] for b in batches(G).items]
    # Lightning: batch_idx 5, 6, 7 get batches 0, 1, 2's data
    assert [v for _, v in expected["seen"][:3]] == [round(float(v), 4) for v in first_inputs[:3]]
    assert [i for i, _ in seen.seen] == [i for i, _ in expected["seen"]]
    assert [v for _, v in seen.seen] == [round(float(v), 4) for v in first_inputs[5:] +
                                         first_inputs]
    assert fit.global_step == expected["global_step"]
    assert_weights(module, case(G, "uninterrupted_2_epochs")["weights"])
