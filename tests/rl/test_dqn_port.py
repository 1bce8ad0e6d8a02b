"""docs/rl.md's DQN port computes what Lightning's DQN template computes: the same environment
steps (rewards), each step's loss, the final network, from the same starting weights
(fixtures/lightning_dqn.json, written by lightning_dqn.py under PyTorch Lightning 2.6.6)."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks
from tests.rl.cartpole import CONFIG, Agent, CartPole, ReplayBuffer, initial_weights

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "lightning_dqn.json"


class ReplayData:
    def __init__(self, buffer, sample_size, batch_size):
        self.buffer, self.sample_size, self.batch_size = buffer, sample_size, batch_size

    def __iter__(self):
        rows = self.buffer.sample(self.sample_size)
        return iter([{k: v[i:i + self.batch_size] for k, v in rows.items()}
                     for i in range(0, self.sample_size, self.batch_size)])


class DQN(nnx.Module):
    def __init__(self, hidden, weights, name, rngs):
        self.l1 = nnx.Linear(4, hidden, rngs=rngs)
        self.l2 = nnx.Linear(hidden, 2, rngs=rngs)
        for layer in ("l1", "l2"):  # Lightning's starting weights (torch's layout: out, in)
            getattr(self, layer).kernel.set_value(jnp.asarray(weights[f"{name}_{layer}_weight"].T))
            getattr(self, layer).bias.set_value(jnp.asarray(weights[f"{name}_{layer}_bias"]))

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


class QNetworks(nnx.Module):
    def __init__(self, hidden, weights, rngs):
        self.net = DQN(hidden, weights, "net", rngs)
        self.target = jl.nn.SyncedCopy(DQN(hidden, weights, "target", rngs))


class DQNPort(jl.TrainModule):
    def __init__(self):
        super().__init__()
        self.buffer = ReplayBuffer(CONFIG["replay_size"])
        self.agent = Agent(CartPole(seed=0), self.buffer)
        self.data = ReplayData(self.buffer, CONFIG["episode_length"], CONFIG["batch_size"])
        for _ in range(CONFIG["warm_start_steps"]):
            self.agent.play_step(None, epsilon=1.0)
        self.states = []  # the environment's state after each step's play

    def configure_model(self, rngs):
        return QNetworks(CONFIG["hidden_size"], initial_weights(CONFIG["hidden_size"]), rngs)

    def configure_optimizers(self):
        return optax.adam(CONFIG["lr"])

    def greedy(self, state):
        return int(jnp.argmax(self.model.net(state[None])[0]))

    def on_train_batch_start(self, batch, batch_idx):
        c = CONFIG
        epsilon = max(c["eps_end"], c["eps_start"] - (self.global_step + 1) / c["eps_last_frame"])
        reward, _ = self.agent.play_step(self.greedy, epsilon)
        self.states.append(self.agent.state.tolist())
        self.log("reward", reward)

    def training_step(self, model, batch):
        q = model.net(batch["state"])
        taken = jnp.take_along_axis(q, batch["action"][:, None], axis=1)[:, 0]
        next_values = jnp.where(batch["done"], 0.0, model.target(batch["next_state"]).max(1))
        loss = jnp.mean((taken - (next_values * CONFIG["gamma"] + batch["reward"])) ** 2)
        model.target.sync(model.net, every=CONFIG["sync_rate"])
        return loss


class _Rounds(callbacks.Callback):
    def __init__(self):
        self.rows = []

    def on_log(self, fit, module, metrics, step):
        if "loss" in metrics:
            self.rows.append(metrics)


@pytest.mark.slow
def test_the_dqn_port_equals_lightnings_dqn():
    """Measured: losses within 3e-5 relative of Lightning's, the final weights within 3e-6."""
    lightning = json.loads(FIXTURE.read_text())
    rounds, module = _Rounds(), DQNPort()
    jl.Fit("single", max_steps=CONFIG["max_steps"], log_every_n_steps=1, logger=False,
           enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
           callbacks=[rounds]).fit(module, module.data)
    assert [r["reward"] for r in rounds.rows] == lightning["rewards"]
    assert module.states == lightning["states"]  # the same actions, greedy ones included
    losses = np.array([r["loss"] for r in rounds.rows])
    np.testing.assert_allclose(losses, lightning["losses"], rtol=1e-4, atol=1e-6)
    net = module.model.net
    for layer, i in (("l1", 0), ("l2", 2)):
        np.testing.assert_allclose(np.asarray(getattr(net, layer).kernel[...]).T,
                                   lightning["net"][f"net.{i}.weight"], rtol=1e-4, atol=1e-5)
