"""GRPO on a pretrained Hugging Face model: sampled completions, verifiable rewards, a frozen
reference.

Group relative policy optimization (Shao et al. 2024) as Tunix's `GRPOLearner` runs it: every
generation batch samples `--grpo.group_size` completions of each of `--data.prompts_per_step`
prompts from the current policy (`posttrain.rollout`: the key/value-cache sampler, in the
training layout), scores each completion with Python reward functions of its text, turns the
rewards into group-relative advantages, and `--grpo.updates` optimizer steps (Tunix's
`num_iterations`, μ) train on it with the clipped objective and a KL penalty to the reference.

    jaxlight fit grpo --model.pretrained PATH
    jaxlight fit grpo --model.pretrained PATH --lora.rank 8
    jaxlight fit grpo --model.pretrained PATH --mesh-shape '[[4,1],["fsdp","tp"]]'

    jaxlight fit grpo --model.pretrained PATH --data.path problems.jsonl \
        --grpo.reward_funcs rewards.py:correct,rewards.py:short --grpo.reward_weights 1,0.5

Your data: `--data.path` names a local JSONL/JSON/Parquet file or a `datasets` directory with a
`prompt` column (text, or chat messages) and any others (answers, ids); reward functions have
TRL's contract `f(prompts, completions, completion_ids, **columns) -> list[float | None]`
(`posttrain.score`), named `PATH.py:function` or `package.module:function`. Without
`--data.path` a built-in task runs (`--data.task`): `reversal` (the user asks `Reverse abc`;
`reversal_reward` 1 for exactly the reversed word, `format_reward` 0.5 for lowercase letters of
the word's length) or `arithmetic` (word problems generated offline; `answer_reward` 1 for the
exact integer, `integer_format_reward` 0.5 for a bare integer). The recipe reports the held-out
prompts' greedy mean reward before and after training.

Sampling reads the policy after the previous optimizer step: the loop pulls a generation batch
after dispatching the step before it, and `module.model` then holds that step's result (the
feed's `reads_live_model` tells the loop to read no batch ahead, whatever `prefetch_batches`).
Sampling and training share the training layout (nothing is resharded): the sampler
runs on the train state's arrays in place. The data's position (generation index, updates taken
on the current generation batch, the batch itself) is checkpointed, and each generation's
prompts and sampling seed follow from `--data.seed` and its index, so a resumed run samples
what the uninterrupted one did.

From Python:

    >>> from jaxlight.recipes import grpo
    >>> grpo.reversal_reward(["Reverse abc"], ["cba"], [[7, 8]], word=["abc"])
    [1.0]
    >>> grpo.format_reward(["Reverse abc"], ["cbz"], [[7, 8]], word=["abc"])
    [0.5]
"""

from __future__ import annotations

import base64
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlight import distributed, posttrain
from jaxlight._errors import CheckpointError, ConfigurationError, DataError, MissingAttributeError
from jaxlight.module._module import TrainModule
from jaxlight.nn.pretrained import (
    DecoderLM,
    Tokenizer,
    from_hf_config,
    from_pretrained,
    generate,
    read_config,
)
from jaxlight.nn.pretrained._model import check_positions
from jaxlight.posttrain._data import as_messages, prompt_rows, read_rows
from jaxlight.recipes._base import Recipe, RecipeData, option, section
from jaxlight.recipes._chat_sft import parse_targets, refuse_expert_targets
from jaxlight.recipes._grpo_tasks import (
    TASKS,
    answer_reward,
    arithmetic_rows,
    format_reward,
    integer_format_reward,
    parse_reward_funcs,
    parse_weights,
    reversal_reward,
    reversal_rows,
)
from jaxlight.recipes._lora import add_lora
from jaxlight.recipes.dpo import base_weights, pretrained_decoder
from jaxlight.strategies import Strategy

