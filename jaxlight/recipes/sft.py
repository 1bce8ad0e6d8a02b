"""Supervised fine-tuning of a `gpt` model to reverse strings, with an optional LoRA.

Post-training as Tunix does it: a pretrained byte-level `gpt` model learns a task whose answers
can be checked. A prompt is a random word and `=`, the answer the word reversed and a newline
(`"cabd=dbac\\n"`); the loss counts only the answer bytes. The recipe reports exact-match
accuracy before and after fine-tuning.

    jaxlight fit sft                                        # pretrains a tiny gpt in-process first
    jaxlight fit sft --base.checkpoint runs/gpt/checkpoints # start from a `jaxlight fit gpt` run
    jaxlight fit sft --lora.rank 0                          # full fine-tuning instead of LoRA
    jaxlight fit sft --strategy fsdp --task.max_len 8

On a pretrained Hugging Face model (Llama 3, Qwen 2/3, Gemma 3; see docs/pretrained.md) the data
is chat, the loss the assistant's tokens, LoRA on the named projections:

    jaxlight fit sft --model.pretrained PATH --data.jsonl chats.jsonl \
        --mesh-shape '[[4,1],["fsdp","tp"]]' --export.path tuned/

With `--lora.rank r > 0` (the default) every dense layer of the transformer blocks gains
`nnx.LoRAParam` factors `A[in, r]`, `B[r, out]` (B starts at zero, so the fine-tuned model
starts exactly at the base model), and the module sets `trainable = nnx.LoRAParam`: only the
adapters get gradients and optimizer state, and only they are checkpointed; the base weights
ride along frozen and are rebuilt (pretrained or loaded, then fingerprint-checked) on restore.

Exact match is measured in the compiled validation step, teacher-forced: an answer is exact
when the argmax at every answer position is the right byte. For greedy decoding this is the
same event as "the generated answer equals the reference" (each generated prefix is then the
reference prefix), so the figure equals free-running greedy generation's; `after_fit` checks it
by actually generating.

From Python:

    >>> from jaxlight.recipes import sft
    >>> sft.make_example("abc")
    ('abc=', 'cba\\n')
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxlight as jl
from jaxlight._errors import CheckpointError, ConfigurationError
from jaxlight.data import ArrayLoader
from jaxlight.module._module import TrainModule
from jaxlight.nn import TransformerLM
from jaxlight.recipes import gpt
from jaxlight.recipes._base import Recipe, RecipeData, option, section
from jaxlight.recipes._chat_sft import after_fit_pretrained, build_pretrained
from jaxlight.recipes._lora import LoRADense, add_lora

__all__ = ["Config", "FineTuner", "LoRADense", "add_lora", "build", "make_example",
           "pretrained_params"]

SEP, END = "=", "\n"


@dataclasses.dataclass
class BaseConfig:
    checkpoint: str | None = option(
        None, "checkpoint of a `jaxlight fit gpt` run (a step directory or a checkpoint "
              "directory); None: pretrain a gpt in-process first")
    pretrain_steps: int = option(100, "gpt steps to pretrain when no checkpoint is given "
                                      "(0: start from random weights)")


@dataclasses.dataclass
class TaskConfig:
    min_len: int = option(3, "shortest word to reverse")
    max_len: int = option(5, "longest word; the sequence is 2 * max_len + 2 bytes")
    alphabet: str = option("abcdefgh", "letters words are drawn from")
    train_examples: int = option(8192, "generated training examples")
    val_examples: int = option(256, "validation examples (never in the training set)")
    seed: int = option(0, "seed of the generated examples")


@dataclasses.dataclass
class LoraConfig:
    rank: int = option(8, "LoRA rank of every dense layer in the blocks; 0: full fine-tuning")
    alpha: float = option(16.0, "LoRA scale numerator: the update is (x·A·B)·alpha/rank")
    targets: str = option("q_proj,v_proj", "with --model.pretrained: the projections LoRA "
                          "adapts in every layer (q_proj k_proj v_proj o_proj gate_proj up_proj "
                          "down_proj, and an MoE model's experts.gate_proj experts.up_proj "
                          "experts.down_proj, comma-separated)")


@dataclasses.dataclass
class DataConfig:
    batch_size: int = option(64, "global batch of examples; a multiple of 8 devices")
    jsonl: str | None = option(None, "with --model.pretrained: chat data, one "
                               "{\"messages\": [{\"role\", \"content\"}, ...]} a line; None: "
                               "the reversal task written as chat")
    max_length: int = option(48, "with --model.pretrained: tokens per conversation (longer ones "
                             "are cut)")
    val_fraction: float = option(0.1, "with --data.jsonl: the last fraction of conversations "
                                 "held out for validation")


@dataclasses.dataclass
class SftModelConfig(gpt.ModelConfig):
    pretrained: str | None = option(
        None, "a Hugging Face model directory (Llama 3, Qwen 2/3, Gemma 3: config.json, "
              "*.safetensors, tokenizer.json) to fine-tune on chat data instead of a gpt model")


@dataclasses.dataclass
class ExportConfig:
    path: str | None = option(None, "with --model.pretrained: write the fine-tuned model (LoRA "
                              "merged) here in Hugging Face's layout, with the tokenizer")


@dataclasses.dataclass
class OptimConfig:
    lr: float = option(3e-3, "peak AdamW learning rate (LoRA tolerates large rates)")
    warmup_steps: int = option(20, "linear warm-up steps")
    weight_decay: float = option(0.0, "AdamW weight decay; none, adapters start at zero")


@dataclasses.dataclass
class Config:
    """Every setting of the sft recipe (`jaxlight fit sft --help` lists them)."""

    base: BaseConfig = section(BaseConfig)
    model: SftModelConfig = section(SftModelConfig)
    task: TaskConfig = section(TaskConfig)
    lora: LoraConfig = section(LoraConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    export: ExportConfig = section(ExportConfig)


# -- the task --------------------------------------------------------------------------------------


def make_example(word: str) -> tuple[str, str]:
    """(prompt, answer) for one word."""
    return word + SEP, word[::-1] + END


def _words(task: TaskConfig, n: int, rng: np.random.Generator, exclude: set[str]) -> list[str]:
    letters = np.array(list(task.alphabet))
    space = sum(len(letters) ** k for k in range(task.min_len, task.max_len + 1))
    if n > space - len(exclude):
        raise ConfigurationError(
            f"sft task: {n} distinct words asked for but only {space - len(exclude)} exist with "
            f"{len(letters)} letters and lengths {task.min_len}..{task.max_len}; lower "
            "task.train_examples or lengthen the words."
        )
    out: list[str] = []
    seen = set(exclude)
    while len(out) < n:
        length = int(rng.integers(task.min_len, task.max_len + 1))
        word = "".join(rng.choice(letters, length))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


def encode(words: list[str], task: TaskConfig) -> dict[str, np.ndarray]:
    """`{"tokens": uint8[n, T], "mask": float32[n, T-1], "prompt_len": int32[n]}`.

    `mask[i, t]` is 1 where token `t + 1` is an answer byte (the loss's targets); sequences are
    right-padded with newlines, which the mask ignores.
    """
    width = 2 * task.max_len + 2
    tokens = np.full((len(words), width), ord(END), np.uint8)
    mask = np.zeros((len(words), width - 1), np.float32)
    prompt_len = np.zeros(len(words), np.int32)
    for i, word in enumerate(words):
        prompt, answer = make_example(word)
        text = (prompt + answer).encode()
        tokens[i, :len(text)] = np.frombuffer(text, np.uint8)
        mask[i, len(prompt) - 1:len(text) - 1] = 1.0
        prompt_len[i] = len(prompt)
    return {"tokens": tokens, "mask": mask, "prompt_len": prompt_len}


def task_data(task: TaskConfig) -> dict[str, dict[str, np.ndarray]]:
    """Disjoint generated train and validation sets."""
    rng = np.random.default_rng(task.seed)
    val = _words(task, task.val_examples, rng, set())
    train = _words(task, task.train_examples, rng, set(val))
    return {"train": encode(train, task), "val": encode(val, task), "val_words": val}


# -- the module ------------------------------------------------------------------------------------


class FineTuner(TrainModule):
    """Fine-tunes a byte-level `TransformerLM` on masked answer tokens.

    Args:
        model: the base model's shape (a `gpt.ModelConfig` as a dict).
        base_params: the pretrained parameters as a pure dict of arrays, or None (random).
        lora_rank, lora_alpha: LoRA adapters on every block dense layer; rank 0 trains all
            parameters instead.
        lr, warmup_steps, weight_decay: AdamW with linear warm-up, then constant.
    """

    def __init__(self, model: dict | None = None, base_params: Any = None, lora_rank: int = 8,
                 lora_alpha: float = 16.0, lr: float = 3e-3, warmup_steps: int = 20,
                 weight_decay: float = 0.0):
        super().__init__()
        # sft's model section also holds `pretrained` (the chat path, not this module).
        self.model_config = gpt.ModelConfig(**{k: v for k, v in (model or {}).items()
                                               if k != "pretrained"})
        self.base_params = base_params
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self.lr, self.warmup_steps, self.weight_decay = lr, warmup_steps, weight_decay
        if lora_rank > 0:
            # Only the adapters are optimized (and carry optimizer state).
            self.trainable = nnx.LoRAParam

    @property
    def hparams(self) -> dict[str, Any]:
        # The pretrained arrays are data, not a hyperparameter worth logging.
        out = type(super().hparams)(super().hparams)  # a copy: the record itself stays as given
        out["base_params"] = None if self.base_params is None else "pretrained"
        return out

    def configure_model(self, rngs: nnx.Rngs) -> nnx.Module:
        lm = TransformerLM(gpt.transformer_config(self.model_config), rngs=rngs)
        if self.base_params is not None:
            state = nnx.state(lm, nnx.Param)
            nnx.replace_by_pure_dict(state, self.base_params)
            nnx.update(lm, state)
        if self.lora_rank > 0:
            add_lora(lm.blocks, self.lora_rank, self.lora_alpha, rngs=rngs)
        return lm

    def configure_optimizers(self) -> optax.GradientTransformation:
        lr = optax.linear_schedule(0.0, self.lr, max(self.warmup_steps, 1))
        return optax.adamw(lr, weight_decay=self.weight_decay)

    def _scores(self, model, batch):
        tokens = batch["tokens"].astype(jnp.int32)
        logits = model(tokens[:, :-1])
        targets, mask = tokens[:, 1:], batch["mask"]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        loss = (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        right = (logits.argmax(-1) == targets) | (mask == 0)
        exact = right.all(axis=-1).astype(jnp.float32).mean()
        token_acc = ((logits.argmax(-1) == targets) * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        return loss, exact, token_acc

    def training_step(self, model, batch):
        loss, exact, token_acc = self._scores(model, batch)
        return loss, {"exact_match": exact, "token_accuracy": token_acc}

    def validation_step(self, model, batch):
        loss, exact, token_acc = self._scores(model, batch)
        # Token means weigh each batch by its answer tokens (exact over the dataset); exact match
        # is a per-answer mean, weighted by the batch's answers (the default).
        tokens = batch["mask"].sum()
        self.log("val_loss", loss, batch_size=tokens)
        self.log("val_token_accuracy", token_acc, batch_size=tokens)
        return {"exact_match": exact}


# -- base weights ----------------------------------------------------------------------------------


def pretrained_params(config: Config) -> dict | None:
    """The base model's parameters: from `base.checkpoint`, else pretrained here, or None."""
    gpt_model = gpt.ModelConfig(**{f.name: getattr(config.model, f.name)
                                   for f in dataclasses.fields(gpt.ModelConfig)})
    base_module = gpt.make_module(gpt.Config(model=gpt_model))
    if config.base.checkpoint:
        load = getattr(jl, "load_checkpoint", None)
        if load is None:
            raise CheckpointError("--base.checkpoint needs jaxlight.load_checkpoint, which this "
                                  "jaxlight does not have; drop it to pretrain in-process.")
        model = load(config.base.checkpoint, base_module)
    elif config.base.pretrain_steps > 0:
        gpt_config = gpt.Config(model=gpt_model)
        base_module, data = gpt.build(gpt_config, config.base.pretrain_steps)
        fit = jl.Fit("auto", max_steps=config.base.pretrain_steps, enable_progress_bar=False,
                     enable_model_summary=False, logger=False, log_every_n_steps=10**9)
        fit.fit(base_module, data.train)
        model = base_module.model
    else:
        return None
    return jl.distributed.gather(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


# -- greedy generation -----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _greedy_fill(graphdef, state, tokens, known):
    """Fills every position where `known` is False with the greedy prediction, left to right."""

    def step(t, carry):
        tokens, state = carry
        model = nnx.merge(graphdef, state)  # merged in the body: see gpt._decode
        logits = model(tokens[:, :-1])
        nxt = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, t - 1, 1, keepdims=False), -1)
        col = jnp.where(known[:, t], tokens[:, t], nxt.astype(tokens.dtype))
        return jax.lax.dynamic_update_index_in_dim(tokens, col, t, 1), state

    tokens, _ = jax.lax.fori_loop(1, tokens.shape[1], step, (tokens, state))
    return tokens


