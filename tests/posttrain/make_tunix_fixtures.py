"""Writes the Tunix oracle fixtures for jaxlight's DPO and GRPO losses (run in a Tunix venv).

    make posttrain-oracle            # builds .venv-tunix (google-tunix==0.1.7) and runs this

Tunix's losses take a model: a stand-in nnx module returns fixed logits `hidden @ kernel`
(hidden [B, T, D] a non-trained variable, kernel [D, V] the one trained parameter), so
`tunix.rl.algo_core.grpo_loss_fn`, its advantage estimators and
`tunix.sft.dpo.dpo_trainer.dpo_loss_fn` run exactly as in Tunix's trainers on given inputs. The
reference and the old policy are the same stand-in with other kernels. For each configuration
this records the loss, the auxiliary metrics and the gradient of the loss with respect to the
kernel; `tests/posttrain/test_tunix_parity.py` compares jaxlight's losses with them (it never
imports tunix). Fixtures: `fixtures/tunix_oracle.npz` (inputs, gradients) and
`fixtures/tunix_oracle.json` (versions, configurations, scalars).
"""

from __future__ import annotations

import json
import os
import sys
from importlib import metadata

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

jax.config.update("jax_default_matmul_precision", "highest")

from tunix.rl import algo_core, common  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.sft.dpo import dpo_trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PAD, EOS = 0, 1
D, V, TP, TC = 8, 16, 3, 5  # hidden width, vocabulary, prompt and completion lengths
GROUPS, G = 2, 4  # GRPO: prompts per batch, completions per prompt
PAIRS = 8  # DPO: preference pairs per batch

GRPO_CONFIGS = [  # Tunix's defaults first, then every other aggregation, KL mode, clip bound
    dict(beta=0.04, epsilon=0.2, kl_loss_mode="kl", loss_agg_mode="sequence-mean-token-mean",
         temperature=1.0, old=True),
    dict(beta=0.1, epsilon=0.2, epsilon_high=0.28, kl_loss_mode="low_var_kl",
         loss_agg_mode="token-mean", temperature=0.7, old=True),
    dict(beta=0.04, epsilon=0.2, kl_loss_mode="mse_kl", loss_agg_mode="seq-mean-token-sum",
         temperature=1.0, old=False),
    dict(beta=0.0, epsilon=0.1, kl_loss_mode="kl",
         loss_agg_mode="sequence-mean-token-sum-norm", temperature=1.0, old=True),
]
DPO_CONFIGS = [dict(beta=0.1, label_smoothing=0.0), dict(beta=0.5, label_smoothing=0.1)]
GRPO_AUX = ("pg_loss", "kl", "kl_loss", "pg_clipfrac", "ppo_kl")
DPO_AUX = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
           "log_probs/chosen", "log_probs/rejected")


class FixedLogits(nnx.Module):
    """A stand-in model: logits = hidden @ kernel, whatever tokens it is given."""

    def __init__(self, hidden, kernel):
        self.hidden = nnx.Variable(jnp.asarray(hidden))
        self.kernel = nnx.Param(jnp.asarray(kernel))

    def __call__(self, tokens, positions=None, cache=None, attention_mask=None, **kwargs):
        assert tokens.shape == self.hidden[...].shape[:2], tokens.shape
        return self.hidden[...] @ self.kernel[...], None


def _completions(rng, n):
    """Token ids in [2, V) with a random length, then EOS and padding; mask 1 up to the EOS."""
    ids = rng.integers(2, V, size=(n, TC))
    mask = np.zeros((n, TC), np.int32)
    for i, length in enumerate(rng.integers(1, TC + 1, size=n)):
        mask[i, :length] = 1
        if length < TC:
            ids[i, length - 1] = EOS
            ids[i, length:] = PAD
    mask[0] = 1  # one completion fills the whole length
    return ids.astype(np.int32), mask