__all__ = ["Config", "GenerationFeed", "PolicyOptimizer", "answer_reward", "arithmetic_rows",
           "build", "format_reward", "integer_format_reward", "reversal_reward",
           "reward_functions"]


@dataclasses.dataclass
class ModelConfig:
    pretrained: str = option("", "Hugging Face model directory (config.json, *.safetensors, "
                                 "tokenizer.json with a chat template); required")
    dtype: str = option("float32", "parameter dtype of the loaded weights")


@dataclasses.dataclass
class LoRAConfig:
    rank: int = option(0, "LoRA rank on --lora.targets (0: train every weight; with LoRA the "
                          "reference is the policy with its adapters off, no second copy)")
    alpha: float = option(16.0, "LoRA scale numerator")
    targets: str = option("q_proj,v_proj", "projections LoRA adapts, comma separated")


@dataclasses.dataclass
class DataConfig:
    path: str = option("", "your prompts: a .jsonl/.json/.parquet file or a datasets directory "
                           "with a 'prompt' column (other columns reach the reward functions); "
                           "empty: the built-in --data.task")
    task: str = option("reversal", "built-in task without --data.path: reversal or arithmetic")
    val_rows: int = option(16, "rows of --data.path or arithmetic problems held out (greedy "
                               "reward before and after)")
    problems: int = option(256, "training problems of the arithmetic task")
    prompts_per_step: int = option(8, "prompts per generation batch (rows: this x group_size, "
                                      "a multiple of the data-parallel degree)")
    words: int = option(64, "training words of the reversal task")
    val_words: int = option(16, "held-out words (greedy reward before and after)")
    alphabet: str = option("abcdefgh", "letters the words are drawn from")
    min_len: int = option(3, "shortest word")
    max_len: int = option(4, "longest word")
    prompt_len: int = option(0, "prompt tokens (chat template included; left-padded); 0: the "
                                "longest training prompt's")
    seed: int = option(0, "words, each generation's prompts and its sampling seed")


@dataclasses.dataclass
class GRPOConfig:
    group_size: int = option(8, "completions sampled per prompt (G)")
    max_new_tokens: int = option(6, "completion tokens at most")
    temperature: float = option(1.0, "sampling temperature (the log-probabilities use it too)")
    updates: int = option(2, "optimizer steps per generation batch (Tunix's num_iterations, μ)")
    beta: float = option(0.04, "KL penalty weight (Tunix's default)")
    epsilon: float = option(0.2, "clip range of the probability ratio (Tunix's default)")
    kl_mode: str = option("kl", "kl, low_var_kl or mse_kl (Tunix's kl_loss_mode)")
    loss_agg_mode: str = option("sequence-mean-token-mean", "token-mean, "
                                "sequence-mean-token-mean, seq-mean-token-sum or "
                                "sequence-mean-token-sum-norm")
    advantage: str = option("grpo", "grpo, drgrpo or rloo")
    reward_funcs: str = option("", "reward functions, comma separated: PATH.py:fn or "
                                   "package.module:fn with TRL's signature f(prompts, "
                                   "completions, completion_ids, **columns); empty: the task's")
    reward_weights: str = option("", "one weight per reward function, comma separated "
                                     "(empty: all 1)")
    log_samples: int = option(8, "completions of each generation batch logged as a text table "
                                 "(prompt, completion, rewards, advantage) to W&B and MLflow "
                                 "loggers at the logging step after it (0: none)")


@dataclasses.dataclass
class OptimConfig:
    lr: float = option(3e-4, "Adam learning rate (the tiny fixture's; ~1e-6 for real models)")


@dataclasses.dataclass
class Config:
    model: ModelConfig = section(ModelConfig)
    lora: LoRAConfig = section(LoRAConfig)
    data: DataConfig = section(DataConfig)
    grpo: GRPOConfig = section(GRPOConfig)
    optim: OptimConfig = section(OptimConfig)


# -- the built-in tasks (see _grpo_tasks) ------------------------------------------------------


