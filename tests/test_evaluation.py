"""Evaluation on whole batches: the step sees the real batch; metrics are exact over the dataset
(weighted scalar means, clu metrics merged on device) under every strategy, with a short last
batch that is never padded."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from clu import metrics as clu_metrics
from flax import nnx

import jaxlight as jl
from jaxlight._errors import ConfigurationError, StepOutputError
from jaxlight.data import ArrayLoader
from tests.models import Classifier, classification_data

VOCAB, LENGTH, BATCH = 64, 12, 16


def _fit(strategy, **kw):
    return jl.Fit(strategy, max_steps=kw.pop("max_steps", 1), enable_progress_bar=False,
                  enable_model_summary=False, logger=False, enable_checkpointing=False, **kw)


class TokenModel(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Embed(VOCAB, 128, rngs=rngs)  # 8192 elements: FSDP shards it
        self.out = nnx.Linear(128, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        return self.out(jnp.tanh(self.embed(tokens)))


def _token_losses(model, batch):
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:])


class MaskedLM(jl.TrainModule):
    """Sequences of different lengths: the loss is a mean over real tokens, not over sequences."""

    def configure_model(self, rngs):
        return TokenModel(rngs)

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def training_step(self, model, batch):
        mask = batch["mask"][:, 1:]
        return (_token_losses(model, batch) * mask).sum() / mask.sum()

    def validation_step(self, model, batch):
        mask = batch["mask"][:, 1:]
        tokens = mask.sum()
        loss = (_token_losses(model, batch) * mask).sum() / tokens
        # The same token-weighted mean twice: self.log weighted by the batch's token count, and
        # a clu Average over the unmasked tokens.
        self.log("val_token_loss", loss, batch_size=tokens)
        return {"clu_loss": clu_metrics.Average.from_model_output(_token_losses(model, batch),
                                                                  mask=mask),
                "rows": jnp.float32(batch["tokens"].shape[0])}


def token_data(n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=(n, LENGTH)).astype(np.int32)
    lengths = rng.integers(2, LENGTH + 1, size=n)
    mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.float32)
    return {"tokens": tokens, "mask": mask}


@jax.jit
def _exact_token_loss(model, data):
    losses = _token_losses(model, data)
    mask = data["mask"][:, 1:]
    return (losses * mask).sum() / mask.sum(), ((losses * mask).sum(1) / mask.sum(1)).mean()


@pytest.fixture(scope="module", params=["single", "dp", "fsdp", "ddp"])
def token_fit(request):
    module = MaskedLM()
    fit = _fit(request.param)
    fit.fit(module, ArrayLoader(token_data(64), BATCH, seed=0))
    return request.param, fit, module


@pytest.mark.parametrize("n", [37, 40])
def test_masked_token_loss_is_exact(token_fit, n):
    """37 = 16 + 16 + 5 (5 does not split over 8 devices), 40 = 16 + 16 + 8 (it does)."""
    strategy, fit, module = token_fit
    if strategy in ("single", "fsdp") and n == 40:
        pytest.skip("the sharded short batch is exercised under dp and ddp")
    val = token_data(n, seed=1)
    metrics = fit.validate(module, ArrayLoader(val, BATCH, shuffle=False, drop_remainder=False))
    exact, per_sequence = jax.device_get(_exact_token_loss(module.model, val))
    # Per-sequence means averaged over sequences (what a per-example evaluation computes) are a
    # different number; the test would not tell them apart otherwise.
    assert abs(per_sequence - exact) > 1e-3
    assert metrics["val_token_loss"] == pytest.approx(float(exact), rel=1e-6)
    assert metrics["val_clu_loss"] == pytest.approx(float(exact), rel=1e-6)
    if strategy != "ddp":  # under DDP each replica's step sees its share, as in PyTorch DDP
        # Each batch's rows, weighted by its rows: the step saw 16, 16 and the real last size.
        last = n - 2 * BATCH
        assert metrics["val_rows"] == pytest.approx((2 * BATCH**2 + last**2) / n, rel=1e-6)


def test_validation_step_sees_the_real_batch():
    seen = []

    class Shapes(Classifier):
        def validation_step(self, model, batch):
            seen.append(batch["x"].shape)  # at trace time: once per batch shape
            return {"rows": batch["x"].shape[0]}

    module = Shapes()
    fit = _fit("dp")
    data = classification_data(64)
    fit.fit(module, ArrayLoader(data, 32))
    metrics = fit.validate(module, ArrayLoader(classification_data(45), 16, shuffle=False,
                                               drop_remainder=False))
    assert sorted({s[0] for s in seen}) == [13, 16]
    assert metrics["val_rows"] == pytest.approx((2 * 16 * 16 + 13 * 13) / 45)
    fit.validate(module, ArrayLoader(classification_data(45), 16, shuffle=False,
                                     drop_remainder=False))
    assert fit.compile_counts["eval:validation_step"] == 2  # a second evaluation: cached


def test_predict_step_sees_the_real_batch():
    seen = []

    class Shapes(Classifier):
        def predict_step(self, model, batch):
            seen.append(batch["x"].shape[0])
            return model(batch["x"]) - model(batch["x"]).mean(0)  # a batch-level statistic

    module = Shapes()
    fit = _fit("dp")
    fit.fit(module, ArrayLoader(classification_data(64), 32))
    val = classification_data(45)
    out = fit.predict(module, ArrayLoader(val, 16, shuffle=False, drop_remainder=False))
    assert sorted(set(seen)) == [13, 16] and [o.shape for o in out] == [(16, 4)] * 2 + [(13, 4)]
    logits = np.asarray(jax.jit(lambda m, x: m(x))(module.model, val["x"][32:]))
    np.testing.assert_allclose(out[2], logits - logits.mean(0), rtol=1e-5, atol=1e-6)


# -- clu metrics ----------------------------------------------------------------------------


@flax.struct.dataclass
class Confusion(clu_metrics.Metric):
    """A confusion matrix; computes macro F1 (a clu Metric: merged with clu's reduce under DDP)."""

    matrix: jax.Array

    @classmethod
    def empty(cls):
        return cls(matrix=jnp.zeros((4, 4), jnp.int32))

    @classmethod
    def from_model_output(cls, logits, labels, **_):
        pred = logits.argmax(-1)
        return cls(matrix=jnp.zeros((4, 4), jnp.int32).at[labels, pred].add(1))

    def merge(self, other):
        return type(self)(matrix=self.matrix + other.matrix)

    def compute(self):
        m = self.matrix.astype(jnp.float32)
        tp = jnp.diag(m)
        precision = tp / jnp.maximum(m.sum(0), 1)
        recall = tp / jnp.maximum(m.sum(1), 1)
        f1 = jnp.where(precision + recall > 0,
                       2 * precision * recall / jnp.maximum(precision + recall, 1e-12), 0.0)
        return f1.mean()


@flax.struct.dataclass
class BinaryPR:
    """Not a clu class, only merge/compute: precision and recall of class 0."""

    tp: jax.Array
    fp: jax.Array
    fn: jax.Array

    def merge(self, other):
        return BinaryPR(self.tp + other.tp, self.fp + other.fp, self.fn + other.fn)

    def compute(self):
        return {"precision": self.tp / (self.tp + self.fp), "recall": self.tp / (self.tp + self.fn)}


class WithMetrics(Classifier):
    def validation_step(self, model, batch):
        logits = model(batch["x"])
        pred, y = logits.argmax(-1), batch["y"]
        pr = BinaryPR(((pred == 0) & (y == 0)).sum(), ((pred == 0) & (y != 0)).sum(),
                      ((pred != 0) & (y == 0)).sum())
        self.log("val_f1", Confusion.from_model_output(logits, y))
        return {"pr": pr, "accuracy": (pred == y).mean()}


    Metrics = clu_metrics.Collection.create(f1=Confusion, accuracy=clu_metrics.Accuracy)

    def test_step(self, model, batch):
        logits = model(batch["x"])
        return self.Metrics.single_from_model_output(logits=logits, labels=batch["y"])


# The whole suite (sklearn's import and two fits; the fast tier evaluates with a clu Average,
# merged across DDP's replicas too, in test_masked_token_loss_is_exact).
@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.slow)
                                      for s in ("single", "ddp")])
