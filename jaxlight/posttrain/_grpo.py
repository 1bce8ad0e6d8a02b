"""Group relative policy optimization: group-relative advantages and the clipped
policy-gradient objective with a KL penalty to a frozen reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlight._errors import ConfigurationError
from jaxlight.posttrain._logprobs import (
    AGGREGATIONS,
    aggregate,
    batch_weights,
    check_choice,
    check_nonnegative,
    masked_mean,
)

KL_MODES = ("kl", "low_var_kl", "mse_kl")
ADVANTAGES = ("grpo", "drgrpo", "rloo")


def group_advantages(rewards: jax.Array, group_size: int, estimator: str = "grpo",
                     eps: float = 1e-6) -> jax.Array:
    """Per completion, its reward relative to the other completions of the same prompt.

    `rewards` is [N * group_size], the completions of one prompt next to each other (prompt 0's
    `group_size` completions first). With each group's mean `μ` and standard deviation `σ`:

    - `"grpo"` (Tunix's and DeepSeekMath's): `(r - μ) / (σ + eps)`, `σ` with Bessel's correction
      (`ddof=1`, as Tunix computes it); a group of equal rewards gets advantage 0,
    - `"drgrpo"` (Dr. GRPO): `r - μ`,
    - `"rloo"`: `r` minus the mean of the group's other rewards.

    Example:
        >>> import jax.numpy as jnp
        >>> [round(float(a), 3) for a in group_advantages(jnp.array([1.0, 0.0, 2.0, 2.0]), 2)]
        [0.707, -0.707, 0.0, 0.0]
    """
    check_choice("estimator", estimator, ADVANTAGES)
    if group_size < 2:
        raise ConfigurationError(
            f"group_size={group_size}: group-relative advantages need at least 2 completions "
            "per prompt (each is compared with the others of its group).")
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ConfigurationError(
            f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}: "
            "pass one reward per completion, [prompts * group_size].")
    rewards = rewards.astype(jnp.float32)
    grouped = rewards.reshape(-1, group_size)
    mean = grouped.mean(axis=-1, keepdims=True)
    if estimator == "drgrpo":
        return (grouped - mean).reshape(-1)
    if estimator == "rloo":
        others = (grouped.sum(axis=-1, keepdims=True) - grouped) / (group_size - 1)
        return (grouped - others).reshape(-1)
    std = jnp.sqrt(jnp.square(grouped - mean).sum(axis=-1, keepdims=True) / (group_size - 1))
    return ((grouped - mean) / (std + eps)).reshape(-1)


def kl_penalty(logps: jax.Array, ref_logps: jax.Array, mode: str = "kl") -> jax.Array:
    """Per token, an estimate of KL(policy || reference) from the sampled token's log-probs.

    - `"kl"` (Tunix's GRPO default): `logp - ref_logp`,
    - `"low_var_kl"` (Schulman's k3, the GRPO paper's): `exp(ref - logp) - (ref - logp) - 1`,
    - `"mse_kl"`: `(logp - ref_logp)² / 2`.
    """
    check_choice("kl_mode", mode, KL_MODES)
    logps, ref_logps = logps.astype(jnp.float32), ref_logps.astype(jnp.float32)
    if mode == "kl":
        return logps - ref_logps
    if mode == "mse_kl":
        return 0.5 * jnp.square(logps - ref_logps)
    diff = ref_logps - logps
    return jnp.exp(diff) - diff - 1


def grpo_loss(logps: jax.Array, old_logps: jax.Array | None, ref_logps: jax.Array | None,
              advantages: jax.Array, mask: jax.Array, *, epsilon: float = 0.2,
              epsilon_high: float | None = None, beta: float = 0.04, kl_mode: str = "kl",
              loss_agg_mode: str = "sequence-mean-token-mean", weights: dict | None = None,
              kl_ratio_weighted: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The clipped GRPO objective (to minimize) for a batch of completions, and its metrics.

    Arguments are per completion token ([B, T]; `advantages` [B] or [B, T]): the policy's
    log-probabilities of the sampled tokens (differentiated), the policy's at sampling time
    (`old_logps`; None when this is the first update on the batch, then the ratio is 1 with the
    policy's gradient), the frozen reference's (None: no KL term), and `mask` (1 on the tokens
    of the completion). With the ratio `ρ = exp(logp - old_logp)` (log-ratio clipped to ±20):

        per token: max(-A ρ, -A clip(ρ, 1 - ε, 1 + ε_high))
        loss = agg(per token) + β agg(kl_penalty(logp, ref_logp))

    `agg` is `loss_agg_mode` (see `aggregate`); `kl_ratio_weighted` multiplies the per-token KL
    penalty by `ρ` (unclipped), which makes its gradient the unbiased reverse-KL gradient when
    the completions come from the old policy (DeepSeek-V3.2; TRL's `use_bias_correction_kl`,
    on by default in TRL 1.16; it changes the gradient even where `ρ` is 1). `weights` are the
    whole batch's `batch_weights(mask)`, needed where the step sees only a replica's rows
    (`FSDP()`).
    Defaults are Tunix's `GRPOConfig`'s (`beta=0.04`, `epsilon=0.2`, `kl_loss_mode="kl"`,
    `"sequence-mean-token-mean"`). Metrics: `pg_loss`, `kl` (token mean of `kl_mode`'s
    penalty as the loss weighs it, Tunix's figure: with `"kl"` it is an unbiased estimate that
    is negative on many batches), `kl_k3` (token mean of Schulman's k3, never negative: the
    figure to log, as TRL does), `kl_loss` (aggregated), `pg_clipfrac` (tokens where the clip
    is active), `ppo_kl` (token mean of `old_logp - logp`). A negative `beta` or `epsilon` is
    refused.

    Example:
        >>> import jax.numpy as jnp
        >>> lp = jnp.log(jnp.full((2, 3), 0.5))
        >>> loss, m = grpo_loss(lp, None, lp, jnp.array([1.0, -1.0]), jnp.ones((2, 3)))
        >>> float(loss), float(m["kl"])
        (0.0, 0.0)
    """
    check_choice("kl_mode", kl_mode, KL_MODES)
    check_choice("loss_agg_mode", loss_agg_mode, AGGREGATIONS)
    check_grpo_options(beta, epsilon, epsilon_high)
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    logps = logps.astype(jnp.float32)
    old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)
    adv = adv if adv.ndim == 2 else adv[:, None]
    log_ratio = logps - old
    weights = batch_weights(mask) if weights is None else weights
    ppo_kl = masked_mean(-log_ratio, mask, weights)
    ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = jnp.maximum(unclipped, clipped)
    loss = aggregate(per_token, mask, loss_agg_mode, weights)
    metrics = {"pg_loss": loss, "pg_clipfrac": masked_mean(clipped > unclipped, mask, weights),
               "ppo_kl": ppo_kl}
    if ref_logps is not None:
        kl = kl_penalty(logps, ref_logps, kl_mode)
        if kl_ratio_weighted:
            kl = kl * ratio
        metrics["kl"] = masked_mean(kl, mask, weights)
        k3 = (kl if kl_mode == "low_var_kl" and not kl_ratio_weighted
              else kl_penalty(logps, ref_logps, "low_var_kl"))
        metrics["kl_k3"] = masked_mean(k3, mask, weights)
        metrics["kl_loss"] = aggregate(kl, mask, loss_agg_mode, weights)
        if beta:
            loss = loss + beta * metrics["kl_loss"]
    return loss, metrics


def check_grpo_options(beta, epsilon, epsilon_high=None, prefix: str = "") -> None:
    """Refuses a negative KL weight or clip range (Python numbers; `prefix` names the
    command-line section, e.g. `"--grpo."`)."""
    check_nonnegative(f"{prefix}beta", beta,
                      "β weighs the KL penalty to the reference; a negative β rewards moving "
                      "away from it. Use β >= 0 (0.04 is Tunix's default, 0 drops the KL term)")
    for name, value in (("epsilon", epsilon), ("epsilon_high", epsilon_high)):
        if value is not None:
            check_nonnegative(f"{prefix}{name}", value,
                              "it is the clip range of the probability ratio, clipped to "
                              "[1 - epsilon, 1 + epsilon_high]; a negative range clips every "
                              "token. Use e.g. 0.2 (Tunix's and TRL's default)")