def reward_functions(task: str = "reversal") -> list[Callable]:
    """A built-in task's reward functions (TRL's contract), summed per completion."""
    return list(TASKS[task])


def _words(n: int, config: DataConfig, exclude: set[str]) -> list[str]:
    rng = np.random.default_rng(config.seed)
    letters = np.array(list(config.alphabet))
    space = sum(len(letters) ** k for k in range(config.min_len, config.max_len + 1))
    if n + len(exclude) > space:
        raise ConfigurationError(
            f"grpo task: {n} more distinct words asked for but only {space - len(exclude)} "
            f"exist with {len(letters)} letters and lengths {config.min_len}..{config.max_len}; "
            "lower --data.words / --data.val_words or lengthen the words.")
    out, seen = [], set(exclude)
    while len(out) < n:
        w = "".join(rng.choice(letters, int(rng.integers(config.min_len, config.max_len + 1))))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[Any]) -> list[list[int]]:
    """Prompts (text: one user turn, or chat messages) with the chat template's assistant
    prefix, as token ids."""
    return [tokenizer.apply_chat_template(as_messages(p, "prompt"), add_generation_prompt=True)
            for p in prompts]


# -- the module --------------------------------------------------------------------------------


class PolicyOptimizer(TrainModule):
    """GRPO of a pretrained `DecoderLM` against a frozen reference (a copy, or with LoRA the
    policy with its adapters off).

    Args:
        pretrained: the Hugging Face model directory.
        base_params: its weights (`jaxlight.recipes.dpo.base_weights`), or None: random.
        lora_rank, lora_alpha, lora_targets: LoRA on the named projections; rank 0 trains all.
        beta, epsilon, kl_mode, loss_agg_mode, temperature: `posttrain.grpo_loss`'s and the
            sampler's temperature.
        lr: Adam's learning rate.
        dtype: parameter dtype.
    """

    def __init__(self, pretrained: str, base_params: Any = None, lora_rank: int = 0,
                 lora_alpha: float = 16.0, lora_targets: tuple[str, ...] = ("q_proj", "v_proj"),
                 beta: float = 0.04, epsilon: float = 0.2, kl_mode: str = "kl",
                 loss_agg_mode: str = "sequence-mean-token-mean", temperature: float = 1.0,
                 lr: float = 1e-3, dtype: str = "float32"):
        super().__init__()
        posttrain.check_grpo_options(beta, epsilon)
        self.pretrained, self.base_params = pretrained, base_params
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self.lora_targets = tuple(lora_targets)
        self.beta, self.epsilon, self.kl_mode = beta, epsilon, kl_mode
        self.loss_agg_mode, self.temperature = loss_agg_mode, temperature
        self.lr, self.dtype = lr, dtype
        self.decoder_config = from_hf_config(read_config(pretrained), param_dtype=jnp.dtype(dtype))
        refuse_expert_targets(self)
        self.trainable = nnx.LoRAParam if lora_rank > 0 else posttrain.POLICY
        #: Sample tables of generation batches not logged yet, by the step they first feed
        #: (`GenerationFeed(log_samples=)` adds them; `on_log` hands them to the loggers).
        self.pending_samples: list[tuple[int, int, dict]] = []

    @property
    def hparams(self) -> dict[str, Any]:
        out = type(super().hparams)(super().hparams)
        out["base_params"] = None if self.base_params is None else "pretrained"
        return out

    def _decoder(self) -> DecoderLM:
        # One seed: without base weights the reference still equals the policy.
        return pretrained_decoder(self)

    def configure_model(self, rngs: nnx.Rngs) -> nnx.Module:
        if self.lora_rank > 0:
            model = self._decoder()
            add_lora(model.layers, self.lora_rank, self.lora_alpha, rngs=rngs,
                     names=self.lora_targets)
            return model
        return posttrain.PolicyAndReference(self._decoder(), self._decoder())

    def policy(self, model: nnx.Module) -> nnx.Module:
        """The sampled and trained network of `model` (this module's model)."""
        return model if self.lora_rank > 0 else model.policy

    def reference(self, model: nnx.Module) -> nnx.Module:
        return posttrain.without_adapters(model) if self.lora_rank > 0 else model.reference

    def configure_optimizers(self) -> optax.GradientTransformation:
        return optax.adam(self.lr)

    def training_step(self, model, batch):
        t = self.temperature
        logps, entropy = posttrain.completion_log_probs(self.policy(model), batch, t,
                                                        entropy=True)
        ref = posttrain.completion_log_probs(self.reference(model), batch, t)
        weights = {k: batch[k] for k in ("token_weight", "row_weight")}
        loss, m = posttrain.grpo_loss(
            logps, batch["old_logps"], ref, batch["advantages"], batch["mask"],
            epsilon=self.epsilon, beta=self.beta, kl_mode=self.kl_mode,
            loss_agg_mode=self.loss_agg_mode, weights=weights)
        # `kl` is k3 (never negative, TRL's figure); `kl_penalty` the kl_mode's estimate the
        # loss uses (Tunix's `kl`; negative on many batches with the default "kl").
        out = {"reward": batch["rewards"].mean(), "kl": m["kl_k3"], "kl_penalty": m["kl"],
               "pg_clipfrac": m["pg_clipfrac"], "ppo_kl": m["ppo_kl"],
               "entropy": posttrain.masked_mean(entropy, batch["mask"], weights)}
        # The generation batch's host figures (per reward function, completion lengths), one
        # value repeated per row so that any split of the rows averages to it.
        out.update({k[len(STATS):]: v.mean() for k, v in batch.items() if k.startswith(STATS)})
        return loss, out

    def on_log(self, metrics: dict[str, float], step: int) -> None:
        """Hands the sample tables of the generation batches that fed steps up to `step` to the
        loggers that take text tables (W&B, MLflow), at `step` (after the loggers got its
        metrics)."""
        due = [p for p in self.pending_samples if p[0] <= step]
        if not due:
            return
        self.pending_samples = [p for p in self.pending_samples if p[0] > step]
        columns, rows = None, []
        for _, generation, table in due:
            columns, part = posttrain.sample_table(step, generation=generation, **table)
            rows += part
        posttrain.log_samples(self.loggers, columns, rows, step)


