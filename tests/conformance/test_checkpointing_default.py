"""Fit(enable_checkpointing) beside lightning_side/checkpointing.py: the default saves at each
epoch's end and keeps the newest under <default_root_dir>/checkpoints, where test(ckpt_path=
"best") finds it; False saves nothing; False beside a ModelCheckpoint is refused."""

from __future__ import annotations

import os

import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._paths import complete_steps
from tests.conformance._cases import case, claim, covers
from tests.conformance._jaxlight import Reg, batches, make_fit

G = "checkpointing"


def _run(**kw) -> dict:
    fit = make_fit(max_epochs=3, limit_train_batches=2, default_root_dir="root", **kw)
    module = Reg(G)
    fit.fit(module, batches(G))
    try:
        fit.test(module, batches(G), ckpt_path="best")
        best = True
    except jl.CheckpointError:
        best = False
    folder = os.path.join("root", "checkpoints")
    return {"saved_steps": complete_steps(folder) if os.path.isdir(folder) else [],
            "test_best_loads": best}


@claim("Fit's default checkpoint saves at each epoch's end, keeps the newest, and "
       "test(ckpt_path='best') loads it; enable_checkpointing=False saves nothing and has no "
       "best")
@covers("Fit(enable_checkpointing)")
@pytest.mark.parametrize("name, flag", [("default", None), ("false", False)])
def test_enable_checkpointing(name, flag):
    assert _run(enable_checkpointing=flag) == case(G, name)


@claim("enable_checkpointing=False beside a ModelCheckpoint in callbacks is refused")
@covers("Fit(enable_checkpointing)")
def test_enable_checkpointing_false_with_a_model_checkpoint():
    assert case(G, "false_with_model_checkpoint_refused")
    with pytest.raises(jl.ConfigurationError, match="enable_checkpointing=False"):
        make_fit(enable_checkpointing=False, callbacks=[callbacks.ModelCheckpoint("ck")])