def generate_answers(model: nnx.Module, words: list[str], task: TaskConfig) -> list[str]:
    """Greedy answers of `model` to the prompts of `words` (text after the prompt, to `\\n`)."""
    enc = encode(words, task)
    tokens = enc["tokens"].astype(np.int32)
    known = np.arange(tokens.shape[1])[None, :] < enc["prompt_len"][:, None]
    tokens = np.where(known, tokens, 0)
    graphdef, state = nnx.split(model)
    out = _greedy_fill(graphdef, state, jnp.asarray(tokens), jnp.asarray(known))
    out = np.asarray(jl.distributed.gather(out)).astype(np.uint8)
    answers = []
    for row, start in zip(out, enc["prompt_len"], strict=True):
        text = bytes(row[start:].tolist()).decode("latin-1")
        answers.append(text.split(END)[0] + END if END in text else text)
    return answers


# -- the recipe ------------------------------------------------------------------------------------


def build(config: Config | None = None, max_steps: int | None = None
          ) -> tuple[FineTuner, RecipeData]:
    """The fine-tuning module (with base weights) and the task's loaders."""
    config = config or Config()
    if config.model.pretrained:
        words = task_data(config.task)
        train_words = [bytes(r).decode().split(SEP)[0] for r in words["train"]["tokens"]]
        return build_pretrained(config, train_words, words["val_words"])
    del max_steps  # the schedule is warm-up then constant: fine-tuning runs are short
    data = task_data(config.task)
    batch = config.data.batch_size
    module = FineTuner(
        model=dataclasses.asdict(config.model), base_params=pretrained_params(config),
        lora_rank=config.lora.rank, lora_alpha=config.lora.alpha, lr=config.optim.lr,
        warmup_steps=config.optim.warmup_steps, weight_decay=config.optim.weight_decay,
    )
    fields = ("tokens", "mask")
    return module, RecipeData(
        train=ArrayLoader({k: data["train"][k] for k in fields}, batch, shuffle=True,
                          seed=config.task.seed),
        val=ArrayLoader({k: data["val"][k] for k in fields}, batch, shuffle=False,
                        drop_remainder=False),
        extras={"val_words": data["val_words"]},
    )


