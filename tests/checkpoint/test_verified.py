"""Verified checkpoints (issue 17 items 1 and 3): bytes flipped in a checkpoint's array data are
caught on restore: `ckpt_path="last"` falls back to the previous intact step (and the resumed
run writes the damaged step again), or a CheckpointError names the path. Never a silent load."""

import os
import re
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight._checkpoint import complete_steps
from tests.checkpoint._common import assert_bitwise, make_fit, params_of
from tests.models import Classifier, classification_data


def _module():
    # The largest array (the 32 x 4096 kernel and its two Adam moments) dominates the data files.
    return Classifier(din=32, hidden=4096)


def _data():
    return jl.data.ArrayLoader(classification_data(256, din=32), 32, seed=1)


def _flip_bytes(step_dir: str, every_data_file: bool = False) -> None:
    """XORs 4 bytes at 15 evenly spaced offsets of the largest array-data file of the step (or
    of every data file over 64 KiB: which arrays share a file varies from save to save)."""
    files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(step_dir, "state"))
             for f in names]
    largest = max(files, key=os.path.getsize)
    chosen = [f for f in files if os.path.getsize(f) > 2**16] if every_data_file else [largest]
    for path in chosen:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            for offset in np.linspace(0, size - 4, 17).astype(int)[1:-1]:
                f.seek(offset)
                data = bytearray(f.read(4))
                f.seek(offset)
                f.write(bytes(b ^ 0xA5 for b in data))


def _snapshotting(snapshots):
    def snap(fit, module, outputs, batch, batch_idx):
        if fit.global_step % 4 == 0:
            snapshots[fit.global_step] = jax.device_get(fit.state.params)
    return callbacks.LambdaCallback(on_train_batch_end=snap)


def test_flipped_bytes_fall_back_to_the_previous_step_which_is_then_rewritten():
    snapshots = {}
    first = make_fit("fsdp", 8, [callbacks.ModelCheckpoint("ckpt", every_n_steps=4, save_top_k=-1),
                                 _snapshotting(snapshots)])
    first.fit(_module(), _data())
    assert complete_steps("ckpt") == [4, 8]
    intact = ocp.StandardCheckpointer().restore(os.path.abspath("ckpt/8/state"))
    _flip_bytes("ckpt/8")
    # orbax itself reads the damaged step without complaint, with other values: the silent load.
    # (The whole state is compared: which arrays the largest data file holds, the parameters or
    # the optimizer's moments, varies from save to save.)
    plain = ocp.StandardCheckpointer().restore(os.path.abspath("ckpt/8/state"))
    with pytest.raises(AssertionError):
        assert_bitwise(plain, intact)

    module = _module()
    resumed = make_fit("fsdp", 12, [callbacks.ModelCheckpoint("ckpt", every_n_steps=4,
                                                              save_top_k=-1)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(module, _data(), ckpt_path="last")
    messages = [str(w.message) for w in caught]
    damaged = [m for m in messages if "is damaged" in m]
    assert len(damaged) == 1, messages
    assert re.search(r"checkpoint step 8 \(.*ckpt/8\) is damaged.*checksum mismatch.*"
                     r"Resuming from step 4 \(.*ckpt/4\) instead", damaged[0], re.S)
    # Item 3: the damaged step was moved aside and written again, not "kept".
    assert not [m for m in messages if "already exists" in m], messages
    assert os.path.isdir("ckpt/8.damaged")
    assert complete_steps("ckpt") == [4, 8, 12]

    # Resumed from step 4 exactly: the same parameters as an uninterrupted 12-step run, and the
    # rewritten step 8 holds the first run's step-8 values and verifies.
    reference = _module()
    make_fit("fsdp", 12).fit(reference, _data())
    assert_bitwise(params_of(module.model), params_of(reference.model))
    assert_bitwise(params_of(jl.load_checkpoint("ckpt/8", _module())), snapshots[8])


def test_a_damaged_only_checkpoint_raises_naming_its_path():
    make_fit("single", 4, [callbacks.ModelCheckpoint("ckpt", every_n_steps=4)]).fit(
        _module(), _data())
    # Every data file: load_checkpoint below reads (and verifies) the parameters alone.
    _flip_bytes("ckpt/4", every_data_file=True)
    path = re.escape(os.path.abspath("ckpt/4"))
    fit = make_fit("single", 8, [callbacks.ModelCheckpoint("ckpt", every_n_steps=4)])
    with pytest.raises(jl.CheckpointError, match=rf"checkpoint {path} is damaged.*checksum "
                                                 r"mismatch(.|\n)*no older checkpoint"):
        fit.fit(_module(), _data(), ckpt_path="last")
    with pytest.raises(jl.CheckpointError, match=rf"checkpoint {path} is damaged"):
        jl.load_checkpoint("ckpt/4", _module())
    with pytest.raises(jl.CheckpointError, match=rf"checkpoint {path} is damaged"):
        make_fit("single", 8).validate(_module(), _data(), ckpt_path="ckpt")
    assert complete_steps("ckpt") == [4]  # nothing moved or deleted
