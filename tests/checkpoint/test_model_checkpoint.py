"""ModelCheckpoint: async correctness, retention, best/last, layout, loading, bad input."""

import json
import math
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxlight as jl
from jaxlight import callbacks
from jaxlight.checkpoint._restore import complete_steps, read_meta
from tests.checkpoint._common import (
    AnnotatedClassifier,
    DropoutClassifier,
    assert_bitwise,
    loader,
    make_fit,
    params_of,
)
from tests.models import Classifier, classification_data


def test_async_checkpoint_holds_the_values_of_its_step(tmp_path):
    # The state is donated to the next step while orbax writes in the background: each
    # checkpoint must still hold exactly the values after its own step.
    snapshots = {}

    def snapshot(fit, module, outputs, batch, batch_idx):
        snapshots[fit.global_step] = jax.device_get(fit.state.params)

    ckpt = callbacks.ModelCheckpoint("ckpt", every_n_steps=2, save_top_k=-1)
    assert ckpt.async_save
    fit = make_fit("fsdp", 6, [ckpt, callbacks.LambdaCallback(on_train_batch_end=snapshot)])
    fit.fit(Classifier(), loader())
    assert complete_steps("ckpt") == [2, 4, 6]
    for step in (2, 4, 6):
        model = jl.load_checkpoint(f"ckpt/{step}", Classifier())
        assert_bitwise(params_of(model), snapshots[step])
        assert read_meta(f"ckpt/{step}")["step"] == step


def test_layout_is_readable_with_plain_orbax(tmp_path):
    module = Classifier(hidden=32)
    fit = make_fit("fsdp", 8, [callbacks.ModelCheckpoint("ckpt", every_n_steps=4)])
    fit.fit(module, loader())
    step_dir = os.path.abspath("ckpt/8")
    state = ocp.StandardCheckpointer().restore(os.path.join(step_dir, "state"))
    assert set(state) == {"step", "params", "opt_state", "rest"}
    assert int(state["step"]) == 8
    assert_bitwise(state["params"], params_of(module.model))
    meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(os.path.join(step_dir, "meta"))
    # Saved after the last batch of epoch 0 (a resume starts epoch 1).
    assert meta["step"] == 8 and meta["epoch"] == 0 and meta["batch_idx"] == 8
    assert meta["hparams"] == {"din": 16, "hidden": 32, "classes": 4, "lr": 0.01}
    assert meta["loader"] == {"epoch": 0, "position": 8, "seed": 1, "batch_size": 32}
    assert meta["module"].endswith("Classifier") and meta["strategy"]["name"] == "fsdp"
    json.dumps(meta)  # plain JSON


def _stored_chunk_bytes(step_dir: str) -> int:
    """The bytes orbax stored for the arrays' chunks (read through OCDBT, whose own files also
    hold its index), leaving out the per-array zarr metadata."""
    import tensorstore as ts

    store = ts.KvStore.open({"driver": "ocdbt",
                             "base": f"file://{os.path.abspath(step_dir)}/state/"}).result()
    keys = [k for k in store.list().result()
            if not k.endswith((b".zarray", b"zarr.json", b".zattrs"))]
    return sum(len(store.read(k).result().value) for k in keys)


@pytest.mark.slow
def test_array_data_is_stored_uncompressed_unless_compress(tmp_path):
    # Default: the bytes of every array as they are (orbax's zstd costs a quarter of a save's
    # CPU time for a few percent of a float32 state). compress=True: orbax's zstd, fewer bytes;
    # either restores the same values, and a run resumes from a compressed one.
    states = {}
    for compress in (False, True):
        module = Classifier(hidden=256)
        ckpt = callbacks.ModelCheckpoint(f"c{compress}", every_n_steps=4, compress=compress)
        make_fit("single", 4, [ckpt]).fit(module, loader())
        states[compress] = ocp.StandardCheckpointer().restore(
            os.path.abspath(f"c{compress}/4/state"))
        assert_bitwise(states[compress]["params"], params_of(module.model))
    raw = sum(x.nbytes for x in jax.tree.leaves(states[False]))
    plain, zstd = _stored_chunk_bytes("cFalse/4"), _stored_chunk_bytes("cTrue/4")
    assert plain >= raw, (plain, raw)
    assert zstd < 0.97 * raw, (zstd, raw)
    assert_bitwise(states[True], states[False])
    resumed = Classifier(hidden=256)
    make_fit("single", 8).fit(resumed, loader(), ckpt_path="cTrue/4")
    reference = Classifier(hidden=256)
    make_fit("single", 8).fit(reference, loader())
    assert_bitwise(params_of(resumed.model), params_of(reference.model))


