"""ModelCheckpoint keeps Lightning's checkpoints: which steps stay on disk, best_model_path,
best_model_score, best_k_models, last_model_path; save_top_k with ties (only a strict
improvement replaces a kept checkpoint), mode, save_last, every_n_epochs,
every_n_train_steps, a training-metric monitor."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jaxlight import callbacks
from tests.conformance._cases import case, claim, covers, departure, fixture
from tests.conformance._jaxlight import Passes, Reg, batches, make_fit

G = "checkpoint"
CASES = sorted(fixture(G)["cases"])


def _step(path):
    return None if not path else int(os.path.basename(os.path.normpath(path)))


def _run(name, tmp_path, **override):
    expected = case(G, name)
    kw = dict(expected["kwargs"])  # Lightning's argument names, every_n_train_steps included
    kw.setdefault("save_last", False)  # Lightning's default (None): no last checkpoint
    kw.update(override)
    ck = callbacks.ModelCheckpoint(tmp_path / "ck", monitor=expected["monitor"], **kw)
    values = expected["values"]
    x = fixture(G)["problem"]["val"]["x"][:4]
    if expected["monitor"] == "train_score":
        fit = make_fit(max_epochs=len(values), callbacks=[ck], log_every_n_steps=1)
        fit.fit(Reg(G), Passes(values, x))
    else:
        fit = make_fit(max_epochs=len(values), callbacks=[ck], limit_train_batches=2)
        fit.fit(Reg(G), batches(G), Passes(values, x))
    kept = sorted(int(f) for f in os.listdir(tmp_path / "ck") if f.isdigit())
    return expected, ck, kept


@pytest.mark.parametrize("name", CASES)
@claim("ModelCheckpoint keeps the same steps on disk and names the same best step "
       "(save_top_k with ties, mode, every_n_epochs, every_n_train_steps, training monitor)")
@covers("ModelCheckpoint(dirpath)",
        "ModelCheckpoint(monitor)",
        "ModelCheckpoint(save_top_k)",
        "ModelCheckpoint(mode)",
        "ModelCheckpoint(every_n_epochs)",
        "ModelCheckpoint(every_n_train_steps)",
        "ModelCheckpoint(save_last)")
def test_kept_and_best(name, tmp_path):
    expected, ck, kept = _run(name, tmp_path)
    assert kept == expected["kept_steps"]
    assert _step(ck.best_model_path) == expected["best_step"]
    if expected["best_model_score"] is not None:
        np.testing.assert_allclose(ck.best_model_score, expected["best_model_score"])


@claim("best_k_models maps each kept checkpoint to its score")
def test_best_k_models(tmp_path):
    expected, ck, _ = _run("top_3_min", tmp_path)
    got = {str(_step(p)): float(v) for p, v in ck.best_k_models.items()}
    assert got == expected["best_k_models"]


@claim("save_last=True: last_model_path is Lightning's last.ckpt (rewritten whenever a "
       "checkpoint is saved)")
def test_save_last(tmp_path):
    expected, ck, _ = _run("save_last", tmp_path)
    assert _step(ck.last_model_path) == expected["last_step"]


@claim("without save_last, last_model_path is empty, as Lightning's")
def test_no_last_model_path_without_save_last(tmp_path):
    expected, ck, _ = _run("top_1_ties", tmp_path)
    assert expected["last_step"] is None
    assert not ck.last_model_path


@departure("ModelCheckpoint's default (save_last=None) also keeps the newest step and saves the "
           "final state, so ckpt_path='last' resumes where the fit stopped; Lightning's default "
           "keeps only the save_top_k",
           section="Deliberate departures")
def test_default_keeps_the_newest_step(tmp_path):
    expected, ck, kept = _run("top_1_ties", tmp_path, save_last=None)
    assert expected["kept_steps"] == [4] and not expected["has_last"]
    assert kept == [4, 12]
    assert _step(ck.best_model_path) == expected["best_step"]
    assert _step(ck.last_model_path) == 12
