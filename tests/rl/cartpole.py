"""The DQN port's host side, shared by its jaxlight and Lightning runs (NumPy and Python only):
CartPole-v1's dynamics, the replay buffer and the epsilon-greedy agent of Lightning's
`reinforce_learn_Qnet.py` (docs/rl.md shows the same code inline)."""

from __future__ import annotations

import collections
import random

import numpy as np


class CartPole:
    """CartPole-v1's dynamics: reward 1 per step, done when the pole falls past 12 degrees, the
    cart leaves [-2.4, 2.4], or after 500 steps."""

    def __init__(self, seed=0):
        self.rng = np.random.default_rng(seed)
        self.reset()

    def reset(self):
        self.state, self.t = self.rng.uniform(-0.05, 0.05, 4).astype(np.float32), 0
        return self.state

    def sample_action(self):
        return int(self.rng.integers(2))

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state.astype(np.float64)
        force = 10.0 if action == 1 else -10.0
        cos, sin = np.cos(theta), np.sin(theta)
        temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4 / 3 - 0.1 * cos**2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        x, x_dot = x + 0.02 * x_dot, x_dot + 0.02 * x_acc
        theta, theta_dot = theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc
        self.state, self.t = np.array([x, x_dot, theta, theta_dot], np.float32), self.t + 1
        done = abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360 or self.t >= 500
        return self.state, 1.0, bool(done)


class ReplayBuffer:
    def __init__(self, capacity, seed=0):
        self.buffer = collections.deque(maxlen=capacity)
        self.rng = random.Random(seed)

    def __len__(self):
        return len(self.buffer)

    def append(self, experience):
        self.buffer.append(experience)

    def sample(self, n):
        """`n` experiences as a dict of NumPy arrays (state, action, reward, done, next_state)."""
        rows = [self.buffer[i] for i in self.rng.sample(range(len(self.buffer)), n)]
        state, action, reward, done, new_state = zip(*rows, strict=True)
        return {"state": np.stack(state), "action": np.array(action, np.int32),
                "reward": np.array(reward, np.float32), "done": np.array(done),
                "next_state": np.stack(new_state)}


class Agent:
    """Plays epsilon-greedy; `greedy(state) -> action` runs the current network."""

    def __init__(self, env, replay_buffer, seed=0):
        self.env, self.replay_buffer = env, replay_buffer
        self.rng = random.Random(seed)
        self.state = env.reset()

    def play_step(self, greedy, epsilon=0.0):
        action = self.env.sample_action() if self.rng.random() < epsilon else greedy(self.state)
        new_state, reward, done = self.env.step(action)
        self.replay_buffer.append((self.state, action, reward, done, new_state))
        self.state = self.env.reset() if done else new_state
        return reward, done


#: The run both sides make (small: a few seconds each).
CONFIG = {"replay_size": 200, "warm_start_steps": 200, "gamma": 0.99, "eps_start": 1.0,
          "eps_end": 0.01, "eps_last_frame": 40, "sync_rate": 10, "lr": 1e-2,
          "episode_length": 64, "batch_size": 16, "hidden_size": 32, "max_steps": 48}


def initial_weights(hidden, seed=0) -> dict[str, np.ndarray]:
    """The two networks' starting weights, torch's layout (out, in): net_* and target_*."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in ("net", "target"):
        for layer, (fan_in, fan_out) in (("l1", (4, hidden)), ("l2", (hidden, 2))):
            bound = 1 / np.sqrt(fan_in)
            out[f"{name}_{layer}_weight"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(
                np.float32)
            out[f"{name}_{layer}_bias"] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
    return out
