"""Lightning's DQN template (`reinforce_learn_Qnet.py`) on tests/rl/cartpole.py's CartPole, run
by PyTorch Lightning 2.6.6 from the same starting weights (`cartpole.initial_weights`). It
wrote `fixtures/lightning_dqn.json` (each step's loss, reward and environment state, the final
network), which
test_dqn_port.py compares the docs/rl.md port with; to write it again, from the repository root:
`.venv-conformance/bin/python tests/rl/lightning_dqn.py tests/rl/fixtures/lightning_dqn.json`."""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cartpole import CONFIG, Agent, CartPole, ReplayBuffer, initial_weights  # noqa: E402


class DQN(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))

    def forward(self, x):
        return self.net(x.float())


class RLDataset(IterableDataset):
    def __init__(self, buffer, sample_size):
        self.buffer, self.sample_size = buffer, sample_size

    def __iter__(self):
        rows = self.buffer.sample(self.sample_size)
        for i in range(self.sample_size):
            yield tuple(torch.as_tensor(rows[k][i]) for k in
                        ("state", "action", "reward", "done", "next_state"))


class DQNLightning(L.LightningModule):
    def __init__(self, weights):
        super().__init__()
        c = CONFIG
        self.net, self.target_net = DQN(c["hidden_size"]), DQN(c["hidden_size"])
        for name, module in (("net", self.net), ("target", self.target_net)):
            module.load_state_dict({
                f"net.{i}.{kind}": torch.from_numpy(weights[f"{name}_{layer}_{kind}"])
                for i, layer in ((0, "l1"), (2, "l2")) for kind in ("weight", "bias")})
        self.buffer = ReplayBuffer(c["replay_size"])
        self.agent = Agent(CartPole(seed=0), self.buffer)
        self.losses, self.rewards, self.states = [], [], []
        for _ in range(c["warm_start_steps"]):
            self.agent.play_step(None, epsilon=1.0)

    def greedy(self, state):
        with torch.no_grad():
            return int(torch.argmax(self.net(torch.tensor(state[None]))[0]))

    def training_step(self, batch, nb_batch):
        c = CONFIG
        epsilon = max(c["eps_end"], c["eps_start"] - (self.global_step + 1) / c["eps_last_frame"])
        reward, done = self.agent.play_step(self.greedy, epsilon)
        states, actions, rewards, dones, next_states = batch
        q = self.net(states).gather(1, actions.long().unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            next_values = self.target_net(next_states).max(1)[0]
            next_values[dones] = 0.0
        loss = nn.MSELoss()(q, next_values * c["gamma"] + rewards)
        if self.global_step % c["sync_rate"] == 0:
            self.target_net.load_state_dict(self.net.state_dict())
        self.losses.append(float(loss.detach()))
        self.rewards.append(reward)
        self.states.append(self.agent.state.tolist())  # where the action played led
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=CONFIG["lr"])

    def train_dataloader(self):
        return DataLoader(RLDataset(self.buffer, CONFIG["episode_length"]),
                          batch_size=CONFIG["batch_size"])


def main(out_path):
    module = DQNLightning(initial_weights(CONFIG["hidden_size"]))
    L.Trainer(max_steps=CONFIG["max_steps"], logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(module)
    final = {k: v.tolist() for k, v in module.net.state_dict().items()}
    with open(out_path, "w") as f:
        json.dump({"lightning": L.__version__, "torch": torch.__version__,
                   "losses": module.losses, "rewards": module.rewards, "states": module.states,
                   "net": final}, f)


if __name__ == "__main__":
    main(sys.argv[1])
