"""Core loop: equivalence with a hand-written loop, compile counts, hooks, exact validation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks, strategies
from tests.models import Classifier, classification_data

STEPS = 20
BATCH = 32


def _loader(data, **kw):
    return jl.data.ArrayLoader(data, BATCH, seed=1, **kw)


def _fit(strategy, **kw):
    kw.setdefault("max_steps", STEPS)
    kw.setdefault("enable_progress_bar", False)
    kw.setdefault("enable_model_summary", False)
    kw.setdefault("logger", False)
    kw.setdefault("enable_checkpointing", False)  # the default's own tests are below
    return jl.Fit(strategy, **kw)


def _params(model):
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _hand_written(module, data, steps):
    """What a user would write without jaxlight: split once, jit a pure step, donate."""
    model = module.configure_model(nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = module.configure_optimizers()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        def loss_fn(p):
            return module.training_step(nnx.merge(graphdef, p, rest), batch)[0]

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    loader = _loader(data)
    it = iter(loader)
    for _ in range(steps):
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return jax.device_get(nnx.to_pure_dict(params)), losses


def _assert_close(a, b, rtol):
    """Relative error per parameter tensor, ||a - b|| / ||b|| <= rtol.

    Per tensor, not per element: a reordered fp32 sum (the all-reduce) moves an element near
    zero by ~1e-8 absolute, which is a large relative change of that one element only.
    """
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b),
                            strict=True):
        err = np.linalg.norm(np.asarray(x) - np.asarray(y)) / np.linalg.norm(np.asarray(y))
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e} > {rtol}"


@pytest.fixture(scope="module")
def data():
    return classification_data(n=300)


@pytest.fixture(scope="module")
def reference(data):
    return _hand_written(Classifier(), data, STEPS)


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_matches_hand_written_loop(strategy, data, reference):
    module = Classifier()
    losses = []
    log = callbacks.LambdaCallback(on_log=lambda f, m, metrics, step: losses.append(
        (step, metrics["loss"])))
    fit = _fit(strategy, log_every_n_steps=1, callbacks=[log])
    fit.fit(module, _loader(data))
    ref_params, ref_losses = reference
    # fp32: the same arithmetic on 1 or 8 devices; the all-reduce changes summation order only.
    _assert_close(_params(module.model), ref_params, rtol=1e-6)
    assert [s for s, _ in losses] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([v for _, v in losses], ref_losses, rtol=1e-6)
    if strategy == "dp":
        leaf = jax.tree.leaves(nnx.state(module.model, nnx.Param))[0]
        assert len(leaf.sharding.device_set) == 8


def test_data_parallel_batch_is_split_and_state_replicated(data):
    fit = _fit(strategies.DataParallel(), max_steps=2)
    fit.fit(Classifier(), _loader(data))
    batch_sh = fit.session.train_batch_shardings
    assert batch_sh["x"].spec[0] == "data"
    assert fit.strategy.mesh.shape == {"data": 8}
    for leaf in jax.tree.leaves(fit.state.params):
        assert leaf.sharding.is_fully_replicated
    assert fit.state.step == 2


def test_compiles_once_per_step_kind(data):
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        counts = {}
        # The first fit also pays one-off eager compiles (dtype conversions) outside the loop.
        for steps in (5, 10, 30):
            before = len(compiles)
            # XLA's compiles are counted: none may come from the persistent cache.
            fit = _fit("dp", max_steps=steps, val_check_interval=5, compilation_cache=False)
            fit.fit(Classifier(), _loader(data), _loader(data, shuffle=False,
                                                         drop_remainder=False))
            counts[steps] = len(compiles) - before
            # Evaluation compiles once per batch shape: 9 full batches of 32 and a last one of 12.
            assert fit.compile_counts == {"init": 1, "train": 1, "eval:validation_step": 2}
        # Three times the steps and validations, not one compile more.
        assert counts[10] == counts[30], counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


class Recorder(callbacks.Callback):
    def __init__(self):
        self.calls = []

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if (name.startswith("on_") or name in ("setup", "teardown")) and callable(attr):
            calls = object.__getattribute__(self, "calls")

            def record(*args, **kwargs):
                calls.append(name)
                return attr(*args, **kwargs)

            return record
        return attr


GOLDEN_FIT_HOOKS = [
    "setup", "on_fit_start",
    "on_sanity_check_start", "on_sanity_check_end",  # validation_step on 2 batches, no hooks
    "on_train_start",
    "on_train_epoch_start",
    "on_train_batch_start", "on_train_batch_end",
    "on_train_batch_start", "on_log", "on_train_batch_end",  # on_log: step 1, one step late
    "on_log",  # step 2 (log_every_n_steps=1), retired at epoch end
    # The epoch's validation before its on_train_epoch_end, as Lightning 2.x runs it.
    "on_validation_start", "on_validation_epoch_start",
    "on_validation_batch_end", "on_validation_batch_end",
    "on_log", "on_validation_epoch_end", "on_validation_end",
    "on_train_epoch_end",
    "on_save_checkpoint",  # the default ModelCheckpoint's save, last, as in Lightning 2.6.6
    "on_train_epoch_start",
    "on_train_batch_start", "on_train_batch_end",
    "on_train_batch_start", "on_log", "on_train_batch_end",
    "on_log",
    "on_validation_start", "on_validation_epoch_start",
    "on_validation_batch_end", "on_validation_batch_end",
    "on_log", "on_validation_epoch_end", "on_validation_end",
    "on_train_epoch_end",
    "on_save_checkpoint",
    "on_train_end", "on_fit_end", "teardown",
]


def test_hook_order_golden(data):
    rec = Recorder()
    small = {k: v[:64] for k, v in data.items()}
    fit = _fit("single", max_steps=None, max_epochs=2, log_every_n_steps=1, callbacks=[rec],
               enable_checkpointing=True)  # Lightning's default, with its saves' hooks
    fit.fit(Classifier(), _loader(small), _loader(small, shuffle=False))
    assert rec.calls == GOLDEN_FIT_HOOKS


def test_hook_order_on_exception(data):
    rec = Recorder()

    class Boom(Classifier):
        def training_step(self, model, batch):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _fit("single", callbacks=[rec]).fit(Boom(), _loader(data))
    # The step is traced (and raises) before on_train_start.
    assert rec.calls == ["setup", "on_fit_start", "on_exception", "teardown"]


@pytest.mark.parametrize("strategy", ["single", "dp"])
def test_validation_is_exact_with_partial_last_batch(strategy, data):
    module = Classifier()
    fit = _fit(strategy, max_steps=5)
    fit.fit(module, _loader(data))
    n = 100  # 3 full batches of 32 and one of 4, evaluated unpadded (whole on every device)
    val = {k: v[:n] for k, v in data.items()}
    metrics = fit.validate(module, _loader(val, shuffle=False, drop_remainder=False))
    logits = np.asarray(module.model(jnp.asarray(val["x"])))
    expected_loss = optax.softmax_cross_entropy_with_integer_labels(logits, val["y"]).mean()
    expected_acc = (logits.argmax(-1) == val["y"]).mean()
    assert metrics["val_loss"] == pytest.approx(float(expected_loss), rel=1e-5)
    assert metrics["val_accuracy"] == pytest.approx(float(expected_acc), rel=1e-6)
    assert fit.compile_counts["eval:validation_step"] == 2  # the full shape and the last one


def test_validation_masks_nan_in_padding(data):
    """A metric that is NaN for a padded example must not poison the exact mean."""

    class NanOnPad(Classifier):
        def validation_step(self, model, batch):
            # log(x) is NaN for negative inputs; padded rows copy the first example, so this
            # only checks that masked rows are excluded by selection, not multiplication.
            return {"first": jnp.log(jnp.abs(batch["x"][:, 0]) + 1.0).mean()}

    module = NanOnPad()
    fit = _fit("dp", max_steps=2)
    fit.fit(module, _loader(data))
    val = {k: v[:10] for k, v in data.items()}
    metrics = fit.validate(module, [val])
    expected = np.log(np.abs(val["x"][:, 0]) + 1.0).mean()
    assert metrics["val_first"] == pytest.approx(float(expected), rel=1e-5)


def test_predict_returns_unpadded_outputs(data):
    module = Classifier()
    fit = _fit("dp", max_steps=2)
    fit.fit(module, _loader(data))
    out = fit.predict(module, _loader({k: v[:70] for k, v in data.items()}, shuffle=False,
                                      drop_remainder=False))
    assert [o.shape for o in out] == [(32, 4), (32, 4), (6, 4)]


def test_hparams_and_model_after_fit(data):
    module = Classifier(hidden=8, lr=0.5)
    assert module.hparams == {"din": 16, "hidden": 8, "classes": 4, "lr": 0.5}
    with pytest.raises(AttributeError, match="not built yet"):
        _ = module.model
    _fit("single", max_steps=1).fit(module, _loader(data))
    assert module.model.l1.kernel.shape == (16, 8)


def test_default_callbacks_write_csv(data, tmp_path):
    fit = jl.Fit("single", max_steps=4, log_every_n_steps=2, default_root_dir=str(tmp_path),
                 enable_progress_bar=True)
    fit.fit(Classifier(), _loader(data))
    names = [type(cb).__name__ for cb in fit.callbacks]
    # Lightning's defaults (enable_checkpointing=True adds a ModelCheckpoint, last).
    assert names == ["ModelSummary", "TQDMProgressBar", "CSVLogger", "ModelCheckpoint"]
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    assert set(rows[0].split(",")) == {"step", "loss", "accuracy", "epoch"}
    assert [r.split(",")[0] for r in rows[1:]] == ["2", "4"]


def test_max_epochs_and_limit_train_batches(data):
    fit = _fit("single", max_steps=None, max_epochs=3, limit_train_batches=2)
    fit.fit(Classifier(), _loader(data))
    assert fit.global_step == 6 and fit.current_epoch == 3


def test_fast_dev_run(data):
    fit = jl.Fit("dp", fast_dev_run=True, enable_progress_bar=False)
    fit.fit(Classifier(), _loader(data), _loader(data, shuffle=False))
    assert fit.global_step == 1
    assert "val_loss" in fit.callback_metrics


def test_generic_iterable_of_numpy_batches(data):
    batches = [{k: v[i * BATCH:(i + 1) * BATCH] for k, v in data.items()} for i in range(4)]
    fit = _fit("dp", max_steps=None, max_epochs=2)
    fit.fit(Classifier(), batches)
    assert fit.global_step == 8


def test_request_stop_from_callback(data):
    stopper = callbacks.LambdaCallback(
        on_train_batch_end=lambda f, m, out, b, i: f.request_stop("enough")
        if f.global_step == 3 else None)
    fit = _fit("single", callbacks=[stopper])
    fit.fit(Classifier(), _loader(data))
    assert fit.global_step == 3 and fit.should_stop


# -- bad input: each refused before compiling, with the numbers ---------------------------------


def test_error_batch_not_divisible_by_data_parallel_degree(data):
    fit = _fit("dp")
    loader = jl.data.ArrayLoader(data, 30)
    with pytest.raises(jl.DataError, match=r"global batch size 30 .* data-parallel degree 8.*"
                                           r"multiple of 8 \(for example 24 or 32\)"):
        fit.fit(Classifier(), loader)
    assert "train" not in fit.compile_counts


def test_error_no_length_given(data):
    fit = jl.Fit("single")  # enough to validate, test or predict (as a Lightning Trainer)
    with pytest.raises(jl.ConfigurationError,
                       match="Fit.fit needs max_steps, max_epochs or max_time"):
        fit.fit(Classifier(), _loader(data))


@pytest.mark.parametrize("bad, match", [
    (lambda loss: jnp.ones(3) * loss, r"loss of shape \(3,\); the loss must be a scalar"),
    (lambda loss: (loss, loss, loss), "tuple of length 3"),
    (lambda loss: {"loss": loss}, "returned dict"),
    (lambda loss: (loss, {"acc": jnp.ones(2)}), r"metric 'acc' has shape \(2,\)"),
])
def test_error_training_step_output(bad, match, data):
    class Bad(Classifier):
        def training_step(self, model, batch):
            loss, _ = super().training_step(model, batch)
            return bad(loss)

    fit = _fit("single")
    with pytest.raises(jl.StepOutputError, match=match):
        fit.fit(Bad(), _loader(data))


def test_error_batch_structure_changes(data):
    # One leaf shrinks: not a last partial batch (which is trained on, as in Lightning).
    batches = [{"x": data["x"][:32], "y": data["y"][:32]},
               {"x": data["x"][:16], "y": data["y"][:32]}]
    fit = _fit("single", max_steps=5)
    with pytest.raises(jl.DataError, match=r"batch 1 of epoch 0 .*\(16, 16\).*compiled for .*"
                                           r"\(32, 16\)"):
        fit.fit(Classifier(), batches)


def test_error_empty_training_iterable():
    fit = _fit("single")
    with pytest.raises(jl.DataError, match="yielded no batch"):
        fit.fit(Classifier(), [])
    assert fit.compile_counts.get("train") is None


def test_error_unknown_strategy_suggests():
    with pytest.raises(jl.ConfigurationError, match="Did you mean 'single'"):
        jl.Fit("singel", max_steps=1)


def test_error_one_shot_iterator_second_epoch(data):
    batches = iter([{k: v[:32] for k, v in data.items()}] * 2)
    fit = _fit("single", max_steps=None, max_epochs=2)
    with pytest.raises(jl.DataError, match="one-shot iterator"):
        fit.fit(Classifier(), batches)


def test_error_loader_arguments(data):
    with pytest.raises(jl.DataError, match="share their first dimension"):
        jl.data.ArrayLoader({"x": data["x"], "y": data["y"][:10]}, 8)
    with pytest.raises(jl.DataError, match="fewer than one batch"):
        jl.data.ArrayLoader({"x": data["x"][:4]}, 8)


def test_loader_is_deterministic_and_resumable(data):
    a = jl.data.ArrayLoader(data, 32, seed=3)
    first = [b["y"] for b in a]
    second = [b["y"] for b in a]  # epoch 1: a different permutation
    assert not all(np.array_equal(x, y) for x, y in zip(first, second, strict=True))
    b = jl.data.ArrayLoader(data, 32, seed=3)
    it = iter(b)
    next(it), next(it)
    state = b.state_dict()
    c = jl.data.ArrayLoader(data, 32, seed=3)
    c.load_state_dict(state)
    np.testing.assert_array_equal(next(iter(c))["y"], first[2])