@pytest.mark.slow
def test_rng_state_is_saved_and_resume_is_exact(tmp_path):
    # Dropout keeps a typed PRNG key and a counter in `rest`; they are stored as key data.
    reference = DropoutClassifier()
    make_fit("single", 10).fit(reference, loader())
    make_fit("single", 4, [callbacks.ModelCheckpoint("ckpt", async_save=False)]).fit(
        DropoutClassifier(), loader())
    meta = read_meta("ckpt/4")
    assert meta["prng_keys"] == {"['rest']['drop']['rngs']['key']": "threefry2x32"}
    module = DropoutClassifier()
    make_fit("single", 10).fit(module, loader(), ckpt_path="ckpt/4")
    assert_bitwise(params_of(module.model), params_of(reference.model))
    count = jax.device_get(module.model.drop.rngs.count[...])
    assert count == jax.device_get(reference.model.drop.rngs.count[...])


def _val_data():
    return jl.data.ArrayLoader(classification_data(64, seed=5), 32, shuffle=False,
                               drop_remainder=False)


def test_top_k_by_monitored_metric_and_best_and_last(tmp_path):
    logged = {}

    def record(fit, module, metrics, step):
        if "val_loss" in metrics:
            logged[step] = metrics["val_loss"]

    # mode="max" on a falling validation loss keeps the earliest checkpoints: the ranking,
    # not recency, decides; by default (save_last=None) the newest is kept as well.
    ckpt = callbacks.ModelCheckpoint("ckpt", every_n_steps=2, monitor="val_loss", mode="max",
                                     save_top_k=2)
    fit = make_fit("dp", 10, [ckpt, callbacks.LambdaCallback(on_log=record)],
                   val_check_interval=2, log_every_n_steps=1)
    fit.fit(Classifier(lr=5e-2), loader(), _val_data())
    assert sorted(logged) == [2, 4, 6, 8, 10]
    assert all(logged[a] > logged[b] for a, b in zip([2, 4, 6, 8], [4, 6, 8, 10], strict=True))
    assert complete_steps("ckpt") == [2, 4, 10]
    for step in (2, 4, 10):  # saved after the validation of its own step
        record_ = read_meta(f"ckpt/{step}")["monitor"]
        assert record_ == {"name": "val_loss", "value": logged[step], "mode": "max"}
    assert ckpt.best_step == 2 and ckpt.best_model_score == logged[2]

    from jaxlight.checkpoint._restore import resolve_checkpoint

    assert resolve_checkpoint(fit, "best") == os.path.abspath("ckpt/2")
    assert resolve_checkpoint(fit, "last") == os.path.abspath("ckpt/10")
    metrics = fit.validate(Classifier(lr=5e-2), _val_data(), ckpt_path="best")
    assert metrics["val_loss"] == pytest.approx(logged[2], rel=1e-6)


def test_save_top_k_all_keeps_checkpoints_saved_before_the_monitor_existed(tmp_path):
    # Step 2 is saved before the first validation (step 4) logs val_loss: keep-all keeps it.
    ckpt = callbacks.ModelCheckpoint("ckpt", every_n_steps=2, monitor="val_loss",
                                     save_top_k=-1, save_last=False)
    fit = make_fit("single", 8, [ckpt], val_check_interval=4, log_every_n_steps=1)
    fit.fit(Classifier(), loader(), _val_data())
    assert complete_steps("ckpt") == [2, 4, 6, 8]


def _nan_loader():
    """Inputs of batches 4+ (no shuffling) are NaN: the loss and the params go NaN."""
    data = classification_data(256)
    data["x"][4 * 32:] = np.nan
    return jl.data.ArrayLoader(data, 32, shuffle=False)


