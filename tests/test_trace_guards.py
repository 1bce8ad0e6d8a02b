"""Trace-time guards (issue 46 item 3): Lightning code that a step traced once would silently turn
into constants is refused (or warned about) at the first step, naming the line and the jaxlight
form. The natural DQN port (the agent playing inside training_step, a target network on self
re-synced from a hook) is refused with a message leading to docs/rl.md's form."""

from __future__ import annotations

import collections
import functools
import random
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from tests.models import MLP, Classifier, classification_data
from tests.test_mistakes import _Steps  # the steps taken (a refusal comes before the first)


def _fit(**kw) -> jl.Fit:
    kw.setdefault("max_steps", 4)
    # The default checkpoint's saves only where a test gives a ModelCheckpoint.
    kw.setdefault("enable_checkpointing", any(
        isinstance(cb, callbacks.ModelCheckpoint) for cb in kw.get("callbacks", ())))
    return jl.Fit("single", enable_progress_bar=False, enable_model_summary=False, logger=False,
                  num_sanity_val_steps=0, **kw)


def _data(n=128, batch=32):
    return jl.data.ArrayLoader(classification_data(n), batch)


# -- (f) a Python branch on a traced value -------------------------------------------------


def test_if_on_a_traced_loss_names_the_line_and_jnp_where():
    class Halving(Classifier):
        def training_step(self, model, batch):
            loss, metrics = super().training_step(model, batch)
            if loss > 1:
                loss = loss / 2
            return loss, metrics

    steps = _Steps()
    with pytest.raises(jl.PortingError, match=r"Halving\.training_step branches with Python on a "
                       r"traced value at .*test_trace_guards\.py:\d+ \(`if loss > 1:`\).*"
                       r"jnp\.where\(cond, a, b\).*jax\.lax\.cond") as info:
        _fit(callbacks=[steps]).fit(Halving(), _data())
    assert steps.steps == []
    assert type(info.value.__cause__).__name__ == "TracerBoolConversionError"


# -- (a) host side effects in the step -----------------------------------------------------


def test_a_counter_on_self_in_the_step_is_refused_at_its_line():
    class Counting(Classifier):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def training_step(self, model, batch):
            self.calls += 1
            return super().training_step(model, batch)

    steps = _Steps()
    with pytest.raises(jl.PortingError, match=r"Counting\.training_step changed host state while "
                       r"jaxlight traced it:\n  self\.calls: 0 -> 1, at .*test_trace_guards\.py:"
                       r"\d+ \(`self\.calls \+= 1`\)(.|\n)*ran once, at the trace(.|\n)*"
                       r"on_train_batch_start"):
        _fit(callbacks=[steps]).fit(Counting(), _data())
    assert steps.steps == []


@pytest.mark.parametrize("draw", ["numpy", "python"])
def test_a_host_random_draw_in_the_step_is_refused(draw):
    # The GAN port whose noise came from the host: one draw, compiled in as a constant.
    class Noisy(Classifier):
        def training_step(self, model, batch):
            if draw == "numpy":
                noise = np.random.normal(size=batch["x"].shape).astype(np.float32)
            else:
                noise = random.gauss(0.0, 1.0)
            return super().training_step(model, {"x": batch["x"] + noise, "y": batch["y"]})

    state = "numpy.random's global state" if draw == "numpy" else "Python's global random state"
    with pytest.raises(jl.PortingError, match=rf"{state} \(.*\): advanced, at .*"
                       r"test_trace_guards\.py:\d+(.|\n)*jax\.random"):
        _fit().fit(Noisy(), _data())


def test_a_module_without_host_effects_trains_without_a_guard_firing():
    class Cached(Classifier):
        @functools.cached_property
        def scale(self):  # computed at the first trace: a cache, not a side effect
            return np.float32(1.0)

        def training_step(self, model, batch):
            loss, metrics = super().training_step(model, batch)
            return loss * self.scale, metrics

    with warnings.catch_warnings():
        warnings.simplefilter("error", jl.JaxlightWarning)
        fit = _fit(max_steps=6)
        fit.fit(Cached(), _data(), _data(64))
    assert fit.global_step == 6


# -- (b) a network on self, re-synced from a hook ------------------------------------------


class _TargetOnSelf(Classifier):
    """A target network kept on self: the step reads it (a constant of the compiled step)."""

    def on_fit_start(self):
        self.target = nnx.clone(self.model)

    def training_step(self, model, batch):
        loss, metrics = super().training_step(model, batch)
        return loss + 0.0 * self.target(batch["x"]).mean(), metrics


def test_a_network_on_self_reassigned_from_a_hook_is_refused_at_the_assignment():
    class Resync(_TargetOnSelf):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.global_step % 2 == 0:
                self.target = nnx.clone(self.model)

    steps = _Steps()
    with pytest.raises(jl.PortingError, match=r"self\.target = \.\.\. at .*test_trace_guards\.py:"
                       r"\d+ \(`self\.target = nnx\.clone\(self\.model\)`\) assigns a new MLP "
                       r"to an attribute that the compiled Resync\.training_step read"
                       r"(.|\n)*never reach(.|\n)*jaxlight\.nn\.SyncedCopy\(net\)"
                       r"(.|\n)*docs/rl\.md"):
        _fit(callbacks=[steps]).fit(Resync(), _data())
    assert steps.steps == [1, 2]  # refused at the first sync, at step 2


