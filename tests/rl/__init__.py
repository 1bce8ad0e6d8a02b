"""Reinforcement learning: the DQN port of docs/rl.md against Lightning's DQN template."""
