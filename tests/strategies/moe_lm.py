"""A tiny mixture-of-experts LM TrainModule shared by the expert-parallel tests."""

from __future__ import annotations

import optax

import jaxlight as jl
from jaxlight import nn


class TinyMoELM(jl.TrainModule):
    """Next-token prediction with `jaxlight.nn.MoETransformerLM`; the auxiliary losses are
    part of the loss and logged."""

    def __init__(self, vocab: int = 64, embed: int = 32, layers: int = 2, heads: int = 4,
                 experts: int = 8, k: int = 2, expert_dim: int = 16, lr: float = 3e-3,
                 capacity_factor: float | None = None, bias_update_rate: float = 0.0,
                 z_loss_weight: float = 0.0, shared_expert_dim: int = 0,
                 router: str = "softmax_topk"):
        super().__init__()
        self.config = nn.MoEConfig(
            vocab_size=vocab, embed_dim=embed, num_layers=layers, num_heads=heads,
            tie_embeddings=False, num_experts=experts, experts_per_token=k,
            expert_dim=expert_dim, capacity_factor=capacity_factor, router=router,
            bias_update_rate=bias_update_rate, aux_loss_weight=0.01,
            z_loss_weight=z_loss_weight, shared_expert_dim=shared_expert_dim)
        self.lr = lr

    def configure_model(self, rngs):
        return nn.MoETransformerLM(self.config, rngs=rngs)

    def configure_optimizers(self):
        return optax.adamw(self.lr, weight_decay=0.01)

    def training_step(self, model, batch):
        logits, aux = model(batch["tokens"][:, :-1], return_aux=True)
        loss = nn.lm_loss(logits, batch["tokens"][:, 1:]) + aux["loss"]
        return loss, {"aux_loss": aux["aux_loss"], "dropped_fraction": aux["dropped_fraction"]}

    def validation_step(self, model, batch):
        logits = model(batch["tokens"][:, :-1])
        return {"loss": nn.lm_loss(logits, batch["tokens"][:, 1:])}
