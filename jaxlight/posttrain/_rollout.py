"""GRPO's generation batch: G sampled completions per prompt, their rewards, advantages and the
sampling policy's log-probabilities, as one NumPy batch for the training step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxlight import distributed
from jaxlight._errors import ConfigurationError, DataError
from jaxlight.nn.pretrained import generate
from jaxlight.nn.pretrained._model import check_positions
from jaxlight.nn.pretrained._placement import resolve_strategy
from jaxlight.posttrain._grpo import ADVANTAGES, group_advantages
from jaxlight.posttrain._logprobs import batch_weights, check_choice, token_log_probs
from jaxlight.posttrain._rewards import RewardFunction, check_weights, combine, score


def completion_log_probs(model: nnx.Module, batch: dict, temperature: float = 1.0,
                         entropy: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """log p of each completion token of a `rollout` batch under `model` ([B, C], float32):
    the training step's and the sampler's figure (both call this), so the ratio of a first
    update on fresh samples is exactly 1. With `entropy`, also the entropy of each position's
    sampling distribution (softmax(logits / temperature); [B, C], no gradient)."""
    tokens = batch["tokens"].astype(jnp.int32)
    width = batch["mask"].shape[1]
    logits = model(tokens[:, :-1], attention_mask=batch["attention_mask"][:, :-1])[:, -width:]
    logps = token_log_probs(logits, tokens[:, -width:], temperature)
    if not entropy:
        return logps
    scaled = jax.lax.stop_gradient(logits.astype(jnp.float32))
    if temperature not in (0.0, 1.0):
        scaled = scaled / temperature
    logp_all = jax.nn.log_softmax(scaled, axis=-1)
    return logps, -(jnp.exp(logp_all) * logp_all).sum(axis=-1)


@functools.partial(jax.jit, static_argnames=("temperature",))
def _old_log_probs(graphdef, state, batch, temperature):
    return completion_log_probs(nnx.merge(graphdef, state), batch, temperature)


def rollout(model: nnx.Module, prompts: Sequence[Sequence[int]], *, group_size: int,
            max_new_tokens: int, reward_funcs: Sequence[RewardFunction],
            decode: Callable[[Sequence[int]], str], temperature: float = 1.0, seed: int = 0,
            prompt_len: int | None = None, strategy: Any = None,
            columns: Mapping[str, Sequence[Any]] | None = None,
            reward_weights: Sequence[float] | None = None,
            reward_prompts: Sequence[Any] | None = None,
            estimator: str = "grpo") -> dict[str, np.ndarray]:
    """Samples `group_size` completions of every prompt and makes the GRPO training batch.

    The completions come from `jaxlight.nn.pretrained.generate` (key/value cache, `temperature`,
    row keys from `seed`: the same seed and weights give the same batch). The reward functions
    have TRL's contract (`jaxlight.posttrain.score`): each is called once with every row's
    prompt (`reward_prompts[i]` as the data has it, text or chat messages; default: the
    `decode`d prompt), completion (`decode`d, special tokens dropped; where the prompt is
    messages, TRL's `[{"role": "assistant", "content": text}]`) and completion ids, and with
    `columns` (one value per prompt, repeated over its group) as keyword arguments; it returns
    a float or None per row. A row's
    reward is the `reward_weights`-weighted sum over the functions that apply. Rows are
    prompt-major (prompt 0's completions first), as `group_advantages` expects; its
    `estimator` makes the advantages, over the completions some function applies to (the
    others get advantage 0 and reward 0, as TRL's GRPOTrainer does).

    Returns `{"tokens" [B, P + C] (prompt left-padded to P, completion right-padded to
    C = max_new_tokens), "attention_mask" [B, P + C], "mask" [B, C] (the completion's tokens,
    its stop token included), "rewards" [B], "rewards_by_fn" [B, F] (NaN: None),
    "advantages" [B], "old_logps" [B, C] (the sampling policy's, at `temperature`),
    "token_weight", "row_weight" [B], "clipped" [B] (1: the completion hit max_new_tokens
    without a stop token)}`: everything `grpo_loss` needs from the whole batch (see
    `batch_weights`), for every update this generation batch feeds; and the lengths and
    clipped flags of every process's completions (`all_lengths`, `all_clipped`) and their
    rewards (`all_rewards`, `all_rewards_by_fn`); this process's rows' prompts and completions
    as the reward functions got them (lists `prompt_texts`, `completion_texts`).

    With several processes each returns the rows of its share of the prompts (the prompts
    must split evenly): all rows are sampled by one program over every device, each process
    decodes and scores only its own, whose groups are whole, and the advantages (from every
    process's rewards) and the batch-wide normalizers are those of all rows, so the loop's
    global batch is the one-process batch, bit for bit.
    """
    if temperature <= 0:
        raise ConfigurationError(
            f"temperature={temperature}: GRPO needs the sampling distribution's log-probabilities "
            "(softmax(logits / temperature)); use a temperature > 0.")
    weights = check_weights(reward_weights, len(reward_funcs))
    check_choice("estimator", estimator, ADVANTAGES)
    longest = max(len(p) for p in prompts)
    prompt_len = prompt_len or longest
    if prompt_len < longest:
        raise DataError(f"prompt_len={prompt_len} is shorter than the longest prompt ({longest}).")
    check_positions(model.config, prompt_len + max_new_tokens,
                    f"rollout: prompts padded to {prompt_len} tokens plus max_new_tokens "
                    f"({max_new_tokens}) make", "shorten the prompts or lower max_new_tokens")
    if isinstance(strategy, str):
        strategy = resolve_strategy(strategy)
    rows = [list(p) for p in prompts for _ in range(group_size)]
    completions = generate(model, rows, max_new_tokens, strategy=strategy,
                           temperature=temperature, seed=seed)
    pad = model.config.token_ids.get("pad")
    pad = 0 if pad is None else int(pad)
    stops = set(int(t) for t in (model.config.token_ids.get("eos") or []))
    b, width = len(rows), prompt_len + max_new_tokens
    tokens = np.full((b, width), pad, np.int32)
    attention = np.zeros((b, width), np.float32)
    mask = np.zeros((b, max_new_tokens), np.float32)
    clipped = np.zeros((b,), np.float32)
    for i, (prompt, completion) in enumerate(zip(rows, completions, strict=True)):
        tokens[i, prompt_len - len(prompt):prompt_len] = prompt
        tokens[i, prompt_len:prompt_len + len(completion)] = completion
        attention[i, prompt_len - len(prompt):prompt_len + len(completion)] = 1
        mask[i, :len(completion)] = 1
        clipped[i] = float(len(completion) == max_new_tokens and completion[-1] not in stops)
    texts = (list(reward_prompts) if reward_prompts is not None
             else [decode(p) for p in prompts])
    if len(texts) != len(prompts):
        raise DataError(f"{len(texts)} reward_prompts for {len(prompts)} prompts.")
    for key, vals in (columns or {}).items():
        if len(vals) != len(prompts):
            raise DataError(f"column {key!r} has {len(vals)} values for {len(prompts)} prompts.")
    # This process's rows: whole groups (its prompts), scored here alone; the others' rows
    # are sampled in the same program (the sampler is one SPMD computation) but neither
    # decoded nor scored here, and the loop assembles the global batch from each share.
    local = _share(len(prompts), group_size)
    local_texts = [texts[i // group_size] for i in range(b)][local]
    answers = [decode(c) for c in completions[local]]
    answers = [[{"role": "assistant", "content": a}] if isinstance(t, list) else a
               for t, a in zip(local_texts, answers, strict=True)]
    row_columns = {k: [vals[i // group_size] for i in range(b)][local]
                   for k, vals in (columns or {}).items()}
    by_fn = score(reward_funcs, local_texts, answers, [list(c) for c in completions[local]],
                  row_columns)
    batch = {"tokens": tokens, "attention_mask": attention, "mask": mask}
    old = _sampler_log_probs(model, batch, strategy, float(temperature)) * mask
    total = combine(by_fn, weights, [str(t) for t in local_texts])
    weights_all = {k: np.asarray(v) for k, v in batch_weights(mask).items()}
    lengths = mask.sum(axis=1)
    batch = {k: v[local] for k, v in {**batch, **weights_all, "old_logps": old,
                                      "clipped": clipped}.items()}
    # The advantages of every row, from every process's rewards, by the same program on the
    # same shapes in every process: this process's rows then carry the one-process figures to
    # the bit (normalizing its own groups alone, XLA compiles another shape: 1 ulp apart).
    all_total, all_by_fn = _every_process(total, by_fn)
    unscorable = np.isnan(all_by_fn).all(axis=1)
    if unscorable.any():  # TRL's: out of their group's baseline, advantage 0
        advantages = scorable_advantages(all_total, unscorable, group_size, estimator)
    else:
        advantages = np.asarray(group_advantages(jnp.asarray(all_total), group_size, estimator))
    batch.update(rewards=total, rewards_by_fn=by_fn, all_lengths=lengths, all_clipped=clipped,
                 advantages=advantages[local], all_rewards=all_total, all_rewards_by_fn=all_by_fn,
                 prompt_texts=local_texts, completion_texts=answers)
    return batch


def _every_process(total: np.ndarray, by_fn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every process's rewards and rewards per function, in row order (with several processes
    one exchange through the coordinator's store: rows x (functions + 1) numbers, no device
    program), so that the logged reward statistics are the whole batch's."""
    if jax.process_count() == 1:
        return total, by_fn
    # JSON carries NaN (a function's None) as the token NaN, which json.loads reads back.
    shares = distributed.all_gather_json("grpo_rewards", [total.tolist(), by_fn.tolist()])
    return (np.concatenate([np.asarray(t, np.float32) for t, _ in shares]),
            np.concatenate([np.asarray(f, np.float32).reshape(-1, by_fn.shape[1])
                            for _, f in shares]))


def scorable_advantages(rewards: np.ndarray, unscorable: np.ndarray, group_size: int,
                        estimator: str = "grpo", eps: float = 1e-6) -> np.ndarray:
    """`group_advantages` over the completions some reward function applies to: the others
    (every function returned None) are left out of their group's mean and deviation and get
    advantage 0, as TRL's GRPOTrainer treats them.

    Example:
        >>> scorable_advantages(np.array([1.0, 0.0, 0.0, 9.0]), np.array([0, 0, 0, 1], bool),
        ...                     4, "drgrpo").tolist()
        [0.666..., -0.333..., -0.333..., 0.0]
    """
    r = np.where(unscorable, np.nan, rewards).astype(np.float64).reshape(-1, group_size)
    count = (~np.isnan(r)).sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nansum(r, axis=1, keepdims=True) / count
        if estimator == "drgrpo":
            out = r - mean
        elif estimator == "rloo":
            out = r - (np.nansum(r, axis=1, keepdims=True) - r) / (count - 1)
        else:
            std = np.sqrt(np.nansum(np.square(r - mean), axis=1, keepdims=True) / (count - 1))
            out = (r - mean) / (std + eps)
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0).reshape(-1).astype(np.float32)


def _share(prompts: int, group_size: int) -> slice:
    """The rows of this process's prompts (all of them with one process)."""
    count, index = jax.process_count(), jax.process_index()
    if prompts % count:
        raise ConfigurationError(
            f"{prompts} prompts per generation batch do not split over {count} processes: each "
            "process samples and scores whole groups of its own prompts. Use a multiple of "
            f"{count} (--data.prompts_per_step).")
    rows = prompts // count * group_size
    return slice(index * rows, (index + 1) * rows)


def _sampler_log_probs(model: nnx.Module, batch: dict[str, np.ndarray], strategy: Any,
                       temperature: float) -> np.ndarray:
    """`completion_log_probs` of every row of `batch` (NumPy, the same in every process).

    Under a mesh strategy the rows are split over its batch axes as the training step lays them
    out, with one process or several: the program (and so every rounding) is then the same
    for any number of processes on the same devices. Rows that do not split evenly are
    replicated."""
    graphdef, state = nnx.split(model)
    axes = getattr(strategy, "compute_batch_axes", None) if strategy is not None else None
    if axes is None:
        out = _old_log_probs(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()},
                             temperature=temperature)
        return np.asarray(distributed.gather(out), np.float32)
    mesh = strategy.require_mesh("rollout")
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    rows = len(batch["tokens"])
    lead = (axes[0] if len(axes) == 1 else axes) if axes and rows % size == 0 else None
    sharding = NamedSharding(mesh, PartitionSpec(lead, None))
    placed = {k: jax.device_put(v, sharding) for k, v in batch.items()}
    with strategy.trace_context():
        out = _old_log_probs(graphdef, state, placed, temperature=temperature)
    return np.asarray(distributed.gather(out), np.float32)
