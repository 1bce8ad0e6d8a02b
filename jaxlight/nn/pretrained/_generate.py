"""Sampling with a key/value cache: batched, left-padded, compiled once per shape bucket.

One compiled function per (batch bucket, prompt bucket, new tokens, sampling settings) runs the
whole generation: a prefill of the left-padded prompts, then a `lax.while_loop` of one-token
steps that stops early once every row has emitted a stop token. The caches are sharded like
the activations of a training step (batch over `data`/`fsdp`, key/value heads over `tp`), the
weights stay where `from_pretrained` put them.

Sampling follows transformers' order: temperature, then top-k, then top-p (nucleus), then a
categorical draw with each row's own key (`fold_in(key, row)`, then `fold_in(.., step)`), so a
row's tokens do not depend on which other rows share its batch. Temperature 0 is greedy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxlight import distributed
from jaxlight._errors import ConfigurationError, DataError
from jaxlight.nn.pretrained._hf import resolve_strategy
from jaxlight.nn.pretrained._model import DecoderLM, check_positions, padded_positions
from jaxlight.sharding._layout import constrain

_CACHE = (None, "batch", None, "activation_heads", "activation_kv")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
        temperature: 0 (greedy) or a positive divisor of the logits.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches p (1: all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigurationError(
                f"sampling needs temperature >= 0 (0: greedy), top_k >= 0 (0: off) and "
                f"0 < top_p <= 1; got temperature={self.temperature}, top_k={self.top_k}, "
                f"top_p={self.top_p}.")


def choose(logits: jax.Array, keys: jax.Array, sampling: Sampling) -> jax.Array:
    """The next token of each row of `logits` `(batch, vocab)` (float32) with per-row `keys`."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    neg = jnp.finfo(jnp.float32).min
    if sampling.top_k:
        k = min(sampling.top_k, logits.shape[-1])
        kth = jax.lax.top_k(logits, k)[0][:, -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if sampling.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        ranked = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(ranked, axis=-1), axis=-1)
        # Drop a token when the ones ranked above it already reach top_p (the first always stays).
        drop_ranked = (cum - jax.nn.softmax(ranked, axis=-1)) >= sampling.top_p
        drop = jnp.zeros_like(drop_ranked).at[
            jnp.arange(logits.shape[0])[:, None], order].set(drop_ranked)
        logits = jnp.where(drop, neg, logits)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "new_tokens", "sampling"))
