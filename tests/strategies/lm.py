"""A tiny TransformerLM TrainModule and token data shared by the strategy tests."""

from __future__ import annotations

import numpy as np
import optax

import jaxlight as jl
from jaxlight import nn


class TinyLM(jl.TrainModule):
    """Next-token prediction with `jaxlight.nn.TransformerLM` (untied head: every rule used)."""

    def __init__(self, vocab: int = 64, embed: int = 32, layers: int = 2, heads: int = 4,
                 mlp: int = 64, tie: bool = False, lr: float = 3e-3, remat: bool = False):
        super().__init__()
        self.config = nn.TransformerConfig(vocab_size=vocab, embed_dim=embed, num_layers=layers,
                                           num_heads=heads, mlp_dim=mlp, tie_embeddings=tie,
                                           remat=remat)
        self.lr = lr

    def configure_model(self, rngs):
        return nn.TransformerLM(self.config, rngs=rngs)

    def configure_optimizers(self):
        return optax.adamw(self.lr, weight_decay=0.01)

    def training_step(self, model, batch):
        logits = model(batch["tokens"][:, :-1])
        loss = nn.lm_loss(logits, batch["tokens"][:, 1:])
        return loss, {"accuracy": (logits.argmax(-1) == batch["tokens"][:, 1:]).mean()}

    def validation_step(self, model, batch):
        logits = model(batch["tokens"][:, :-1])
        return {"loss": nn.lm_loss(logits, batch["tokens"][:, 1:])}


def token_batches(steps: int, batch: int = 16, length: int = 17, vocab: int = 64, seed: int = 0):
    """Learnable sequences: each token is the previous one plus a per-sequence stride."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start = rng.integers(0, vocab, size=(batch, 1))
        stride = rng.integers(1, 4, size=(batch, 1))
        tokens = (start + stride * np.arange(length)) % vocab
        out.append({"tokens": tokens.astype(np.int32)})
    return out