def test_nonfinite_monitored_value_never_replaces_a_good_checkpoint(tmp_path):
    ckpt = callbacks.ModelCheckpoint("ckpt", every_n_steps=1, monitor="loss", save_top_k=1)
    fit = make_fit("single", 8, [ckpt], log_every_n_steps=1)
    fit.fit(Classifier(), _nan_loader())
    assert math.isnan(fit.callback_metrics["loss"])
    best = ckpt.best_step
    # Batch 4 (step 5) is the first NaN one: step 5's own loss is NaN, so the best checkpoint
    # holds finite parameters.
    assert best is not None and best <= 4
    assert math.isfinite(read_meta(f"ckpt/{best}")["monitor"]["value"])
    assert complete_steps("ckpt") == [best, 8]  # the best (finite) and the last (NaN)
    assert math.isnan(read_meta("ckpt/8")["monitor"]["value"])
    from jaxlight.checkpoint._restore import resolve_checkpoint

    assert resolve_checkpoint(fit, "best") == os.path.abspath(f"ckpt/{best}")
    model = jl.load_checkpoint(resolve_checkpoint(fit, "best"), Classifier())
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params_of(model)))

    # Without save_last, a non-finite value is not even written.
    other = callbacks.ModelCheckpoint("ckpt2", every_n_steps=1, monitor="loss", save_last=False)
    make_fit("single", 8, [other], log_every_n_steps=1).fit(Classifier(), _nan_loader())
    assert complete_steps("ckpt2") == [other.best_step]


@pytest.mark.slow
def test_cross_strategy_restore_continues_the_loss_trajectory(tmp_path):
    losses = {}

    def recorder(name):
        def record(fit, module, metrics, step):
            if "loss" in metrics:
                losses.setdefault(name, {})[step] = metrics["loss"]

        return callbacks.LambdaCallback(on_log=record)

    ckpt = callbacks.ModelCheckpoint("ckpt", every_n_steps=4, save_top_k=-1)
    fsdp = make_fit("fsdp", 10, [ckpt, recorder("fsdp")], log_every_n_steps=1)
    fsdp.fit(AnnotatedClassifier(), loader())
    # Parameters really are sharded over 8 devices in the checkpoint's writer.
    kernel = fsdp.state.params["l1"]["kernel"]
    assert kernel.sharding.shard_shape(kernel.shape) == (2, 32)
    for target in ("single", "dp", "hybrid", "ddp"):
        fit = make_fit(target, 10, [recorder(target)], log_every_n_steps=1)
        fit.fit(AnnotatedClassifier(), loader(), ckpt_path="ckpt/4")
        assert sorted(losses[target]) == [5, 6, 7, 8, 9, 10]
        for step in range(5, 11):
            np.testing.assert_allclose(losses[target][step], losses["fsdp"][step], rtol=1e-5,
                                       err_msg=f"{target} step {step}")
    assert fit.global_step == 10


# -- bad input ---------------------------------------------------------------------------------


def test_ckpt_path_that_does_not_exist_says_what_was_looked_for(tmp_path):
    with pytest.raises(jl.CheckpointError, match=r"does not exist \(looked for .*nowhere/7\)"):
        make_fit("single", 2).fit(Classifier(), loader(), ckpt_path="nowhere/7")
    os.makedirs("empty")
    with pytest.raises(jl.CheckpointError, match="holds no complete checkpoint"):
        make_fit("single", 2).fit(Classifier(), loader(), ckpt_path="empty")
    with pytest.raises(jl.CheckpointError, match="no checkpoint in .* records a finite"):
        make_fit("single", 2).fit(Classifier(), loader(), ckpt_path="best")
    with pytest.warns(UserWarning, match="no complete checkpoint in .*checkpoints; training"):
        fit = make_fit("single", 2)
        fit.fit(Classifier(), loader(), ckpt_path="last")
    assert fit.global_step == 2