def test_a_network_on_self_updated_in_place_is_refused_at_the_epoch_end():
    class InPlace(_TargetOnSelf):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            nnx.update(self.target, nnx.state(self.model))

    steps = _Steps()
    with pytest.raises(jl.PortingError, match=r"self\.target changed .* by the end of epoch 0 "
                       r"\(step 4\), but the compiled InPlace\.training_step read it(.|\n)*"
                       r"SyncedCopy"):
        _fit(max_steps=8, callbacks=[steps]).fit(InPlace(), _data())
    assert steps.steps == [1, 2, 3, 4]


def test_an_attribute_the_step_reads_may_be_set_again_to_the_same_value_and_freely_after():
    class Same(_TargetOnSelf):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.target = self.target  # the same object: nothing changes

    module, fit = Same(), _fit()
    fit.fit(module, _data())
    assert fit.compile_counts["train"] == 1
    # Between stages an assignment is allowed; the next stage of the same Fit compiles again.
    module.target = nnx.clone(module.model)
    fit.fit(module, _data())
    assert fit.compile_counts["train"] == 2
    # Nothing changed before the third: its compiled step is reused, holding the second's
    # target, so on_fit_start's new target would not reach it.
    with pytest.raises(jl.PortingError, match=r"self\.target = \.\.\. at .*on_fit_start|"
                       r"self\.target = \.\.\. at .*assigns a new MLP"):
        fit.fit(module, _data())
    assert fit.compile_counts["train"] == 2


# -- (c) writes to frozen parameters -------------------------------------------------------


class _Pair(nnx.Module):
    def __init__(self, rngs):
        self.net = MLP(16, 32, 4, rngs=rngs)
        self.target = MLP(16, 32, 4, rngs=rngs)