def before_fit(fit, module: FineTuner, data: RecipeData, config: Config) -> dict:
    """Validation metrics of the base model (with zero-initialized adapters)."""
    return fit.validate(module, data.val)


def after_fit(fit, module: FineTuner, data: RecipeData, config: Config) -> dict:
    """Exact match of free-running greedy generation, and three examples."""
    if config.model.pretrained:
        return after_fit_pretrained(fit, module, data, config)
    words = data.extras["val_words"]
    answers = generate_answers(module.model, words, config.task)
    expected = [make_example(w)[1] for w in words]
    exact = float(np.mean([a == e for a, e in zip(answers, expected, strict=True)]))
    shown = "\n".join(f"{w}{SEP}{a!r}  ({'ok' if a == e else 'expected ' + repr(e)})"
                      for w, a, e in list(zip(words, answers, expected, strict=True))[:3])
    return {"generated_exact_match": exact, "examples": shown}


def _ckpt_overrides(config: Config) -> dict:
    """A full fine-tuning checkpoint holds every weight: skip pretraining or loading the base.
    A LoRA checkpoint holds only the adapters: the base must be rebuilt as in training (the
    restore checks its fingerprint)."""
    if config.lora.rank > 0:
        return {}
    return {"base.pretrain_steps": 0, "base.checkpoint": None}


RECIPE = Recipe(
    name="sft",
    summary="fine-tune (LoRA by default) a gpt model to reverse words; exact match before/after",
    config=Config,
    build=build,
    # Validation every val_check_interval steps counted across epochs (Lightning's
    # check_val_every_n_epoch=None): the interval may be longer than an epoch.
    fit_defaults={"max_steps": 300, "log_every_n_steps": 25, "val_check_interval": 100,
                  "check_val_every_n_epoch": None},
    before_fit=before_fit,
    after_fit=after_fit,
    ckpt_overrides=_ckpt_overrides,
)
