"""Direct preference optimization: the sigmoid (and IPO) loss on policy and reference
log-probabilities of chosen and rejected completions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlight._errors import ConfigurationError
from jaxlight.posttrain._logprobs import check_choice, check_nonnegative

DPO_LOSSES = ("sigmoid", "ipo")


def dpo_loss(chosen_logps: jax.Array, rejected_logps: jax.Array,
             ref_chosen_logps: jax.Array | None, ref_rejected_logps: jax.Array | None, *,
             beta: float = 0.1, label_smoothing: float = 0.0,
             loss_type: str = "sigmoid") -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of a batch of preference pairs, and its reward metrics.

    Each argument is per pair ([P]): the summed log-probability of the completion (chosen or
    rejected) under the policy, and under the frozen reference (None: no reference, as Tunix
    allows). With `h = (chosen - ref_chosen) - (rejected - ref_rejected)`:

    - `"sigmoid"` (Rafailov et al. 2023; Tunix's `dpo_loss_fn`, TRL's default):
      `-(1 - ls) log σ(β h) - ls log σ(-β h)` with `ls = label_smoothing` (conservative DPO),
    - `"ipo"` (Azar et al. 2023): `(h - 1 / (2 β))²`, with per-token-averaged log-probabilities
      as the paper uses them (pass those in); `label_smoothing` must be 0.

    The loss is the mean over pairs. The metrics are Tunix's and TRL's: the implicit rewards
    `β (logp - ref_logp)` of chosen and rejected (`rewards/chosen`, `rewards/rejected`), their
    margin, the fraction of pairs whose chosen reward is higher (`rewards/accuracy`), and the
    policy's mean log-probabilities (`log_probs/chosen`, `log_probs/rejected`).

    Example:
        >>> import jax.numpy as jnp
        >>> loss, m = dpo_loss(jnp.array([-3.0]), jnp.array([-5.0]), jnp.array([-4.0]),
        ...                    jnp.array([-4.0]), beta=0.5)
        >>> round(float(loss), 4), float(m["rewards/accuracy"])  # -log σ(0.5 * 2)
        (0.3133, 1.0)
    """
    check_choice("loss_type", loss_type, DPO_LOSSES)
    check_nonnegative("beta", beta, "DPO's β scales the implicit reward β (logp - ref_logp): a "
                      "negative β rewards the policy for preferring the rejected answers "
                      "while the logged accuracy and margin look right. Use β > 0 (0.1 is "
                      "Tunix's and TRL's default)", strict=True)
    shapes = [tuple(getattr(x, "shape", ())) for x in
              (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
              if x is not None]
    if len(set(shapes)) > 1:
        raise ConfigurationError(
            f"dpo_loss takes one log-probability per pair for chosen, rejected (and their "
            f"reference values), all of one shape; got shapes {shapes} (chosen, rejected, "
            "ref_chosen, ref_rejected). Pass the pairs' values side by side: chosen[i] and "
            "rejected[i] belong to the same prompt.")
    if loss_type == "ipo" and label_smoothing:
        raise ConfigurationError(
            f"label_smoothing={label_smoothing} has no meaning for loss_type='ipo' (the IPO "
            "loss is a squared error, not a classification): set label_smoothing=0.")
    if not 0.0 <= label_smoothing < 0.5:
        raise ConfigurationError(
            f"label_smoothing={label_smoothing} must be in [0, 0.5): it is the assumed "
            "probability that a pair's preference is flipped.")
    chosen = chosen_logps if ref_chosen_logps is None else chosen_logps - ref_chosen_logps
    rejected = rejected_logps if ref_rejected_logps is None else rejected_logps - ref_rejected_logps
    delta = chosen - rejected
    if loss_type == "sigmoid":
        losses = -(jax.nn.log_sigmoid(beta * delta) * (1 - label_smoothing)
                   + jax.nn.log_sigmoid(-beta * delta) * label_smoothing)
    else:
        losses = jnp.square(delta - 1 / (2 * beta))
    chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
    metrics = {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracy": (chosen_rewards > rejected_rewards).astype(jnp.float32).mean(),
        "log_probs/chosen": chosen_logps.mean(),
        "log_probs/rejected": rejected_logps.mean(),
    }
    return losses.mean(), metrics
