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

The shipped task is string reversal: the user asks `Reverse abc` (the chat template of the
model), a completion earns `reversal_reward` (1 for exactly the reversed word) plus
`format_reward` (0.5 for an answer made of lowercase letters only, the word's length). The
recipe reports the held-out prompts' greedy mean reward before and after training.

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
    >>> grpo.reversal_reward("user\\nReverse abc\\nassistant\\n", "cba")
    1.0
    >>> grpo.format_reward("user\\nReverse abc\\nassistant\\n", "cbz")
    0.5
"""

from __future__ import annotations

import base64
import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlight import posttrain
from jaxlight._errors import ConfigurationError, DataError, MissingAttributeError
from jaxlight.module._module import TrainModule
from jaxlight.nn.pretrained import (
    DecoderLM,
    Tokenizer,
    from_hf_config,
    from_pretrained,
    generate,
    read_config,
)
from jaxlight.recipes._base import Recipe, RecipeData, option, section
from jaxlight.recipes._chat_sft import parse_targets
from jaxlight.recipes._lora import add_lora
from jaxlight.recipes.dpo import base_weights
from jaxlight.strategies import Strategy

__all__ = ["Config", "GenerationFeed", "PolicyOptimizer", "build", "format_reward",
           "reversal_reward", "reward_functions"]


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


# -- the shipped task --------------------------------------------------------------------------

_WORD = re.compile(r"Reverse (\S+)")


def _asked(prompt: str) -> str | None:
    found = _WORD.findall(prompt)
    return found[-1] if found else None


def reversal_reward(prompt: str, completion: str) -> float:
    """1 when the completion is exactly the reversal of the word the prompt asks about."""
    word = _asked(prompt)
    return float(word is not None and completion.strip() == word[::-1])


def format_reward(prompt: str, completion: str) -> float:
    """0.5 for an answer of lowercase letters only, as long as the asked word."""
    word, answer = _asked(prompt), completion.strip()
    return 0.5 * float(word is not None and len(answer) == len(word)
                       and re.fullmatch(r"[a-z]+", answer) is not None)


def reward_functions() -> list[Callable[[str, str], float]]:
    """The shipped task's rewards, summed per completion: correctness, then format."""
    return [reversal_reward, format_reward]


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


def encode_prompts(tokenizer: Tokenizer, words: Sequence[str]) -> list[list[int]]:
    """`Reverse <word>` as a user turn, with the chat template's assistant prefix."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Reverse {w}"}],
                                          add_generation_prompt=True) for w in words]


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
        self.pretrained, self.base_params = pretrained, base_params
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self.lora_targets = tuple(lora_targets)
        self.beta, self.epsilon, self.kl_mode = beta, epsilon, kl_mode
        self.loss_agg_mode, self.temperature = loss_agg_mode, temperature
        self.lr, self.dtype = lr, dtype
        self.decoder_config = from_hf_config(read_config(pretrained), param_dtype=jnp.dtype(dtype))
        self.trainable = nnx.LoRAParam if lora_rank > 0 else posttrain.POLICY

    @property
    def hparams(self) -> dict[str, Any]:
        out = type(super().hparams)(super().hparams)
        out["base_params"] = None if self.base_params is None else "pretrained"
        return out

    def _decoder(self) -> DecoderLM:
        # One seed: without base weights the reference still equals the policy.
        model = DecoderLM(self.decoder_config, rngs=nnx.Rngs(0))
        if self.base_params is not None:
            state = nnx.state(model, nnx.Param)
            nnx.replace_by_pure_dict(state, self.base_params)
            nnx.update(model, state)
        return model

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
        logps = posttrain.completion_log_probs(self.policy(model), batch, t)
        ref = posttrain.completion_log_probs(self.reference(model), batch, t)
        weights = {k: batch[k] for k in ("token_weight", "row_weight")}
        loss, m = posttrain.grpo_loss(
            logps, batch["old_logps"], ref, batch["advantages"], batch["mask"],
            epsilon=self.epsilon, beta=self.beta, kl_mode=self.kl_mode,
            loss_agg_mode=self.loss_agg_mode, weights=weights)
        return loss, {"reward": batch["rewards"].mean(), "kl": m["kl"],
                      "pg_clipfrac": m["pg_clipfrac"], "ppo_kl": m["ppo_kl"]}


# -- the data: generation batches from the live policy -----------------------------------------

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
    generation index, the updates taken on the current batch and that batch.

    Args:
        module: the `PolicyOptimizer` being fit.
        prompts: prompt token ids (the task's training prompts).
        tokenizer: decodes prompts and completions for the reward functions.
        rewards: reward functions `(prompt_text, completion_text) -> float`, summed.
        prompts_per_step, group_size, max_new_tokens, temperature, updates, advantage: see
            `Config`.
        prompt_len: prompts are left-padded to this many tokens.
        seed: fixes each generation's prompts and sampling seed.
    """

    def __init__(self, module: PolicyOptimizer, prompts: Sequence[Sequence[int]],
                 tokenizer: Tokenizer, rewards: Sequence[Callable[[str, str], float]], *,
                 prompts_per_step: int, group_size: int, max_new_tokens: int,
                 temperature: float, updates: int, prompt_len: int, seed: int = 0,
                 advantage: str = "grpo"):
        if updates < 1:
            raise ConfigurationError(f"--grpo.updates={updates}: each generation batch feeds at "
                                     "least one optimizer step.")
        if not 0 < prompts_per_step <= len(prompts):
            raise ConfigurationError(
                f"--data.prompts_per_step={prompts_per_step} must be between 1 and the "
                f"{len(prompts)} training prompts.")
        longest = max(len(p) for p in prompts)
        prompt_len = prompt_len or longest
        if longest > prompt_len:
            raise DataError(f"a prompt has {longest} tokens, more than --data.prompt_len "
                            f"{prompt_len}: raise it.")
        self.module, self.prompts, self.tokenizer = module, [list(p) for p in prompts], tokenizer
        self.rewards = list(rewards)
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.updates, self.prompt_len, self.seed = updates, prompt_len, seed
        self.advantage = advantage
        self.generation = 0  # generation batches made
        self.taken = 0  # updates the current one has fed
        self.batch: dict[str, np.ndarray] | None = None
        #: Per generation batch made in this process: (index, mean reward, seconds sampling).
        self.history: list[tuple[int, float, float]] = []

    #: The training loop reads each batch right after dispatching the step before it, never
    #: ahead (whatever `prefetch_batches`): the sampler needs that step's parameters.
    reads_live_model = True

    def __len__(self) -> int:  # no epochs: one endless pass, bounded by max_steps
        return 2 ** 62

    def prompt_rows(self, generation: int) -> tuple[list[list[int]], int]:
        """Generation `generation`'s prompts and sampling seed."""
        rng = np.random.default_rng([self.seed, generation])
        picked = rng.choice(len(self.prompts), self.prompts_per_step, replace=False)
        return [self.prompts[i] for i in picked], int(rng.integers(2 ** 31))

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
        prompts, seed = self.prompt_rows(self.generation)
        policy, strategy = self._sampler()
        batch = posttrain.rollout(
            policy, prompts, group_size=self.group_size, max_new_tokens=self.max_new_tokens,
            rewards=self.rewards, decode=self.tokenizer.decode, temperature=self.temperature,
            seed=seed, prompt_len=self.prompt_len, strategy=strategy)
        if self.advantage != "grpo":
            batch["advantages"] = np.asarray(posttrain.group_advantages(
                jnp.asarray(batch["rewards"]), self.group_size, self.advantage))
        self.history.append((self.generation, float(batch["rewards"].mean()),
                             time.perf_counter() - start))
        return {k: batch[k] for k in _BATCH_KEYS}

    def __iter__(self):
        while True:
            if self.batch is None or self.taken >= self.updates:
                self.batch = self._generate()
                self.generation += 1
                self.taken = 0
            self.taken += 1  # before the yield: the loop reads state_dict() right after it
            yield self.batch

    def state_dict(self) -> dict:
        keep = self.batch is not None and self.taken < self.updates
        return {"generation": self.generation, "taken": self.taken,
                "batch": _encode_batch(self.batch) if keep else None}

    def load_state_dict(self, state: dict) -> None:
        self.generation, self.taken = int(state["generation"]), int(state["taken"])
        self.batch = None if state.get("batch") is None else _decode_batch(state["batch"])
        if self.batch is None:
            self.taken = self.updates


# -- evaluation and the recipe -----------------------------------------------------------------


def greedy_reward(policy: nnx.Module, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]],
                  max_new_tokens: int, strategy: Any = None) -> dict[str, float]:
    """The mean reward (and its parts) of greedy completions of `prompts`."""
    outs = generate(policy, prompts, max_new_tokens, strategy=strategy)
    parts = np.array([[fn(tokenizer.decode(p), tokenizer.decode(c))
                       for fn in reward_functions()] for p, c in zip(prompts, outs, strict=True)])
    return {"reward": float(parts.sum(1).mean()), "correct": float(parts[:, 0].mean()),
            "format": float((parts[:, 1] > 0).mean())}


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
                                 ("advantage", g.advantage, posttrain.ADVANTAGES)):
        if value not in options:
            raise ConfigurationError(f"--grpo.{name}={value!r} is not one of {options}.")
    tokenizer = Tokenizer(config.model.pretrained)
    val_words = _words(d.val_words, d, set())
    words = _words(d.words, dataclasses.replace(d, seed=d.seed + 1), set(val_words))
    module = PolicyOptimizer(
        config.model.pretrained, base_weights(config.model.pretrained, config.model.dtype),
        lora_rank=lora.rank, lora_alpha=lora.alpha,
        lora_targets=parse_targets(lora.targets) if lora.rank > 0 else (),
        beta=g.beta, epsilon=g.epsilon, kl_mode=g.kl_mode, loss_agg_mode=g.loss_agg_mode,
        temperature=g.temperature, lr=config.optim.lr, dtype=config.model.dtype)
    feed = GenerationFeed(
        module, encode_prompts(tokenizer, words), tokenizer, reward_functions(),
        prompts_per_step=d.prompts_per_step, group_size=g.group_size,
        max_new_tokens=g.max_new_tokens, temperature=g.temperature, updates=g.updates,
        prompt_len=d.prompt_len, seed=d.seed, advantage=g.advantage)
    return module, RecipeData(train=feed, extras={
        "tokenizer": tokenizer, "val_prompts": encode_prompts(tokenizer, val_words)})


def _held_out(module: PolicyOptimizer, policy, data: RecipeData, config: Config,
              strategy=None) -> dict[str, float]:
    return greedy_reward(policy, data.extras["tokenizer"], data.extras["val_prompts"],
                         config.grpo.max_new_tokens, strategy)


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
    summary="GRPO of a pretrained Hugging Face model on string reversal (verifiable rewards), "
            "KL to a frozen reference; held-out greedy reward before/after",
    config=Config,
    build=build,
    fit_defaults={"max_steps": 40, "log_every_n_steps": 4},
    before_fit=before_fit,
    after_fit=after_fit,
)
