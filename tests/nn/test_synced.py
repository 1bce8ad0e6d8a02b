"""`jl.nn.SyncedCopy`: a copy that follows a network inside the compiled step (a DQN target, a
momentum encoder), never trained, carried and checkpointed with the model (issue 46)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from tests.models import MLP, classification_data


class _Pair(nnx.Module):
    def __init__(self, rngs):
        self.net = MLP(16, 8, 4, rngs=rngs)
        self.target = jl.nn.SyncedCopy(MLP(16, 8, 4, rngs=rngs))  # its own initialization


class _Periodic(jl.TrainModule):
    def configure_model(self, rngs):
        return _Pair(rngs)

    def configure_optimizers(self):
        return optax.sgd(0.1)

    def training_step(self, model, batch):
        logits = model.net(batch["x"]) + model.target(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
        model.target.sync(model.net, every=3)  # after the loss, as Lightning's DQN
        return loss


def _kernels(net) -> np.ndarray:
    return np.asarray(jax.device_get(net.l1.kernel[...])).copy()


class _Record(callbacks.Callback):
    def __init__(self):
        self.net_before, self.target_after = [], []

    def on_train_batch_start(self, fit, module, batch, batch_idx):
        self.net_before.append(_kernels(module.model.net))

    def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
        self.target_after.append(_kernels(module.model.target.net))


def test_every_n_copies_the_network_as_it_entered_every_nth_step_and_checkpoints(tmp_path):
    record = _Record()
    module = _Periodic()
    fit = jl.Fit("single", max_steps=7, enable_progress_bar=False, logger=False,
                 enable_model_summary=False,
                 callbacks=[record, callbacks.ModelCheckpoint(str(tmp_path), every_n_steps=7)])
    fit.fit(module, jl.data.ArrayLoader(classification_data(256), 32))
    for t, target in enumerate(record.target_after):
        np.testing.assert_array_equal(target, record.net_before[t - t % 3], err_msg=f"step {t}")
    assert not np.array_equal(record.net_before[6], _kernels(module.model.net))  # trained on
    # Not trained: the optimizer sees the online network's parameters only.
    assert set(fit.session.spec.abstract_state.params) == {"net"}
    restored = _Periodic.load_from_checkpoint(str(tmp_path))
    np.testing.assert_array_equal(_kernels(restored.model.target.net), record.target_after[-1])
    assert int(restored.model.target.count[...]) == 7


def test_tau_moves_the_copy_a_fraction_toward_the_network():
    pair = _Pair(nnx.Rngs(0))
    old, online = _kernels(pair.target.net), _kernels(pair.net)
    # Compiled, as in a training step (eagerly, each op was an XLA compile of its own).
    copied = nnx.jit(lambda p: p.target.sync(p.net, tau=0.25))(pair)
    np.testing.assert_allclose(_kernels(pair.target.net), 0.25 * online + 0.75 * old, rtol=1e-6)
    assert bool(copied) and int(pair.target.count[...]) == 1
    # No gradient flows into the copy.
    grads = nnx.jit(nnx.grad(
        lambda m: m.target(jnp.ones((1, 16))).sum(),
        argnums=nnx.DiffState(0, nnx.All(jl.nn.Synced, nnx.PathContains("net")))))(pair)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads))


@pytest.mark.slow
def test_the_copy_follows_alike_under_every_data_parallel_strategy():
    finals = {}
    for strategy in ("single", "dp", "fsdp", "ddp"):
        module = _Periodic()
        jl.Fit(strategy, max_steps=4, enable_progress_bar=False, logger=False,
               enable_model_summary=False, enable_checkpointing=False).fit(
            module, jl.data.ArrayLoader(classification_data(128), 32, shuffle=False))
        assert int(module.model.target.count[...]) == 4, strategy
        finals[strategy] = _kernels(module.model.target.net)
    for strategy, kernel in finals.items():  # synced at step 3 from the net trained 3 steps
        np.testing.assert_allclose(kernel, finals["single"], rtol=1e-5, atol=1e-6,
                                   err_msg=strategy)
