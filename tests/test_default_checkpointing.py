"""Fit's default checkpoint, as Lightning's `enable_checkpointing=True` (checked against
Lightning 2.6.6: `Trainer(max_epochs=3)` on 2 batches per epoch saves at each epoch's end,
keeps the newest, `epoch=2-step=6.ckpt`, under `<default_root_dir>/checkpoints` without a logger
(`<log_dir>/checkpoints` with one), and `test(ckpt_path="best")` loads it;
`enable_checkpointing=False` saves nothing, and together with a ModelCheckpoint raises
"Trainer was configured with `enable_checkpointing=False` but found `ModelCheckpoint` in
callbacks list")."""

from __future__ import annotations

import os

import numpy as np
import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._paths import complete_steps
from tests.models import Linear

DATA = {"x": np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)}


def _fit(**kw):
    return jl.Fit("single", max_epochs=3, enable_progress_bar=False, logger=False,
                  enable_model_summary=False, default_root_dir="root", **kw)


def _loader():
    return jl.data.DataLoader(DATA, 16)


def test_the_default_fit_saves_every_epoch_and_test_finds_best_and_last():
    fit = _fit()
    module = Linear()
    fit.fit(module, _loader())
    assert isinstance(fit.callbacks[-1], callbacks.ModelCheckpoint)
    assert complete_steps(os.path.join("root", "checkpoints")) == [6]  # the newest kept
    trained = fit.test(module, _loader())["test_loss"]
    # "best" in the fit that saved it: its ModelCheckpoint's best_model_path (no monitor: the
    # newest save, Lightning's meaning); "last" from any fit with the same root.
    assert fit.test(Linear(), _loader(), ckpt_path="best")["test_loss"] == trained
    assert _fit().test(Linear(), _loader(), ckpt_path="last")["test_loss"] == trained
    # A fresh fit has no best_model_path, and the checkpoint records no monitored value: as
    # Lightning's fresh Trainer, it cannot say which is best.
    with pytest.raises(jl.CheckpointError, match="ckpt_path='best'"):
        _fit().test(Linear(), _loader(), ckpt_path="best")


def test_enable_checkpointing_false_saves_nothing():
    fit = _fit(enable_checkpointing=False)
    fit.fit(Linear(), _loader())
    assert not any(isinstance(cb, callbacks.ModelCheckpoint) for cb in fit.callbacks)
    assert not os.path.exists(os.path.join("root", "checkpoints"))
    with pytest.raises(jl.CheckpointError, match="ckpt_path='best'"):
        fit.test(Linear(), _loader(), ckpt_path="best")


def test_enable_checkpointing_false_with_a_model_checkpoint_is_refused():
    with pytest.raises(jl.ConfigurationError, match=r"enable_checkpointing=False.*"
                                                    r"ModelCheckpoint\(dirpath='ck'"):
        _fit(enable_checkpointing=False, callbacks=[callbacks.ModelCheckpoint("ck")])
    with pytest.raises(jl.ConfigurationError, match="enable_checkpointing=0"):
        _fit(enable_checkpointing=0)


def test_a_given_model_checkpoint_replaces_the_default_and_fast_dev_run_saves_none():
    given = callbacks.ModelCheckpoint("mine", every_n_steps=2)
    fit = _fit(callbacks=[given])
    assert [cb for cb in fit.callbacks if isinstance(cb, callbacks.ModelCheckpoint)] == [given]
    dev = _fit(fast_dev_run=True)
    dev.fit(Linear(), _loader())
    assert not any(isinstance(cb, callbacks.ModelCheckpoint) for cb in dev.callbacks)
    assert not os.path.exists(os.path.join("root", "checkpoints"))


def test_the_default_checkpoint_deletes_no_earlier_runs_steps():
    """The default keeps its own newest save; the steps another run left in
    <default_root_dir>/checkpoints stay (Lightning's default deletes only what it saved)."""
    first = _fit(callbacks=[callbacks.ModelCheckpoint(save_top_k=-1)])
    first.fit(Linear(), _loader())
    assert complete_steps(os.path.join("root", "checkpoints")) == [2, 4, 6]
    second = jl.Fit("single", max_epochs=5, enable_progress_bar=False, logger=False,
                    enable_model_summary=False, default_root_dir="root")
    second.fit(Linear(), _loader(), ckpt_path="last")
    assert second.global_step == 10
    assert complete_steps(os.path.join("root", "checkpoints")) == [2, 4, 6, 10]


@pytest.mark.slow
@pytest.mark.parametrize("flag, saved", [([], True),
                                         (["--trainer.enable_checkpointing", "false"], False)])
def test_the_command_line_passes_enable_checkpointing(flag, saved):
    """`jaxlight fit` saves the default checkpoint unless `--trainer.enable_checkpointing false`
    (the flag was dropped as a Lightning key without a jaxlight meaning)."""
    from jaxlight._cli import main

    assert main(["fit", "digits", "--max-steps", "1", "--trainer.default_root_dir", "root",
                 "--trainer.enable_progress_bar", "false", *flag]) == 0
    assert os.path.isdir(os.path.join("root", "checkpoints")) is saved