def _generate(graphdef, state, tokens, valid, keys, stop, pad, *, new_tokens: int,
              sampling: Sampling):
    model: DecoderLM = nnx.merge(graphdef, state)
    batch, prompt = tokens.shape
    length = prompt + new_tokens
    k_cache, v_cache = model.init_cache(batch, length)
    cache = (constrain(k_cache, _CACHE), constrain(v_cache, _CACHE))
    key_valid = jnp.concatenate([valid, jnp.zeros((batch, new_tokens), bool)], axis=1)
    positions = padded_positions(valid)
    logits, cache = model.step(tokens, positions, jnp.int32(0), cache, key_valid)

    def pick(logits, i):
        step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
        return choose(logits[:, -1], step_keys, sampling)

    first = pick(logits, 0)
    out = jnp.full((batch, new_tokens), pad, jnp.int32)
    last_pos = positions[:, -1]

    def cond(carry):
        i, _, _, _, done, _, _ = carry
        return (i < new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, cache, key_valid, done, out, state = carry
        out = out.at[:, i].set(jnp.where(done, pad, token))
        done = done | jnp.isin(token, stop)
        slot = prompt + i
        key_valid = key_valid.at[:, slot].set(True)
        # The weights ride in the carry and the model is merged inside the body: NNX refuses
        # variables holding tracers of an outer trace level.
        model = nnx.merge(graphdef, state)
        logits, cache = model.step(token[:, None], (last_pos + 1 + i)[:, None], slot, cache,
                                   key_valid)
        return i + 1, pick(logits, i + 1), cache, key_valid, done, out, state

    done = jnp.zeros((batch,), bool)
    carry = (jnp.int32(0), first, cache, key_valid, done, out, state)
    out = jax.lax.while_loop(cond, body, carry)[5]
    return out


def bucket(n: int, minimum: int = 16) -> int:
    """The shape bucket of a length: the next power of two, at least `minimum`."""
    size = minimum
    while size < n:
        size *= 2
    return size


def generate(model: DecoderLM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             strategy: Any = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             stop_tokens: Sequence[int] | None = None, seed: int = 0, pad_id: int | None = None,
             prompt_bucket: int | None = None) -> list[list[int]]:
    """Continues each prompt by up to `max_new_tokens` tokens with a key/value cache.

    Prompts of different lengths are left-padded to a shape bucket (the next power of two, at
    least 16; the batch too, up to a multiple of the data-parallel degree), so prompts of
    similar size reuse one compiled program. A row ends at its first stop token (kept in its
    output); the loop ends when every row has.

    Args:
        model: a `DecoderLM` (its weights placed by `from_pretrained(path, strategy)`).
        prompts: token ids per row.
        max_new_tokens: tokens to generate per row at most.
        strategy: the strategy the weights were loaded with, or its name as `from_pretrained`
            takes it ("single", "fsdp", ...; the caches and batch follow its mesh); None:
            whatever devices the weights are on, no constraints.
        temperature, top_k, top_p: sampling (temperature 0: greedy; see `Sampling`).
        stop_tokens: token ids that end a row (default: the config's eos ids).
        seed: the sampling seed (each row draws from its own key).
        pad_id: the id that fills rows after their stop token (default: the config's pad id,
            else 0).
        prompt_bucket: pad prompts to this length instead of the power-of-two bucket.

    Returns:
        the generated ids per row (without the prompt), up to and including the stop token.

    Example:
        >>> from flax import nnx
        >>> from jaxlight.nn.pretrained import DecoderLM, from_hf_config
        >>> cfg = from_hf_config({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
        ...     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2})
        >>> out = generate(DecoderLM(cfg, rngs=nnx.Rngs(0)), [[1, 2, 3], [4]], 5)
        >>> [len(row) for row in out]
        [5, 5]
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise DataError(f"generate needs at least one prompt, each of at least one token; got "
                        f"lengths {[len(p) for p in prompts]}.")
    if max_new_tokens < 1:
        raise ConfigurationError(f"max_new_tokens must be >= 1, got {max_new_tokens}.")
    config = model.config
    sampling = Sampling(float(temperature), int(top_k), float(top_p))
    if stop_tokens is None:
        stop_tokens = config.token_ids.get("eos") or []
    if pad_id is None:
        pad_id = config.token_ids.get("pad")
        pad_id = 0 if pad_id is None else int(pad_id)
    longest = max(len(p) for p in prompts)
    check_positions(config, longest + max_new_tokens,
                    f"generate: the longest prompt ({longest} tokens) plus max_new_tokens "
                    f"({max_new_tokens}) make", "shorten the prompts or lower max_new_tokens")
    if isinstance(strategy, str):
        strategy = resolve_strategy(strategy)
    width = prompt_bucket or bucket(longest)
    if width < longest:
        raise DataError(f"prompt_bucket {width} is shorter than the longest prompt ({longest}).")
    rows = len(prompts)
    dp = strategy.data_parallel_size if strategy is not None else 1
    batch = -(-bucket(rows, 1) // dp) * dp
    tokens = np.full((batch, width), pad_id, np.int32)
    valid = np.zeros((batch, width), bool)
    for i in range(batch):
        p = list(prompts[i if i < rows else 0])
        tokens[i, width - len(p):] = p
        valid[i, width - len(p):] = True
    base = jax.random.key(seed)
    keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(jnp.arange(batch))
    stop = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
    graphdef, state = nnx.split(model)
    args = (jnp.asarray(tokens), jnp.asarray(valid))
    if strategy is not None:
        mesh = strategy.require_mesh("generate")
        axes = strategy.compute_batch_axes  # the order the "batch" activation rule uses
        lead = (axes[0] if len(axes) == 1 else axes) if axes else None
        args = tuple(jax.device_put(a, NamedSharding(mesh, PartitionSpec(lead, None)))
                     for a in args)
        with strategy.trace_context():
            out = _generate(graphdef, state, *args, keys, stop, jnp.int32(pad_id),
                            new_tokens=max_new_tokens, sampling=sampling)
    else:
        out = _generate(graphdef, state, *args, keys, stop, jnp.int32(pad_id),
                        new_tokens=max_new_tokens, sampling=sampling)
    out = np.asarray(distributed.gather(out))[:rows]
    stops = set(int(t) for t in stop_tokens)
    result = []
    for row in out.tolist():
        ended = next((j for j, t in enumerate(row) if t in stops), None)
        result.append(row if ended is None else row[:ended + 1])
    return result


def compiled_programs() -> int:
    """How many programs `generate` has compiled in this process (one per shape bucket)."""
    return _generate._cache_size()
