"""A tiny `StagedTransformerLM` (embedding, 2 block stages, head: 4 stages) for the pipeline tests.

Shared by tests/nn/test_staged_lm.py and the SIGKILL child process (tests/_pipeline_child.py).
"""

from __future__ import annotations

import numpy as np
import optax

import jaxlight as jl
from jaxlight import nn

CONFIG = dict(vocab_size=32, embed_dim=16, num_layers=2, num_heads=2, mlp_dim=32,
              tie_embeddings=False)


class StagedLM(jl.TrainModule):
    """Next-token prediction with `nn.StagedTransformerLM` (4 stages) and AdamW."""

    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.lr = lr

    def configure_model(self, rngs):
        return nn.StagedTransformerLM(nn.TransformerConfig(**CONFIG), rngs=rngs)

    def configure_optimizers(self):
        return optax.adamw(self.lr)

    def training_step(self, model, batch):
        tokens = batch["tokens"]
        return nn.lm_loss(model(tokens[:, :-1]), tokens[:, 1:])


def lm_data(examples: int, length: int = 9, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, CONFIG["vocab_size"], size=(examples, length))
            .astype(np.int32)}
