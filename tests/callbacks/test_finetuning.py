"""BaseFinetuning / BackboneFinetuning: per-parameter optimizer states sharded like the
parameters, one compile, and the errors (tests/conformance/test_callbacks3.py compares them
with Lightning and resumes them)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks


class Net(nnx.Module):
    def __init__(self, rngs):
        self.backbone = nnx.Linear(8, 16, rngs=rngs)
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.backbone(x)))


class Module(jl.TrainModule):
    def __init__(self, tx=None, plain=False):
        super().__init__()
        self.tx, self.plain = tx, plain

    def configure_model(self, rngs):
        return nnx.Linear(8, 8, rngs=rngs) if self.plain else Net(rngs)

    def configure_optimizers(self):
        return self.tx or optax.adam(0.01)

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _data():
    rng = np.random.default_rng(0)
    return jl.data.DataLoader({"x": rng.normal(size=(32, 8)).astype(np.float32),
                               "y": rng.normal(size=(32, 8)).astype(np.float32)}, 16)


def _fit(strategy="single", cb=None, **kw):
    kw.setdefault("max_epochs", 2)
    return jl.Fit(strategy, enable_progress_bar=False, logger=False, enable_model_summary=False,
                  enable_checkpointing=False, callbacks=[cb or callbacks.BackboneFinetuning(1)],
                  **kw)


def test_states_are_sharded_like_the_parameters_and_the_backbone_waits():
    fit = _fit("fsdp")
    fit.fit(Module(), _data())
    assert fit.compile_counts["train"] == 1
    mus = [x for x in jax.tree.leaves(fit.state.opt_state) if getattr(x, "shape", ()) == (8, 16)]
    assert mus and all(m.sharding == fit.state.params["backbone"]["kernel"].sharding
                       for m in mus)
    assert fit.state.params["backbone"]["kernel"].sharding.spec != jax.sharding.PartitionSpec()


def test_frozen_parameters_do_not_move_until_they_join():
    seen = {}
    start = callbacks.LambdaCallback(
        on_fit_start=lambda fit, module: seen.update(jax.device_get(fit.state.params)))
    fit = jl.Fit("single", max_epochs=1, enable_progress_bar=False, logger=False,
                 enable_model_summary=False, enable_checkpointing=False,
                 callbacks=[callbacks.BackboneFinetuning(1), start])
    fit.fit(Module(), _data())
    after = jax.device_get(fit.state.params)
    np.testing.assert_array_equal(after["backbone"]["kernel"], seen["backbone"]["kernel"])
    assert not np.array_equal(after["head"]["kernel"], seen["head"]["kernel"])


def test_a_model_without_backbone_is_refused():
    with pytest.raises(jl.ConfigurationError, match="attribute `backbone`"):
        _fit().fit(Module(plain=True), _data())


def test_max_epochs_is_needed():
    with pytest.raises(jl.ConfigurationError, match="max_epochs"):
        _fit(max_epochs=None, max_steps=2).fit(Module(), _data())


def test_a_scheduled_rate_is_refused():
    with pytest.raises(jl.ConfigurationError, match="schedule"):
        _fit().fit(Module(optax.adam(optax.linear_schedule(0.01, 0.0, 10))), _data())


class _BNNet(nnx.Module):
    def __init__(self, rngs):
        self.backbone = nnx.Sequential(nnx.Linear(8, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs),
                                       nnx.Linear(16, 16, rngs=rngs))
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.backbone(x)))


class _BNModule(Module):
    def configure_model(self, rngs):
        return _BNNet(rngs)


class _Unfreeze(callbacks.BaseFinetuning):
    def __init__(self, train_bn):
        super().__init__()
        self.train_bn, self.added = train_bn, []

    def freeze_before_training(self, module):
        self.freeze(module.model.backbone, train_bn=False)

    def finetune_function(self, module, epoch, optimizer):
        if epoch == 1:
            self.unfreeze_and_add_param_group(module.model.backbone, optimizer,
                                              train_bn=self.train_bn)
            self.added = [p for p in optimizer.param_groups[-1]["params"]]


@pytest.mark.parametrize("train_bn", [False, True])
def test_unfreezing_adds_batchnorm_parameters_only_with_train_bn(train_bn):
    """Lightning 2.6.6's `unfreeze_and_add_param_group(net, opt, train_bn=False)` leaves a
    BatchNorm's weight and bias out of the new group and adds them with `train_bn=True`
    (`freeze(..., train_bn=True)` is the one that keeps them trainable); the flag was read
    inverted here, so train_bn=False added them."""
    cb = _Unfreeze(train_bn)
    _fit(cb=cb).fit(_BNModule(), _data())
    batchnorm = {p for p in cb.added if p[:3] == ("backbone", "layers", 1)}
    assert len(cb.added) == 4 + 2 * train_bn, cb.added
    assert batchnorm == ({("backbone", "layers", 1, "scale"), ("backbone", "layers", 1, "bias")}
                         if train_bn else set())