def test_checkpoint_of_a_different_model_names_paths_and_shapes(tmp_path):
    make_fit("single", 2, [callbacks.ModelCheckpoint("ckpt", async_save=False)]).fit(
        Classifier(hidden=32), loader())
    with pytest.raises(jl.CheckpointError,
                       match=r"\['params'\]\['l1'\]\['kernel'\] checkpoint \(16, 32\) vs model "
                             r"\(16, 48\)"):
        make_fit("single", 4).fit(Classifier(hidden=48), loader(), ckpt_path="ckpt")
    # Same parameters, but the model has RNG variables the checkpoint lacks.
    with pytest.raises(jl.CheckpointError,
                       match=r"in the model but not in the checkpoint: "
                             r"\['rest'\]\['drop'\]\['rngs'\]\['count'\] \(\)"):
        jl.load_checkpoint("ckpt", DropoutClassifier())


def test_monitor_never_logged_lists_the_logged_metrics(tmp_path):
    ckpt = callbacks.ModelCheckpoint("ckpt", every_n_steps=2, monitor="val_acc")
    with pytest.raises(jl.ConfigurationError,
                       match=r"val_acc.*Validation metrics: \[.*'val_accuracy'.*\]\. "
                             r"Did you mean "
                             r"'val_accuracy'"):
        make_fit("single", 4, [ckpt], val_check_interval=2).fit(Classifier(), loader(),
                                                                _val_data())
    assert complete_steps("ckpt") == []
    with pytest.raises(jl.ConfigurationError, match="got no val_data"):
        make_fit("single", 4, [callbacks.ModelCheckpoint("c2", monitor="val_loss")]).fit(
            Classifier(), loader())


def test_bad_arguments():
    with pytest.raises(jl.ConfigurationError, match="mode is 'min' or 'max'"):
        callbacks.ModelCheckpoint("c", mode="best")
    with pytest.raises(jl.ConfigurationError, match="choose one schedule"):
        callbacks.ModelCheckpoint("c", every_n_steps=2, every_n_epochs=1)
    with pytest.raises(jl.ConfigurationError, match="save_top_k"):
        callbacks.ModelCheckpoint("c", save_top_k=-2)
    with pytest.raises(jl.ConfigurationError, match=r"compress='zstd'\): give True or False"):
        callbacks.ModelCheckpoint("c", compress="zstd")
    with pytest.raises(jl.ConfigurationError, match="every_n_steps=0"):
        callbacks.ModelCheckpoint("c", every_n_steps=0)


def test_a_failed_background_deletion_is_reported_with_the_steps_kept(tmp_path, monkeypatch):
    # Older steps are deleted in orbax's background thread; a deletion that fails surfaces when
    # fit closes the directory, as a CheckpointError that lists what is there (fault injected
    # into orbax's deleter: running as root, permissions cannot make a deletion fail).
    from orbax.checkpoint._src.path import deleter

    def refuse(self, step):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(deleter.StandardCheckpointDeleter, "delete", refuse)
    fit = make_fit("single", 6, [callbacks.ModelCheckpoint("ckpt", every_n_steps=2)])
    with pytest.raises(jl.CheckpointError, match=r"closing the checkpoint directory .*ckpt "
                       r"failed: OSError: .*Read-only file system.* nothing saved is lost: "
                       r"the complete checkpoints there are steps \[2, 4, 6\]"):
        fit.fit(Classifier(), loader())


@pytest.mark.slow
def test_a_bf16_true_checkpoint_loads_into_a_float32_module(tmp_path):
    # A bf16-true fit saves bfloat16 parameters; a module built as usual (float32) must load
    # them for inference with their values, checked against the bfloat16 checksums. Before,
    # orbax cast on read and every checksum differed: DamagedCheckpoint on a sound checkpoint.
    ckpt = callbacks.ModelCheckpoint(str(tmp_path / "ckpt"), every_n_steps=3)
    fit = make_fit("single", 3, [ckpt], precision="bf16-true")
    module = Classifier()
    fit.fit(module, loader())
    trained = params_of(module.model)
    assert {x.dtype for x in jax.tree.leaves(trained)} == {np.dtype(jax.numpy.bfloat16)}
    for loaded in (Classifier.load_from_checkpoint(ckpt.last_model_path).model,
                   jl.load_checkpoint(ckpt.last_model_path, Classifier())):
        back = params_of(loaded)
        assert {x.dtype for x in jax.tree.leaves(back)} == {np.dtype(np.float32)}
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), b),
                     trained, back)
