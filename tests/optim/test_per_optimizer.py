"""Gradient clipping, NonFiniteGuard and 16-mixed loss scaling act per named optimizer under
automatic optimization: each optimizer's parameters are clipped by their own norm, and one
optimizer's non-finite gradients skip only its update (its parameters and optimizer state
unchanged, the others updated). Checked against hand computations with optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from tests.optim.test_manual import Pair, loss_b

X = np.linspace(-1, 1, 8, dtype=np.float32).reshape(8, 1)
STEPS = 4
POISONED = 1  # the step whose "a" gradients are Inf


def _batches():
    return [{"x": X, "y": 2 * X + 1,
             "s": np.full((8, 1), np.inf if i == POISONED else 0.0, np.float32)}
            for i in range(STEPS)]


def _txs():
    return {"a": optax.sgd(0.1, momentum=0.9), "b": optax.adam(0.05)}


def _loss(model, batch):
    # "s" multiplies a's kernel: its gradient is Inf on the poisoned step, 0 otherwise, and
    # b's gradient never depends on it.
    return loss_b(model, batch) + (model.a.kernel.sum() * batch["s"]).mean()


class Named(jl.TrainModule):
    def configure_model(self, rngs):
        return Pair(rngs)

    def configure_optimizers(self):
        return [{"name": n, "params": n, "optimizer": tx} for n, tx in _txs().items()]

    def training_step(self, model, batch):
        return _loss(model, batch)


def _fit(cbs, strategy="single"):
    logged = {}
    log = callbacks.LambdaCallback(
        on_log=lambda fit, m, metrics, step: logged.__setitem__(step, metrics))
    fit = jl.Fit(strategy, max_steps=STEPS, log_every_n_steps=1, callbacks=[log, *cbs],
                 enable_progress_bar=False, enable_model_summary=False, logger=False,
                 enable_checkpointing=False)
    module = Named()
    fit.fit(module, _batches())
    return logged, nnx.to_pure_dict(nnx.state(module.model, nnx.Param))


def _by_hand(clip: float | None = None):
    """The same steps with optax, one optimizer per sub-module: a non-finite group keeps its
    parameters and optimizer state; with `clip`, each group's gradients are clipped by their
    own global norm."""
    model = Pair(nnx.Rngs(0))
    graphdef = nnx.graphdef(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    txs = _txs()
    states = {n: txs[n].init(params[n]) for n in txs}
    # Compiled once (eagerly each op was an XLA compile of its own); the steps stay on the host.
    grad = jax.jit(jax.grad(lambda p, batch: _loss(nnx.merge(graphdef, p), batch)))
    updates_of = {n: jax.jit(tx.update) for n, tx in txs.items()}
    norms = []
    for batch in _batches():
        grads = grad(params, batch)
        norms.append({})
        for n in txs:
            g = grads[n]
            norm = optax.tree.norm(g)
            norms[-1][n] = float(norm)
            if clip is not None and norm > clip:
                g = jax.tree.map(lambda x: x * (clip / norm), g)
            if not all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(g)):
                continue
            updates, states[n] = updates_of[n](g, states[n], params[n])
            params = {**params, n: optax.apply_updates(params[n], updates)}
    return params, norms


def _assert_params(got, want, **tol):
    for n in want:
        for k in want[n]:
            np.testing.assert_allclose(got[n][k], want[n][k], err_msg=f"{n}.{k}", **tol)


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_nonfinite_gradients_of_one_optimizer_skip_only_its_update(strategy):
    logged, params = _fit([callbacks.NonFiniteGuard(max_consecutive=3)], strategy)
    want, _ = _by_hand()
    _assert_params(params, want, rtol=1e-6, atol=1e-7)
    # the skip is counted once, for "a"; b moved on every step
    assert logged[POISONED + 1]["nonfinite_skipped"] == 1
    assert logged[STEPS]["nonfinite_skipped"] == 1
    assert logged[STEPS]["nonfinite_consecutive"] == 0


def test_clipping_uses_each_optimizers_own_norm():
    _, norms = _by_hand()
    clip = 0.5 * min(min(step.values()) for i, step in enumerate(norms) if i != POISONED)
    logged, params = _fit([callbacks.GradientClipping(clip),
                           callbacks.NonFiniteGuard(max_consecutive=3)])
    want, norms = _by_hand(clip=clip)
    _assert_params(params, want, rtol=1e-6, atol=1e-7)
    # both groups were clipped on every finite step (each by its own norm)
    assert logged[1]["grad_norm-a"] == pytest.approx(norms[0]["a"], rel=1e-6)
    assert logged[1]["grad_norm-b"] == pytest.approx(norms[0]["b"], rel=1e-6)
    assert logged[1]["grad_norm"] == pytest.approx(np.hypot(norms[0]["a"], norms[0]["b"]),
                                                   rel=1e-6)


def test_16_mixed_overflow_of_one_optimizer_skips_only_its_update():
    # a scale small enough that only the poisoned step overflows
    logged, params = _fit([callbacks.MixedPrecision("16-mixed", init_scale=2.0 ** 10),
                           callbacks.NonFiniteGuard(max_consecutive=3)])
    scales = [logged[s]["loss_scale"] for s in range(1, STEPS + 1)]
    assert scales == [2.0 ** 10] * (POISONED + 1) + [2.0 ** 9] * (STEPS - POISONED - 1)
    assert logged[STEPS]["overflow_skipped"] == 1
    assert logged[STEPS]["nonfinite_skipped"] == 0  # overflow is the loss scale's
    want, _ = _by_hand()
    # float16 compute: the same trajectory to float16's precision; a's skip is the hand
    # computation's (without it, b's and a's parameters would be far off)
    _assert_params(params, want, rtol=2e-2, atol=2e-3)