# -- the data: generation batches from the live policy -----------------------------------------

#: Batch keys of host figures the step logs (their mean) under the name that follows.
STATS = "stats/"
_BATCH_KEYS = ("tokens", "attention_mask", "mask", "rewards", "advantages", "old_logps",
               "token_weight", "row_weight")


def _encode_batch(batch: dict[str, np.ndarray]) -> dict:
    return {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                "data": base64.b64encode(np.ascontiguousarray(v).tobytes()).decode("ascii")}
            for k, v in batch.items()}


def _decode_batch(record: dict) -> dict[str, np.ndarray]:
    return {k: np.frombuffer(base64.b64decode(v["data"]), np.dtype(v["dtype"]))
            .reshape(v["shape"]).copy() for k, v in record.items()}


class GenerationFeed:
    """The GRPO training data: each generation batch, sampled from the current policy, is
    yielded `updates` times (one optimizer step each).

    It reads the policy as `module.model` when the loop pulls a batch: after the step before
    it was dispatched (`reads_live_model`: the loop reads no batch ahead), so the sampler sees
    that step's parameters. Generation `g` samples the prompts and the seed that
    `seed` and `g` fix. `state_dict`/`load_state_dict` make it a resumable loader: the
    generation index, the updates taken on the current batch and that batch (with several
    processes, every process's rows: each resumes with its own).

    Args:
        module: the `PolicyOptimizer` being fit.
        rows: the training rows, each a `prompt` (text or chat messages) and any other
            columns (`posttrain._data.prompt_rows`), as a user's dataset has them.
        tokenizer: applies the chat template to the prompts, decodes the completions.
        reward_funcs: reward functions with TRL's contract (`posttrain.score`): called with
            the rows' prompts as the data has them, the completions (text; assistant messages
            where the prompts are messages), their token ids and every other column.
        reward_weights: one weight per function (None: all 1).
        prompts_per_step, group_size, max_new_tokens, temperature, updates, advantage: see
            `Config`.
        prompt_len: prompts are left-padded to this many tokens (0: the longest's).
        seed: fixes each generation's prompts and sampling seed.
        log_samples: the first this many completions of each generation batch (this process's
            rows) go to the W&B and MLflow loggers as a text table (`posttrain.log_samples`)
            at the first logging step at or after the batch's first step; 0: none.
    """

    def __init__(self, module: PolicyOptimizer, rows: Sequence[dict], tokenizer: Tokenizer,
                 reward_funcs: Sequence[Callable], *, prompts_per_step: int, group_size: int,
                 max_new_tokens: int, temperature: float, updates: int, prompt_len: int = 0,
                 seed: int = 0, advantage: str = "grpo",
                 reward_weights: Sequence[float] | None = None, log_samples: int = 0):
        if updates < 1:
            raise ConfigurationError(f"--grpo.updates={updates}: each generation batch feeds at "
                                     "least one optimizer step.")
        if log_samples < 0:
            raise ConfigurationError(f"--grpo.log_samples={log_samples}: give the number of "
                                     "completions per generation batch to log, or 0 for none.")
        messages, self.columns = prompt_rows(rows, "the GRPO prompts")
        self.raw_prompts = [r["prompt"] for r in rows]
        prompts = encode_prompts(tokenizer, messages)
        if not 0 < prompts_per_step <= len(prompts):
            raise ConfigurationError(
                f"--data.prompts_per_step={prompts_per_step} must be between 1 and the "
                f"{len(prompts)} training prompts.")
        longest = max(len(p) for p in prompts)
        prompt_len = prompt_len or longest
        if longest > prompt_len:
            raise DataError(f"a prompt has {longest} tokens, more than --data.prompt_len "
                            f"{prompt_len}: raise it.")
        check_positions(module.decoder_config, prompt_len + max_new_tokens,
                        f"GRPO: prompts of --data.prompt_len {prompt_len} tokens (chat template "
                        f"included) plus --grpo.max_new_tokens {max_new_tokens} make",
                        "drop or shorten the longest prompts, or lower --grpo.max_new_tokens")
        self.module, self.prompts, self.tokenizer = module, prompts, tokenizer
        self.reward_funcs = list(reward_funcs)
        self.reward_weights = posttrain._rewards.check_weights(reward_weights,
                                                               len(self.reward_funcs))
        names = [posttrain.reward_name(f) for f in self.reward_funcs]
        self.reward_names = [n if names.count(n) == 1 else f"{n}_{i}"
                             for i, n in enumerate(names)]
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.updates, self.prompt_len, self.seed = updates, prompt_len, seed
        self.advantage, self.log_samples = advantage, log_samples
        self.generation = 0  # generation batches made
        self.taken = 0  # updates the current one has fed
        self.batch: dict[str, np.ndarray] | None = None
        self._saved: Any = None  # the batch's checkpoint record (`_batch_record`)
        #: Per generation batch made in this process: (index, mean reward of every process's
        #: rows, seconds sampling).
        self.history: list[tuple[int, float, float]] = []

    #: The training loop reads each batch right after dispatching the step before it, never
    #: ahead (whatever `prefetch_batches`): the sampler needs that step's parameters.
    reads_live_model = True

    def __len__(self) -> int:  # no epochs: one endless pass, bounded by max_steps
        return 2 ** 62

    def picked(self, generation: int) -> tuple[list[int], int]:
        """Generation `generation`'s row indices and sampling seed."""
        rng = np.random.default_rng([self.seed, generation])
        picked = rng.choice(len(self.prompts), self.prompts_per_step, replace=False)
        return [int(i) for i in picked], int(rng.integers(2 ** 31))

    def prompt_rows(self, generation: int) -> tuple[list[list[int]], int]:
        """Generation `generation`'s prompts (token ids) and sampling seed."""
        picked, seed = self.picked(generation)
        return [self.prompts[i] for i in picked], seed

    def _sampler(self) -> tuple[nnx.Module, Any]:
        module = self.module
        fit = module.trainer
        try:
            model = module.model
        except MissingAttributeError:
            # The loop reads the first batch before the train state exists: generation 0 is
            # sampled from the pretrained weights the policy starts from (with LoRA, the
            # adapters start at zero: the same function), placed by the fit's strategy as the
            # state will be, so that the sampler compiles once.
            strategy = fit.strategy
            if module.base_params is None or not isinstance(strategy, Strategy):
                return module.policy(module.configure_model(nnx.Rngs(fit.seed or 0))), None
            return from_pretrained(module.pretrained, strategy,
                                   param_dtype=jnp.dtype(module.dtype)), strategy
        return module.policy(model), fit.strategy

    def _generate(self) -> dict[str, np.ndarray]:
        start = time.perf_counter()
        picked, seed = self.picked(self.generation)
        policy, strategy = self._sampler()
        batch = posttrain.rollout(
            policy, [self.prompts[i] for i in picked], group_size=self.group_size,
            max_new_tokens=self.max_new_tokens, reward_funcs=self.reward_funcs,
            decode=self.tokenizer.decode, temperature=self.temperature, seed=seed,
            prompt_len=self.prompt_len, strategy=strategy,
            columns={k: [v[i] for i in picked] for k, v in self.columns.items()},
            reward_weights=self.reward_weights,
            reward_prompts=[self.raw_prompts[i] for i in picked], estimator=self.advantage)
        self.history.append((self.generation, float(batch["all_rewards"].mean()),
                             time.perf_counter() - start))
        if self.log_samples > 0 and hasattr(self.module, "pending_samples"):
            n = self.log_samples
            first_step = self.generation * self.updates + 1
            self.module.pending_samples.append((first_step, self.generation, {
                "prompts": batch["prompt_texts"][:n], "completions": batch["completion_texts"][:n],
                "by_fn": batch["rewards_by_fn"][:n], "names": self.reward_names,
                "rewards": batch["rewards"][:n], "advantages": batch["advantages"][:n],
                "limit": n}))
        return {**{k: batch[k] for k in _BATCH_KEYS}, **self._stats(batch)}

    def _stats(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The generation batch's figures to log, each repeated once per row."""
        # Every figure is the whole generation batch's, every process's rows included.
        lengths, rows = batch["all_lengths"], len(batch["rewards"])
        rewards = batch["all_rewards"]
        figures = {"reward_std": float(rewards.std(ddof=1)) if len(rewards) > 1 else 0.0,
                   "completions/mean_length": float(lengths.mean()),
                   "completions/max_length": float(lengths.max()),
                   "completions/clipped_ratio": float(batch["all_clipped"].mean()),
                   **posttrain.reward_metrics(batch["all_rewards_by_fn"], self.reward_names)}
        return {STATS + k: np.full(rows, v, np.float32) for k, v in figures.items()}

    def __iter__(self):
        while True:
            if self.batch is None or self.taken >= self.updates:
                self.batch = self._generate()
                self.generation += 1
                self.taken = 0
                self._saved = self._batch_record()
            self.taken += 1  # before the yield: the loop reads state_dict() right after it
            yield self.batch

    def _batch_record(self) -> Any:
        """The current generation batch as a checkpoint keeps it (None: it feeds one update,
        no checkpoint resumes inside it): with several processes, every process's rows (each
        holds its own prompts' rows; the checkpoint's record is process 0's), gathered once
        per generation batch."""
        if self.updates < 2:
            return None
        record = _encode_batch(self.batch)
        if distributed.process_count() == 1:
            return record
        return distributed.all_gather_json("grpo_generation_batch", record)

    def state_dict(self) -> dict:
        keep = self.batch is not None and self.taken < self.updates
        record = self._saved if keep else None
        if isinstance(record, list):  # several processes: each one's rows, in process order
            return {"generation": self.generation, "taken": self.taken, "batch": None,
                    "batches": record}
        return {"generation": self.generation, "taken": self.taken, "batch": record}

    def load_state_dict(self, state: dict) -> None:
        self.generation, self.taken = int(state["generation"]), int(state["taken"])
        record, batches = state.get("batch"), state.get("batches")
        count = distributed.process_count()
        held = len(batches) if batches is not None else 1 if record is not None else None
        if held is not None and held != count:
            raise CheckpointError(
                f"the checkpoint stopped inside GRPO generation batch {self.generation - 1} "
                f"({self.taken} of its {self.updates} updates taken), whose rows {held} "
                f"process(es) held, but this run has {count}: each process trains on its own "
                f"prompts' rows, so resume with {held} process(es), or from a checkpoint at a "
                "generation batch's last update (step a multiple of --grpo.updates).")
        if batches is not None:
            record = batches[distributed.process_index()]
        self.batch = None if record is None else _decode_batch(record)
        self._saved = batches if batches is not None else record
        if self.batch is None:
            self.taken = self.updates


# -- evaluation and the recipe -----------------------------------------------------------------


def greedy_reward(policy: nnx.Module, feed: GenerationFeed, rows: Sequence[dict],
                  strategy: Any = None) -> dict[str, float]:
    """The mean weighted reward of greedy completions of `rows`' prompts, and each reward
    function's mean over the rows it applies to, with the feed's functions and weights."""
    messages, columns = prompt_rows(rows, "the held-out prompts")
    prompts = encode_prompts(feed.tokenizer, messages)
    outs = generate(policy, prompts, feed.max_new_tokens, strategy=strategy)
    raw = [r["prompt"] for r in rows]
    texts = [feed.tokenizer.decode(c) for c in outs]
    texts = [[{"role": "assistant", "content": t}] if isinstance(p, list) else t
             for p, t in zip(raw, texts, strict=True)]
    by_fn = posttrain.score(feed.reward_funcs, raw, texts, outs, columns)
    total = posttrain.combine(by_fn, feed.reward_weights)
    out = {"reward": float(total.mean())}
    for j, name in enumerate(feed.reward_names):
        kept = by_fn[:, j][~np.isnan(by_fn[:, j])]
        out[f"reward_{name}"] = float(kept.mean()) if kept.size else float("nan")
    return out


def task_rows(d: DataConfig) -> tuple[list[dict], list[dict]]:
    """The training and held-out rows: `--data.path`'s, or the built-in task's."""
    if d.path:
        rows = read_rows(d.path)
        if len(rows) <= d.val_rows:
            raise DataError(f"{d.path} has {len(rows)} rows; holding out --data.val_rows "
                            f"{d.val_rows} leaves none to train on: lower --data.val_rows.")
        order = np.random.default_rng(d.seed).permutation(len(rows))
        rows = [rows[i] for i in order]
        return rows[d.val_rows:], rows[:d.val_rows]
    if d.task == "arithmetic":
        rows = arithmetic_rows(d.problems + d.val_rows, d.seed)
        return rows[d.val_rows:], rows[:d.val_rows]
    val_words = _words(d.val_words, d, set())
    words = _words(d.words, dataclasses.replace(d, seed=d.seed + 1), set(val_words))
    return reversal_rows(words), reversal_rows(val_words)


def build(config: Config | None = None, max_steps: int | None = None
          ) -> tuple[PolicyOptimizer, RecipeData]:
    """The GRPO module (with the pretrained weights) and its generation feed."""
    config = config or Config()
    del max_steps  # constant learning rate
    if not config.model.pretrained:
        raise ConfigurationError("the grpo recipe needs --model.pretrained PATH, a Hugging Face "
                                 "model directory (config.json, safetensors, tokenizer.json).")
    d, g, lora = config.data, config.grpo, config.lora
    for name, value, options in (("kl_mode", g.kl_mode, posttrain.KL_MODES),
                                 ("loss_agg_mode", g.loss_agg_mode, posttrain.AGGREGATIONS),
                                 ("advantage", g.advantage, posttrain.ADVANTAGES),
                                 ("task", d.task, tuple(TASKS))):
        if value not in options:
            section_name = "data" if name == "task" else "grpo"
            raise ConfigurationError(
                f"--{section_name}.{name}={value!r} is not one of {options}.")
    posttrain.check_grpo_options(g.beta, g.epsilon, prefix="--grpo.")
    reward_funcs = parse_reward_funcs(g.reward_funcs, d.task)
    reward_weights = parse_weights(g.reward_weights)
    posttrain._rewards.check_weights(reward_weights, len(reward_funcs))
    tokenizer = Tokenizer(config.model.pretrained)
    rows, val_rows = task_rows(d)
    module = PolicyOptimizer(
        config.model.pretrained, base_weights(config.model.pretrained, config.model.dtype),
        lora_rank=lora.rank, lora_alpha=lora.alpha,
        lora_targets=parse_targets(lora.targets) if lora.rank > 0 else (),
        beta=g.beta, epsilon=g.epsilon, kl_mode=g.kl_mode, loss_agg_mode=g.loss_agg_mode,
        temperature=g.temperature, lr=config.optim.lr, dtype=config.model.dtype)
    feed = GenerationFeed(
        module, rows, tokenizer, reward_funcs, reward_weights=reward_weights,
        prompts_per_step=d.prompts_per_step, group_size=g.group_size,
        max_new_tokens=g.max_new_tokens, temperature=g.temperature, updates=g.updates,
        prompt_len=d.prompt_len, seed=d.seed, advantage=g.advantage,
        log_samples=g.log_samples)
    return module, RecipeData(train=feed, extras={"tokenizer": tokenizer, "val_rows": val_rows})


def _held_out(module: PolicyOptimizer, policy, data: RecipeData, config: Config,
              strategy=None) -> dict[str, float]:
    return greedy_reward(policy, data.train, data.extras["val_rows"], strategy)


def before_fit(fit, module: PolicyOptimizer, data: RecipeData, config: Config) -> dict:
    """Held-out greedy reward of the pretrained model."""
    out = _held_out(module, module.policy(module.configure_model(nnx.Rngs(0))), data, config)
    return {f"val_{k}": v for k, v in out.items()}


def after_fit(fit, module: PolicyOptimizer, data: RecipeData, config: Config) -> dict:
    """Held-out greedy reward of the trained policy, and the sampled batches' mean rewards."""
    out = _held_out(module, module.policy(module.model), data, config, fit.strategy)
    feed = data.train
    out = {f"val_{k}": v for k, v in out.items()}
    if feed.history:
        out["train_reward_first"] = feed.history[0][1]
        out["train_reward_last"] = feed.history[-1][1]
    return out


RECIPE = Recipe(
    name="grpo",
    summary="GRPO of a pretrained Hugging Face model on your prompts and reward functions "
            "(TRL's contract) or a built-in verifiable task, KL to a frozen reference; held-out "
            "greedy reward before/after",
    config=Config,
    build=build,
    fit_defaults={"max_steps": 40, "log_every_n_steps": 4},
    before_fit=before_fit,
    after_fit=after_fit,
)