def test_clu_metrics_equal_sklearn(strategy):
    from sklearn import metrics as skm  # optional dependency, test-only

    data = classification_data(128)
    val = classification_data(77, seed=3)
    module = WithMetrics(lr=3e-3)
    fit = _fit(strategy, max_steps=3)
    fit.fit(module, ArrayLoader(data, 32))
    loader = ArrayLoader(val, 32, shuffle=False, drop_remainder=False)
    metrics = fit.validate(module, loader)
    pred = np.asarray(jax.jit(lambda m, x: m(x).argmax(-1))(module.model, val["x"]))
    y = val["y"]
    # Batch-level F1s averaged would differ from the dataset's F1: non-decomposable.
    assert metrics["val_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro"), rel=1e-6)
    assert metrics["val_pr_precision"] == pytest.approx(
        skm.precision_score(y == 0, pred == 0), rel=1e-6)
    assert metrics["val_pr_recall"] == pytest.approx(skm.recall_score(y == 0, pred == 0),
                                                     rel=1e-6)
    assert metrics["val_accuracy"] == pytest.approx(skm.accuracy_score(y, pred), rel=1e-6)

    metrics = fit.test(module, loader)  # test_step returns a clu Collection
    assert metrics["test_f1"] == pytest.approx(skm.f1_score(y, pred, average="macro"), rel=1e-6)
    assert metrics["test_accuracy"] == pytest.approx(skm.accuracy_score(y, pred), rel=1e-6)


