"""DPO on a pretrained Hugging Face model: preference pairs, a frozen reference, reward accuracy.

Direct preference optimization (Rafailov et al. 2023) as Tunix's `DPOTrainer` runs it: the policy
starts as the pretrained model, a frozen copy of it is the reference (both in the same compiled
step; the copy has no optimizer state and checkpoints hold only its fingerprint), and the
sigmoid loss `-log σ(β h)` pushes the policy's log-likelihood ratio `h` of the chosen over the
rejected completion above the reference's. Prompts and completions are written as chat turns
with the model's own chat template; only the completion's tokens count.

    jaxlight fit dpo --model.pretrained PATH                            # built-in pairs
    jaxlight fit dpo --model.pretrained PATH --data.path pairs.jsonl    # your pairs
    jaxlight fit dpo --model.pretrained PATH --mesh-shape '[[4,2],["fsdp","tp"]]'

Without `--data.jsonl` the pairs are built in: the user asks for a word reversed; the chosen
answer is the reversal, the rejected one the reversal with one letter wrong. The recipe
reports the held-out pairs' loss and reward accuracy (the fraction of pairs whose implicit reward
`β (log π - log π_ref)` is higher for the chosen answer) before and after training: before,
the policy is the reference, every reward is 0, the loss is log 2 and the accuracy 0.

From Python:

    >>> from jaxlight.recipes import dpo
    >>> dpo.reversal_pairs(["abc"])
    [{'prompt': 'Reverse abc', 'chosen': 'cba', 'rejected': 'cka'}]
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlight import distributed, posttrain
from jaxlight._errors import ConfigurationError, DataError, MissingAttributeError
from jaxlight.data import ArrayLoader
from jaxlight.module._module import TrainModule
from jaxlight.nn.pretrained import (
    DecoderLM,
    Tokenizer,
    encode_chats,
    from_hf_config,
    from_pretrained,
    read_config,
)
from jaxlight.nn.pretrained._placement import kv_config
from jaxlight.posttrain._data import as_messages, preference_rows, read_rows
from jaxlight.recipes._base import Recipe, RecipeData, option, section
from jaxlight.strategies import Strategy

__all__ = ["Config", "PreferenceTuner", "build", "encode_pairs", "read_pairs", "reversal_pairs"]


@dataclasses.dataclass
class ModelConfig:
    pretrained: str = option("", "Hugging Face model directory (config.json, *.safetensors, "
                                 "tokenizer.json with a chat template); required")
    dtype: str = option("float32", "parameter dtype of the loaded weights")


@dataclasses.dataclass
class DataConfig:
    jsonl: str = option("", "preference pairs, one {\"prompt\", \"chosen\", \"rejected\"} a "
                            "line; empty: the built-in reversal pairs")
    path: str = option("", "preference pairs from a .jsonl/.json/.parquet file or a datasets "
                           "directory (prompt: text or chat messages; chosen, rejected: text)")
    val_fraction: float = option(0.2, "share of the pairs held out for validation")
    max_len: int = option(32, "tokens per conversation (longer ones are cut)")
    batch_size: int = option(16, "pairs per step (a multiple of the data-parallel degree)")
    pairs: int = option(320, "built-in pairs (train and validation)")
    seed: int = option(0, "built-in words and shuffling")


@dataclasses.dataclass
class DPOConfig:
    beta: float = option(0.1, "β: how far the policy may move from the reference (Tunix's, "
                              "TRL's default)")
    label_smoothing: float = option(0.0, "assumed share of flipped preferences (cDPO)")
    loss_type: str = option("sigmoid", "sigmoid (DPO) or ipo")


@dataclasses.dataclass
class OptimConfig:
    lr: float = option(3e-3, "Adam learning rate (the tiny fixture's; 5e-7 to 5e-6 for real "
                             "models)")


@dataclasses.dataclass
class Config:
    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    dpo: DPOConfig = section(DPOConfig)
    optim: OptimConfig = section(OptimConfig)


WRONG = "klmnop"  # letters the built-in words never contain


def reversal_pairs(words: list[str]) -> list[dict[str, str]]:
    """The built-in preferences: the reversed word is preferred to a reversal with one letter
    wrong (its middle letter replaced by one the word does not contain)."""
    pairs = []
    for w in words:
        right, mid = w[::-1], len(w) // 2
        wrong = WRONG[sum(map(ord, w)) % len(WRONG)]
        pairs.append({"prompt": f"Reverse {w}", "chosen": right,
                      "rejected": right[:mid] + wrong + right[mid + 1:]})
    return pairs


def read_pairs(path: str) -> list[dict]:
    """Pairs from a local dataset (`posttrain._data.read_rows`: JSONL, JSON, Parquet, a
    `datasets` directory), each a `prompt` (text or chat messages) with `chosen` and
    `rejected` answers; the prompts come back as chat messages."""
    rows, places = read_rows(path, locate=True)
    return preference_rows(rows, path, places)


def encode_pairs(tokenizer: Tokenizer, pairs: list[dict], length: int) -> dict[str, np.ndarray]:
    """Chosen and rejected conversations as tokens, with masks on the answers' tokens."""
    out = {}
    for side in ("chosen", "rejected"):
        chats = [[*as_messages(p["prompt"], "a pair's prompt"),
                  {"role": "assistant", "content": p[side]}] for p in pairs]
        encoded = encode_chats(tokenizer, chats, length)
        out[side], out[f"{side}_mask"] = encoded["tokens"], encoded["mask"]
    empty = int((out["chosen_mask"].sum(1) == 0).sum() + (out["rejected_mask"].sum(1) == 0).sum())
    if empty:
        raise DataError(f"{empty} answers have no token within --data.max_len {length}: "
                        "raise it (prompts are cut from the end).")
    return out