def test_writes_to_frozen_parameters_in_the_step_are_refused():
    class FrozenTarget(Classifier):
        trainable = nnx.All(nnx.Param, nnx.PathContains("net"))

        def configure_model(self, rngs):
            return _Pair(rngs)

        def training_step(self, model, batch):
            logits = model.net(batch["x"]) + 0.0 * model.target(batch["x"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            nnx.update(model.target, nnx.state(model.net, nnx.Param))  # dropped: frozen
            return loss

    with pytest.raises(jl.PortingError, match=r"FrozenTarget\.training_step assigned to "
                       r"model\.target\.l1\.bias, model\.target\.l1\.kernel, .* frozen parameters"
                       r"(.|\n)*dropped without a word(.|\n)*SyncedCopy"):
        _fit().fit(FrozenTarget(), _data())


# -- (d) a host constant logged from a step ------------------------------------------------


def test_a_host_value_logged_from_a_step_warns_at_its_line():
    class LogsHost(Classifier):
        def __init__(self):
            super().__init__()
            self.total_reward = 0.0

        def training_step(self, model, batch):
            self.log_dict({"total_reward": self.total_reward})
            return super().training_step(model, batch)

    with pytest.warns(jl.JaxlightWarning, match=r"LogsHost\.training_step: self\.log\("
                      r"'total_reward', \.\.\.\) logs the float 0\.0, a host value(.|\n)*as it "
                      r"was at the trace, is logged at every step(.|\n)*on_train_batch_start") as w:
        _fit().fit(LogsHost(), _data())
    assert any(r.filename == __file__ for r in w)


# -- (e) host values logged from a training batch hook -------------------------------------


class _Rounds(callbacks.Callback):
    def __init__(self):
        self.rows = []

    def on_log(self, fit, module, metrics, step):
        self.rows.append((step, dict(metrics)))


def test_self_log_in_batch_hooks_is_logged_with_the_steps_loss_at_log_intervals():
    """Lightning 2.6.6 (max_steps=6, log_every_n_steps=2, self.log(name, float(batch_idx)) in
    on_train_batch_start and on_train_batch_end): one round per logged step, each holding the
    loss and both hook values of the same batch, batches 1, 3 and 5 only."""

    class Hooked(Classifier):
        def on_train_batch_start(self, batch, batch_idx):
            self.log("start_val", float(batch_idx))

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.log("end_val", float(batch_idx))

    rounds = _Rounds()
    _fit(max_steps=6, log_every_n_steps=2, callbacks=[rounds]).fit(Hooked(), _data(256))
    train = [(s, m) for s, m in rounds.rows if "loss" in m]
    assert [(m["start_val"], m["end_val"]) for _, m in train] == [(1.0, 1.0), (3.0, 3.0),
                                                                   (5.0, 5.0)]
    assert all(set(m) == {"loss", "accuracy", "start_val", "end_val", "epoch"} for _, m in train)
    assert [s for s, m in rounds.rows if "start_val" in m] == [s for s, _ in train]


def test_trainer_log_metrics_from_a_module_batch_hook_warns_with_the_steps():
    class Direct(Classifier):
        def on_train_batch_start(self, batch, batch_idx):
            self.trainer.log_metrics({"reward": 1.0})

    rounds = _Rounds()
    with pytest.warns(jl.JaxlightWarning, match=r"Direct\.on_train_batch_start calls "
                      r"self\.trainer\.log_metrics, which logs at once, at step 0, at every step"
                      r"(.|\n)*its loss is logged at step 1(.|\n)*self\.log\(name, value\)"):
        _fit(max_steps=2, callbacks=[rounds]).fit(Direct(), _data())
    assert [step for step, m in rounds.rows if "reward" in m] == [0, 1]


def test_self_log_in_a_batch_hook_refuses_on_epoch():
    class EpochHook(Classifier):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.log("x", 1.0, on_epoch=True)

    with pytest.raises(jl.ConfigurationError, match=r"on_epoch=True: a value logged from "
                       r"on_train_batch_start / on_train_batch_end is logged with its step's"):
        _fit().fit(EpochHook(), _data())


# -- the natural DQN port ------------------------------------------------------------------


class _Env:
    """A tiny environment with its own random state (as gym's)."""

    def __init__(self):
        self.rng = np.random.default_rng(0)
        self.state = np.zeros(4, np.float32)

    def step(self, action):
        self.state = (self.state + self.rng.normal(size=4) * (action + 1)).astype(np.float32)
        return self.state, 1.0, bool(abs(self.state[0]) > 3)


class _NaturalDQN(jl.TrainModule):
    """Lightning's DQN written the natural way: the agent plays inside training_step, the
    target network lives on self and is re-synced from a hook."""

    def __init__(self, sync_rate=2):
        super().__init__()
        self.sync_rate = sync_rate
        self.env = _Env()
        self.buffer = collections.deque(maxlen=64)

    def configure_model(self, rngs):
        return MLP(4, 16, 2, rngs=rngs)

    def configure_optimizers(self):
        return optax.adam(1e-2)

    def on_fit_start(self):
        self.target_net = nnx.clone(self.model)

    def play_step(self, net, epsilon):
        action = random.randrange(2) if random.random() < epsilon else int(
            net(self.env.state[None]).argmax())
        new_state, reward, done = self.env.step(action)
        self.buffer.append((self.env.state, action, reward, done, new_state))

    def training_step(self, model, batch):
        self.play_step(model, epsilon=1.0)
        q = jnp.take_along_axis(model(batch["state"]), batch["action"][:, None], 1)[:, 0]
        target = self.target_net(batch["next_state"]).max(1)
        return jnp.mean((q - (0.99 * target + batch["reward"])) ** 2)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_step % self.sync_rate == 0:
            self.target_net = nnx.clone(self.model)


def _replay(n=64, batch=16):
    rng = np.random.default_rng(1)
    return jl.data.ArrayLoader({"state": rng.normal(size=(n, 4)).astype(np.float32),
                                "action": rng.integers(2, size=n).astype(np.int32),
                                "reward": np.ones(n, np.float32),
                                "next_state": rng.normal(size=(n, 4)).astype(np.float32)}, batch)


def test_the_natural_dqn_port_is_refused_leading_to_the_synced_form():
    steps = _Steps()
    with pytest.raises(jl.PortingError, match=r"_NaturalDQN\.training_step changed host state "
                       r"(.|\n)*on_train_batch_start(.|\n)*docs/rl\.md") as info:
        _fit(max_steps=30, callbacks=[steps]).fit(_NaturalDQN(), _replay())
    assert steps.steps == []
    for changed in ("Python's global random state (random.*): advanced, at",
                    "self.buffer: a deque of 0 -> a deque of 1, at",
                    "self.env: rng, state changed, at"):
        assert f"\n  {changed}" in str(info.value)

    # The greedy branch reads the traced model's output on the host: refused with the hook form.
    class Greedy(_NaturalDQN):
        def training_step(self, model, batch):
            self.play_step(model, epsilon=0.0)
            return super().training_step(model, batch)

    with pytest.raises(jl.PortingError, match=r"turns a traced value into a host value at .*"
                       r"int\((.|\n)*belongs in a hook \(on_train_batch_start"):
        _fit(max_steps=30).fit(Greedy(), _replay())

    # The environment moved to a hook, the target still on self: refused at the re-sync.
    class HookPlays(_NaturalDQN):
        def on_train_batch_start(self, batch, batch_idx):
            self.play_step(self.model, epsilon=1.0)

        def training_step(self, model, batch):
            q = jnp.take_along_axis(model(batch["state"]), batch["action"][:, None], 1)[:, 0]
            target = self.target_net(batch["next_state"]).max(1)
            return jnp.mean((q - (0.99 * target + batch["reward"])) ** 2)

    steps = _Steps()
    with pytest.raises(jl.PortingError, match=r"self\.target_net = \.\.\. at .* assigns a new MLP "
                       r"to an attribute that the compiled HookPlays\.training_step read"):
        _fit(max_steps=30, callbacks=[steps]).fit(HookPlays(), _replay())
    assert steps.steps == [1, 2]
