"""GRPO's generation batch: G sampled completions per prompt, their rewards, advantages and the
sampling policy's log-probabilities, as one NumPy batch for the training step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlight._errors import ConfigurationError, DataError
from jaxlight.nn.pretrained import generate
from jaxlight.posttrain._grpo import group_advantages
from jaxlight.posttrain._logprobs import batch_weights, token_log_probs


def completion_log_probs(model: nnx.Module, batch: dict, temperature: float = 1.0) -> jax.Array:
    """log p of each completion token of a `rollout` batch under `model` ([B, C], float32):
    the training step's and the sampler's figure (both call this), so the ratio of a first
    update on fresh samples is exactly 1."""
    tokens = batch["tokens"].astype(jnp.int32)
    width = batch["mask"].shape[1]
    logits = model(tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1])
    return token_log_probs(logits[:, -width:], tokens[:, -width:], temperature)


@functools.partial(jax.jit, static_argnames=("temperature",))
def _old_log_probs(graphdef, state, batch, temperature):
    return completion_log_probs(nnx.merge(graphdef, state), batch, temperature)


def rollout(model: nnx.Module, prompts: Sequence[Sequence[int]], *, group_size: int,
            max_new_tokens: int, rewards: Sequence[Callable[[str, str], float]],
            decode: Callable[[Sequence[int]], str], temperature: float = 1.0, seed: int = 0,
            prompt_len: int | None = None, strategy: Any = None) -> dict[str, np.ndarray]:
    """Samples `group_size` completions of every prompt and makes the GRPO training batch.

    The completions come from `jaxlight.nn.pretrained.generate` (key/value cache, `temperature`,
    row keys from `seed`: the same seed and weights give the same batch). Each reward function
    gets `(prompt_text, completion_text)` (`decode`d, special tokens dropped) and returns a
    float; a completion's reward is their sum. Rows are prompt-major (prompt 0's completions
    first), as `group_advantages` expects.

    Returns `{"tokens" [B, P + C] (prompt left-padded to P, completion right-padded to
    C = max_new_tokens), "attention_mask" [B, P + C], "mask" [B, C] (the completion's tokens,
    its stop token included), "rewards" [B], "rewards_by_fn" [B, F], "advantages" [B],
    "old_logps" [B, C] (the sampling policy's, at `temperature`), "token_weight",
    "row_weight" [B]}`: everything `grpo_loss` needs from the whole batch (see
    `batch_weights`), for every update this generation batch feeds.
    """
    if temperature <= 0:
        raise ConfigurationError(
            f"temperature={temperature}: GRPO needs the sampling distribution's log-probabilities "
            "(softmax(logits / temperature)); use a temperature > 0.")
    if not rewards:
        raise ConfigurationError("rollout needs at least one reward function.")
    longest = max(len(p) for p in prompts)
    prompt_len = prompt_len or longest
    if prompt_len < longest:
        raise DataError(f"prompt_len={prompt_len} is shorter than the longest prompt ({longest}).")
    rows = [list(p) for p in prompts for _ in range(group_size)]
    completions = generate(model, rows, max_new_tokens, strategy=strategy,
                           temperature=temperature, seed=seed)
    pad = model.config.token_ids.get("pad")
    pad = 0 if pad is None else int(pad)
    b, width = len(rows), prompt_len + max_new_tokens
    tokens = np.full((b, width), pad, np.int32)
    attention = np.zeros((b, width), np.float32)
    mask = np.zeros((b, max_new_tokens), np.float32)
    by_fn = np.zeros((b, len(rewards)), np.float32)
    for i, (prompt, completion) in enumerate(zip(rows, completions, strict=True)):
        tokens[i, prompt_len - len(prompt):prompt_len] = prompt
        tokens[i, prompt_len:prompt_len + len(completion)] = completion
        attention[i, prompt_len - len(prompt):prompt_len + len(completion)] = 1
        mask[i, :len(completion)] = 1
        texts = decode(prompt), decode(completion)
        by_fn[i] = [float(fn(*texts)) for fn in rewards]
    batch = {"tokens": tokens, "attention_mask": attention, "mask": mask}
    graphdef, state = nnx.split(model)
    old = _old_log_probs(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()},
                         temperature=float(temperature))
    total = by_fn.sum(axis=1)
    batch.update(rewards=total, rewards_by_fn=by_fn,
                 advantages=np.asarray(group_advantages(jnp.asarray(total), group_size)),
                 old_logps=np.asarray(jax.device_get(old), np.float32) * mask,
                 **{k: np.asarray(v) for k, v in batch_weights(mask).items()})
    return batch