def base_weights(path: str, dtype: str) -> dict:
    """The checkpoint's weights as host arrays, shaped like `DecoderLM`'s parameters."""
    model = from_pretrained(path, "single", param_dtype=jnp.dtype(dtype))
    return jax.tree.map(lambda x: np.asarray(distributed.gather(x)),
                        nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def pretrained_decoder(module: TrainModule) -> DecoderLM:
    """A `DecoderLM` of `module.decoder_config` holding `module.base_params` (random weights of
    seed 0 when None), its key/value heads repeated as the fit's strategy needs them
    (`kv_config`: Gemma 3 1B's one head under tp 4), as `from_pretrained` loads it under
    that strategy."""
    try:
        strategy = module.trainer.strategy
    except MissingAttributeError:
        strategy = None
    config = kv_config(module.decoder_config,
                       strategy if isinstance(strategy, Strategy) else None)
    model = DecoderLM(config, rngs=nnx.Rngs(0))
    if module.base_params is not None:
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, module.base_params)
        nnx.update(model, state)
    return model


class PreferenceTuner(TrainModule):
    """DPO of a pretrained `DecoderLM` against a frozen copy of itself.

    Args:
        pretrained: the Hugging Face model directory.
        base_params: its weights (`base_weights`), or None: random weights (tests).
        beta, label_smoothing, loss_type: `jaxlight.posttrain.dpo_loss`'s.
        lr: Adam's learning rate.
        dtype: parameter dtype.
    """

    trainable = posttrain.POLICY

    def __init__(self, pretrained: str, base_params: Any = None, beta: float = 0.1,
                 label_smoothing: float = 0.0, loss_type: str = "sigmoid", lr: float = 3e-3,
                 dtype: str = "float32"):
        super().__init__()
        self.pretrained, self.base_params = pretrained, base_params
        self.beta, self.label_smoothing, self.loss_type = beta, label_smoothing, loss_type
        self.lr, self.dtype = lr, dtype
        self.decoder_config = from_hf_config(read_config(pretrained), param_dtype=jnp.dtype(dtype))

    @property
    def hparams(self) -> dict[str, Any]:
        out = type(super().hparams)(super().hparams)
        out["base_params"] = None if self.base_params is None else "pretrained"
        return out

    def configure_model(self, rngs: nnx.Rngs) -> nnx.Module:
        # One seed for both: without base weights the reference still equals the policy.
        return posttrain.PolicyAndReference(pretrained_decoder(self), pretrained_decoder(self))

    def configure_optimizers(self) -> optax.GradientTransformation:
        return optax.adam(self.lr)

    def _loss(self, model, batch):
        def logps(net, side):
            tokens = batch[side].astype(jnp.int32)
            return posttrain.sequence_log_probs(net(tokens[:, :-1]), tokens[:, 1:],
                                                batch[f"{side}_mask"])
        return posttrain.dpo_loss(
            logps(model.policy, "chosen"), logps(model.policy, "rejected"),
            logps(model.reference, "chosen"), logps(model.reference, "rejected"),
            beta=self.beta, label_smoothing=self.label_smoothing, loss_type=self.loss_type)

    def training_step(self, model, batch):
        loss, m = self._loss(model, batch)
        return loss, {"reward_accuracy": m["rewards/accuracy"],
                      "reward_margin": m["rewards/margin"]}

    def validation_step(self, model, batch):
        loss, m = self._loss(model, batch)
        return {"loss": loss, "reward_accuracy": m["rewards/accuracy"],
                "reward_margin": m["rewards/margin"]}