# -- errors ---------------------------------------------------------------------------------


def _validate(module_cls, n=40):
    module = module_cls()
    fit = _fit("single")
    return fit.validate(module, ArrayLoader(classification_data(n), 16, shuffle=False,
                                            drop_remainder=False))


def test_on_step_in_evaluation_is_refused():
    class PerStep(Classifier):
        def validation_step(self, model, batch):
            self.log("val_x", model(batch["x"]).mean(), on_step=True)

    with pytest.raises(ConfigurationError, match="on_step=True in an evaluation step"):
        _validate(PerStep)


def test_growing_metric_is_refused():
    class Collecting(Classifier):
        def validation_step(self, model, batch):
            return {"all": clu_metrics.CollectingMetric.from_outputs(("y",)).from_model_output(
                y=batch["y"])}

    with pytest.raises(StepOutputError, match="fixed-size metric"):
        _validate(Collecting)


def test_log_outside_a_step_is_refused():
    with pytest.raises(ConfigurationError, match="outside a step"):
        Classifier().log("x", 1.0)


@pytest.mark.slow
def test_pipelined_short_last_batch_matches_single_device():
    """GPipe: a last batch that does not split into microbatches runs as a single one."""
    from jaxlight import strategies
    from tests.strategies.lm import TinyLM, token_batches

    val = token_batches(1, batch=6, length=9, seed=2)  # full batches: tests/strategies/test_gpipe
    results = []
    for strategy in (strategies.SingleDevice(), strategies.GPipe(stages=2, microbatches=4)):
        # No training: both evaluate the same freshly initialized parameters (seed 0).
        results.append(_fit(strategy).validate(TinyLM(layers=2, embed=16, mlp=32),
                                               val)["val_loss"])
    assert results[1] == pytest.approx(results[0], rel=1e-5)
