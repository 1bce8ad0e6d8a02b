"""Per-token log-probabilities and the masked reductions the post-training losses share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlight._errors import ConfigurationError, suggest

#: How a per-token loss becomes one number, with Tunix's names (`common.aggregate_loss`).
AGGREGATIONS = ("token-mean", "sequence-mean-token-mean", "seq-mean-token-sum",
                "sequence-mean-token-sum-norm")


def token_log_probs(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log p(tokens[..., t]) under `logits[..., t, :]` (already shifted: position t predicts
    token t), in float32 whatever the logits' dtype.

    `temperature` divides the logits first, as the sampler did (Tunix's `compute_per_token_logps`),
    so the log-probabilities are those of the distribution the completions were drawn from.

    Example:
        >>> import jax.numpy as jnp
        >>> float(token_log_probs(jnp.zeros((1, 4)), jnp.array([2]))[0])  # log(1/4)
        -1.386...
    """
    logits = logits.astype(jnp.float32)
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    picked = jnp.take_along_axis(logits, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


def sequence_log_probs(logits: jax.Array, tokens: jax.Array, mask: jax.Array,
                       temperature: float = 1.0) -> jax.Array:
    """Per sequence, the summed log-probability of its tokens where `mask` is set: [B, T] -> [B]."""
    return (token_log_probs(logits, tokens, temperature) * mask).sum(axis=-1)


def batch_weights(mask) -> dict[str, jax.Array]:
    """The batch-wide normalizers of the token- and sequence-averaged losses, one value per row.

    `{"token_weight": B / tokens, "row_weight": B / rows}` for a [B, T] completion `mask`
    (`tokens`: set entries, `rows`: rows with at least one; both at least 1), each repeated to
    [B]. Every aggregate is then a plain mean over rows of a per-row value, which stays exact
    when a strategy evaluates the step per data-parallel replica on its own rows and averages
    the replicas' losses (`FSDP()` does: its step sees the replica's rows). Compute them on the
    host for the whole batch and put them in it (`batch.update(batch_weights(mask))`); without
    them the losses compute them from the rows the step sees.

    Example:
        >>> import numpy as np
        >>> w = batch_weights(np.array([[1, 1, 0], [1, 0, 0]]))
        >>> [float(x) for x in w["token_weight"]], [float(x) for x in w["row_weight"]]
        ([0.666..., 0.666...], [1.0, 1.0])
    """
    mask = jnp.asarray(mask, jnp.float32)
    rows = mask.shape[0]
    tokens = jnp.clip(mask.sum(), min=1)
    filled = jnp.clip((mask.sum(axis=-1) > 0).sum(), min=1).astype(jnp.float32)
    return {"token_weight": jnp.full((rows,), rows / tokens),
            "row_weight": jnp.full((rows,), rows / filled)}


def _weights(mask, weights):
    return batch_weights(mask) if weights is None else weights


def masked_mean(x: jax.Array, mask: jax.Array, weights: dict | None = None) -> jax.Array:
    """Mean of `x` [B, T] over the set entries of `mask` (0 when none is set); `weights` from
    `batch_weights` make it the whole batch's mean under a per-replica step."""
    mask = mask.astype(jnp.float32)
    row_sums = (x * mask).sum(axis=-1)
    return (row_sums * _weights(mask, weights)["token_weight"]).mean()


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str,
              weights: dict | None = None) -> jax.Array:
    """One loss from a [B, T] per-token loss over the tokens `mask` keeps.

    - `"token-mean"`: every kept token of the batch weighs the same.
    - `"sequence-mean-token-mean"` (GRPO's): the mean per sequence, then the mean over the
      sequences that keep at least one token.
    - `"seq-mean-token-sum"`: the sum per sequence, then that mean over sequences.
    - `"sequence-mean-token-sum-norm"`: the sum over the batch divided by the number of
      sequences that keep a token (Dr. GRPO's constant normalizer).

    `weights`: `batch_weights` of the whole batch (see there); None computes them from `mask`.
    """
    check_choice("loss_agg_mode", mode, AGGREGATIONS)
    per_token = per_token.astype(jnp.float32)
    mask = mask.astype(jnp.float32)
    w = _weights(mask, weights)
    tokens = mask.sum(axis=-1)
    summed = (per_token * mask).sum(axis=-1)
    if mode == "token-mean":
        per_row = summed * w["token_weight"]
    elif mode == "sequence-mean-token-mean":
        per_row = summed / jnp.clip(tokens, min=1) * w["row_weight"]
    else:  # both sums per sequence over the sequences with a token (empty ones sum to 0)
        per_row = summed * w["row_weight"]
    return per_row.mean()


def check_choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigurationError(
            f"{name}={value!r} is not one of {options}.{suggest(value, options)}")


def check_nonnegative(name: str, value, why: str, strict: bool = False) -> None:
    """Refuses a negative (with `strict`, a non-positive) Python number `value` of option
    `name`, saying `why`; traced values pass unchecked."""
    if not isinstance(value, int | float):
        return
    if value < 0 or (strict and value == 0) or value != value:
        bound = "> 0" if strict else ">= 0"
        raise ConfigurationError(f"{name}={value} must be {bound}: {why}.")