def main() -> None:
    rng = np.random.default_rng(34)
    kernel = (rng.normal(size=(D, V)) * 0.5).astype(np.float32)
    ref_kernel = (kernel + rng.normal(size=(D, V)) * 0.1).astype(np.float32)
    old_kernel = (kernel + rng.normal(size=(D, V)) * 0.15).astype(np.float32)
    arrays = {"kernel": kernel, "ref_kernel": ref_kernel, "old_kernel": old_kernel}
    results = {"grpo": [], "dpo": [], "advantages": {}}

    # Advantage estimators on three groups of four, one of them all-equal (advantage 0).
    adv_rewards = np.array([0.3, 1.2, -0.5, 0.9, 1, 0, 1, 1, 2, 2, 2, 2], np.float32)
    arrays["adv_rewards"] = adv_rewards
    for name in ("grpo", "drgrpo", "rloo"):
        fn = {"grpo": algo_core.compute_advantages,
              "drgrpo": algo_core.compute_drgrpo_advantages,
              "rloo": algo_core.compute_rloo_advantages}[name]
        arrays[f"adv_{name}"] = np.asarray(fn(adv_rewards, 4), np.float32)

    # GRPO: GROUPS prompts, G completions each.
    b = GROUPS * G
    prompts = np.repeat(rng.integers(2, V, size=(GROUPS, TP)), G, axis=0).astype(np.int32)
    completions, mask = _completions(rng, b)
    hidden = rng.normal(size=(b, TP + TC, D)).astype(np.float32)
    rewards = np.concatenate([rng.normal(size=G), [1.0, 0.0, 1.0, 1.0]]).astype(np.float32)
    advantages = np.asarray(algo_core.compute_advantages(rewards, G), np.float32)
    arrays.update(grpo_prompt_ids=prompts, grpo_completion_ids=completions, grpo_mask=mask,
                  grpo_hidden=hidden, grpo_rewards=rewards, grpo_advantages=advantages)
    for i, cfg in enumerate(GRPO_CONFIGS):
        def logps(k, temperature=cfg["temperature"]):
            graphdef, state = nnx.split(FixedLogits(hidden, k))
            return common.compute_per_token_logps(
                graphdef, state, prompt_tokens=jnp.asarray(prompts),
                completion_tokens=jnp.asarray(completions), pad_id=PAD, eos_id=EOS,
                stop_gradient=True, temperature=temperature)
        ref_logps, old_logps = logps(ref_kernel), logps(old_kernel)
        arrays[f"grpo{i}_ref_logps"] = np.asarray(ref_logps)
        arrays[f"grpo{i}_old_logps"] = np.asarray(old_logps)
        algo = grpo_learner.GRPOConfig(
            num_generations=G, beta=cfg["beta"], epsilon=cfg["epsilon"],
            kl_loss_mode=cfg["kl_loss_mode"], loss_agg_mode=cfg["loss_agg_mode"])
        algo.temperature = cfg["temperature"]  # the learner copies it from the rollout config
        if "epsilon_high" in cfg:
            algo.epsilon_high = cfg["epsilon_high"]
        example = grpo_learner.TrainExample(
            prompt_ids=jnp.asarray(prompts), prompt_mask=jnp.asarray(prompts != PAD),
            completion_ids=jnp.asarray(completions), completion_mask=jnp.asarray(mask),
            advantages=jnp.asarray(advantages), ref_per_token_logps=ref_logps,
            old_per_token_logps=old_logps if cfg["old"] else None)

        def loss_fn(model, example=example, algo=algo):
            return algo_core.grpo_loss_fn(model, example, algo, PAD, EOS)

        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
            FixedLogits(hidden, kernel))
        arrays[f"grpo{i}_grad"] = np.asarray(grads["kernel"][...])
        results["grpo"].append({"config": cfg, "loss": float(loss),
                                "aux": {k: float(aux[k]) for k in GRPO_AUX}})

    # DPO: PAIRS pairs; Tunix's batch holds the chosen completions first, then the rejected.
    prompts = rng.integers(2, V, size=(PAIRS, TP)).astype(np.int32)
    chosen, chosen_mask = _completions(rng, PAIRS)
    rejected, rejected_mask = _completions(rng, PAIRS)
    input_ids = np.concatenate([np.concatenate([prompts, chosen], 1),
                                np.concatenate([prompts, rejected], 1)], 0)
    completion_mask = np.concatenate([chosen_mask, rejected_mask], 0)
    hidden = rng.normal(size=(2 * PAIRS, TP + TC, D)).astype(np.float32)
    arrays.update(dpo_input_ids=input_ids, dpo_mask=completion_mask, dpo_hidden=hidden)
    positions = jnp.broadcast_to(jnp.arange(TP + TC), input_ids.shape)
    attention = jnp.ones((2 * PAIRS, TP + TC, TP + TC), jnp.bool_)
    ref_chosen, ref_rejected = dpo_trainer.compute_logps(
        FixedLogits(hidden, ref_kernel), jnp.asarray(input_ids), positions, attention, TC,
        jnp.asarray(completion_mask))
    arrays.update(dpo_ref_chosen_logps=np.asarray(ref_chosen),
                  dpo_ref_rejected_logps=np.asarray(ref_rejected))
    example = dpo_trainer.TrainExample(
        input_ids=jnp.asarray(input_ids), positions=positions, attention_mask=attention,
        ref_chosen_logps=ref_chosen, ref_rejected_logps=ref_rejected,
        completion_mask=jnp.asarray(completion_mask), logits_to_keep=TC)
    for i, cfg in enumerate(DPO_CONFIGS):
        def loss_fn(model, cfg=cfg):
            return dpo_trainer.dpo_loss_fn(model, example, "dpo", cfg["beta"],
                                           label_smoothing=cfg["label_smoothing"])

        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(
            FixedLogits(hidden, kernel))
        arrays[f"dpo{i}_grad"] = np.asarray(grads["kernel"][...])
        results["dpo"].append({"config": cfg, "loss": float(loss),
                               "aux": {k: float(aux[k]) for k in DPO_AUX}})

    results["versions"] = {name: metadata.version(name) for name in
                           ("google-tunix", "jax", "jaxlib", "flax", "optax", "numpy")}
    results["python"] = sys.version.split()[0]
    results["shapes"] = dict(D=D, V=V, TP=TP, TC=TC, GROUPS=GROUPS, G=G, PAIRS=PAIRS, PAD=PAD,
                             EOS=EOS)
    out = os.path.join(HERE, "fixtures")
    os.makedirs(out, exist_ok=True)
    np.savez_compressed(os.path.join(out, "tunix_oracle.npz"), **arrays)
    with open(os.path.join(out, "tunix_oracle.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)
        f.write("\n")
    print(json.dumps({k: results[k] for k in ("versions",)}))


if __name__ == "__main__":
    main()
