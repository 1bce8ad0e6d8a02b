"""The committed Tunix fixtures (`make posttrain-oracle` rewrites them) and the stand-in model
they were computed with, in jaxlight's terms."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxlight import posttrain

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
ARRAYS = dict(np.load(os.path.join(HERE, "tunix_oracle.npz")))
with open(os.path.join(HERE, "tunix_oracle.json")) as _f:
    RESULTS = json.load(_f)
SHAPES = RESULTS["shapes"]
TP, TC, G = SHAPES["TP"], SHAPES["TC"], SHAPES["G"]
TOL = 1e-5


def completion_logits(hidden, kernel):
    """The stand-in's logits at the positions that predict the completion tokens."""
    logits = jnp.einsum("btd,dv->btv", hidden, kernel, precision=jax.lax.Precision.HIGHEST)
    return logits[:, TP - 1:-1]


def grpo_objective(kernel, logits, ref_logps, batch, cfg):
    """Tunix's GRPO configuration `cfg` in jaxlight: (loss, metrics) from the policy's logits."""
    logps = posttrain.token_log_probs(logits, batch["completion_ids"], cfg["temperature"])
    if "advantages" in batch:  # computed on the host for the whole batch, as a recipe does
        advantages = batch["advantages"]
        weights = {k: batch[k] for k in ("token_weight", "row_weight")}
    else:
        advantages, weights = posttrain.group_advantages(batch["rewards"], G), None
    return posttrain.grpo_loss(
        logps, batch["old_logps"] if cfg["old"] else None, ref_logps, advantages, batch["mask"],
        epsilon=cfg["epsilon"], epsilon_high=cfg.get("epsilon_high"), beta=cfg["beta"],
        kl_mode=cfg["kl_loss_mode"], loss_agg_mode=cfg["loss_agg_mode"], weights=weights)


def dpo_objective(chosen_logits, rejected_logits, batch, cfg, ref=None):
    """Tunix's DPO configuration `cfg` in jaxlight, from the policy's completion logits."""
    chosen = posttrain.sequence_log_probs(chosen_logits, batch["chosen_ids"], batch["chosen_mask"])
    rejected = posttrain.sequence_log_probs(rejected_logits, batch["rejected_ids"],
                                            batch["rejected_mask"])
    ref_chosen, ref_rejected = ref if ref is not None else (batch["ref_chosen"],
                                                            batch["ref_rejected"])
    return posttrain.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=cfg["beta"],
                              label_smoothing=cfg["label_smoothing"])


def grpo_batch(i: int) -> dict:
    a = ARRAYS
    return {"hidden": a["grpo_hidden"], "completion_ids": a["grpo_completion_ids"],
            "mask": a["grpo_mask"], "rewards": a["grpo_rewards"],
            "old_logps": a[f"grpo{i}_old_logps"], "ref_logps": a[f"grpo{i}_ref_logps"]}


def dpo_batch() -> dict:
    a, p = ARRAYS, SHAPES["PAIRS"]
    ids, mask, hidden = a["dpo_input_ids"][:, TP:], a["dpo_mask"], a["dpo_hidden"]
    return {"chosen_hidden": hidden[:p], "rejected_hidden": hidden[p:],
            "chosen_ids": ids[:p], "rejected_ids": ids[p:],
            "chosen_mask": mask[:p], "rejected_mask": mask[p:],
            "ref_chosen": a["dpo_ref_chosen_logps"], "ref_rejected": a["dpo_ref_rejected_logps"]}