def _words(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij"))
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        w = "".join(rng.choice(letters, size=int(rng.integers(3, 6))))
        if w not in seen and w != w[::-1]:
            seen.add(w)
            words.append(w)
    return words


def build(config: Config | None = None, max_steps: int | None = None
          ) -> tuple[PreferenceTuner, RecipeData]:
    """The DPO module (with the pretrained weights) and the pairs' loaders."""
    config = config or Config()
    del max_steps  # constant learning rate: preference runs are short
    if not config.model.pretrained:
        raise ConfigurationError("the dpo recipe needs --model.pretrained PATH, a Hugging Face "
                                 "model directory (config.json, safetensors, tokenizer.json).")
    d = config.data
    posttrain._logprobs.check_nonnegative(
        "--dpo.beta", config.dpo.beta, "it scales the implicit reward β (logp - ref_logp): a "
        "negative β trains the policy toward the rejected answers while the logged accuracy "
        "and margin look right. Use β > 0 (0.1 is Tunix's and TRL's default)", strict=True)
    if d.jsonl and d.path:
        raise ConfigurationError(f"--data.jsonl {d.jsonl!r} and --data.path {d.path!r}: give "
                                 "one (--data.path reads JSONL too).")
    source = d.path or d.jsonl
    pairs = read_pairs(source) if source else reversal_pairs(_words(d.pairs, d.seed))
    n_val = max(1, int(round(len(pairs) * d.val_fraction)))
    if len(pairs) - n_val < d.batch_size:
        raise DataError(f"{len(pairs)} pairs leave {len(pairs) - n_val} for training after "
                        f"holding out {n_val}: fewer than one batch of {d.batch_size}.")
    encoded = encode_pairs(Tokenizer(config.model.pretrained), pairs, d.max_len)
    train = {k: v[n_val:] for k, v in encoded.items()}
    val = {k: v[:n_val] for k, v in encoded.items()}
    module = PreferenceTuner(
        config.model.pretrained, base_weights(config.model.pretrained, config.model.dtype),
        beta=config.dpo.beta, label_smoothing=config.dpo.label_smoothing,
        loss_type=config.dpo.loss_type, lr=config.optim.lr, dtype=config.model.dtype)
    return module, RecipeData(
        train=ArrayLoader(train, d.batch_size, shuffle=True, seed=d.seed),
        val=ArrayLoader(val, d.batch_size, shuffle=False, drop_remainder=False))


def before_fit(fit, module: PreferenceTuner, data: RecipeData, config: Config) -> dict:
    """Held-out loss and reward accuracy at the start (the policy is the reference)."""
    return fit.validate(module, data.val)


RECIPE = Recipe(
    name="dpo",
    summary="DPO of a pretrained Hugging Face model against a frozen copy; held-out reward "
            "accuracy before/after",
    config=Config,
    build=build,
    # Validation every val_check_interval steps counted across epochs (Lightning's
    # check_val_every_n_epoch=None): the interval may be longer than an epoch.
    fit_defaults={"max_steps": 40, "log_every_n_steps": 10, "val_check_interval": 20,
                  "check_val_every_n_epoch": None},
    before_fit=before_fit,
)
