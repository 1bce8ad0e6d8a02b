"""The sft recipe on a pretrained Hugging Face model: chat data, assistant-masked loss, LoRA.

`jaxlight fit sft --model.pretrained PATH` fine-tunes a Llama 3 / Qwen 2-3 / Gemma 3 model directory
on chat conversations (`--data.jsonl FILE`, one `{"messages": [...]}` a line; without it, the
reversal task written as chat), with the loss on the assistant's tokens only. LoRA adapters go on
the projections `--lora.targets` names (`q_proj,v_proj` by default); `--lora.rank 0` trains every
weight. Checkpoints keep only what trains; `--export.path DIR` writes the result (LoRA merged)
in Hugging Face's layout with the tokenizer, which transformers loads.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxlight import distributed
from jaxlight._errors import ConfigurationError
from jaxlight.data import ArrayLoader
from jaxlight.module._module import TrainModule
from jaxlight.nn import EXPERT_TARGETS
from jaxlight.nn.pretrained import (
    DecoderLM,
    Tokenizer,
    encode_chats,
    from_hf_config,
    from_pretrained,
    generate,
    read_config,
    read_jsonl_chats,
    save_pretrained,
)
from jaxlight.nn.pretrained._hf import tensor_table
from jaxlight.recipes._base import RecipeData
from jaxlight.recipes._lora import add_lora

#: Projections LoRA may adapt (the names of the Hugging Face modules; an MoE model's experts
#: as `experts.gate_proj` etc., per-expert adapters: `jaxlight.nn.EXPERT_TARGETS`).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
               *EXPERT_TARGETS)


def refuse_expert_targets(module) -> None:
    """Refuses the experts' LoRA targets (`EXPERT_TARGETS`) on a recipe module (SFT, GRPO)
    whose model has no mixture-of-experts layer: `add_lora` would adapt nothing there."""
    experts = [t for t in module.lora_targets if t in EXPERT_TARGETS]
    if module.lora_rank > 0 and experts and not module.decoder_config.num_experts:
        raise ConfigurationError(
            f"lora targets {experts}: this {module.decoder_config.model_type} model has no "
            "mixture-of-experts layers to adapt; drop them from --lora.targets.")


def parse_targets(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in PROJECTIONS]
    if bad or not names:
        raise ConfigurationError(
            f"--lora.targets {text!r}: LoRA adapts projections by name, one or more of "
            f"{list(PROJECTIONS)} separated by commas; {bad or 'none'} is not one.")
    return names


def base_weights(path: str, dtype: Any) -> dict:
    """The checkpoint's weights as host arrays (a pure dict shaped like `DecoderLM`'s params)."""
    model = from_pretrained(path, "single", param_dtype=dtype)
    return jax.tree.map(lambda x: np.asarray(distributed.gather(x)),
                        nnx.to_pure_dict(nnx.state(model, nnx.Param)))


class ChatFineTuner(TrainModule):
    """Fine-tunes a pretrained `DecoderLM` on chat tokens, the loss masked to the assistant.

    Args:
        pretrained: the Hugging Face model directory.
        base_params: its weights (`base_weights(pretrained, dtype)`), or None: random (tests).
        lora_rank, lora_alpha, lora_targets: LoRA on the named projections of every layer;
            rank 0 trains every weight.
        lr, warmup_steps, weight_decay: AdamW with linear warm-up, then constant.
        remat: what each layer recomputes in the backward pass.
        dtype: parameter dtype of the loaded weights ("float32" or "bfloat16").
    """

    def __init__(self, pretrained: str, base_params: Any = None, lora_rank: int = 8,
                 lora_alpha: float = 16.0, lora_targets: tuple[str, ...] = ("q_proj", "v_proj"),
                 lr: float = 1e-3, warmup_steps: int = 10, weight_decay: float = 0.0,
                 remat: Any = False, dtype: str = "float32"):
        super().__init__()
        self.pretrained, self.base_params = pretrained, base_params
        self.lora_rank, self.lora_alpha = lora_rank, lora_alpha
        self.lora_targets = tuple(lora_targets)
        self.lr, self.warmup_steps, self.weight_decay = lr, warmup_steps, weight_decay
        self.remat, self.dtype = remat, dtype
        self.decoder_config = from_hf_config(read_config(pretrained), remat=remat,
                                             param_dtype=jnp.dtype(dtype))
        refuse_expert_targets(self)
        if lora_rank > 0:
            self.trainable = nnx.LoRAParam

    @property
    def hparams(self) -> dict[str, Any]:
        out = type(super().hparams)(super().hparams)
        out["base_params"] = None if self.base_params is None else "pretrained"
        return out

    def configure_model(self, rngs: nnx.Rngs) -> nnx.Module:
        model = DecoderLM(self.decoder_config, rngs=rngs)
        if self.base_params is not None:
            # XLA drops the random initialization these replace.
            state = nnx.state(model, nnx.Param)
            nnx.replace_by_pure_dict(state, self.base_params)
            nnx.update(model, state)
        if self.lora_rank > 0:
            for stack in (model.layers, model.dense_layers):  # dense_layers: MoE models' dense MLPs
                if stack is not None:
                    add_lora(stack, self.lora_rank, self.lora_alpha, rngs=rngs,
                             names=self.lora_targets)
        return model

    def configure_optimizers(self) -> optax.GradientTransformation:
        lr = optax.linear_schedule(0.0, self.lr, max(self.warmup_steps, 1))
        return optax.adamw(lr, weight_decay=self.weight_decay)

    def _scores(self, model, batch):
        tokens = batch["tokens"].astype(jnp.int32)
        aux = None
        if self.decoder_config.num_experts:  # an MoE model: its router's balance loss too
            logits, aux = model(tokens[:, :-1], return_aux=True)
        else:
            logits = model(tokens[:, :-1])
        targets, mask = tokens[:, 1:], batch["mask"]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        count = jnp.maximum(mask.sum(), 1.0)
        loss = (losses * mask).sum() / count
        token_acc = ((logits.argmax(-1) == targets) * mask).sum() / count
        return loss, token_acc, aux

    def training_step(self, model, batch):
        loss, token_acc, aux = self._scores(model, batch)
        if aux is None:
            return loss, {"token_accuracy": token_acc}
        # As transformers: router_aux_loss_coef x the balance loss where the config's
        # output_router_logits asks for it (aux["loss"] is 0 otherwise); logged either way.
        return loss + aux["loss"], {"token_accuracy": token_acc, "aux_loss": aux["aux_loss"]}

    def validation_step(self, model, batch):
        loss, token_acc, _ = self._scores(model, batch)
        tokens = batch["mask"].sum()  # token means, weighted by each batch's assistant tokens
        self.log("val_loss", loss, batch_size=tokens)
        self.log("val_token_accuracy", token_acc, batch_size=tokens)
        return {}


def reversal_chats(words: list[str]) -> list[list[dict]]:
    """The sft task as chat: the user asks for a word reversed, the assistant answers."""
    return [[{"role": "user", "content": f"Reverse {w}"},
             {"role": "assistant", "content": w[::-1]}] for w in words]


def build_pretrained(config, train_words: list[str], val_words: list[str]):
    """`(ChatFineTuner, RecipeData)` for `--model.pretrained` (see the module docstring); the
    reversal task's words are the data when `--data.jsonl` is not given."""
    path = config.model.pretrained
    tokenizer = Tokenizer(path)
    if config.data.jsonl:
        chats = read_jsonl_chats(config.data.jsonl)
        n_val = max(1, int(len(chats) * config.data.val_fraction))
        train, val = chats[:-n_val] or chats, chats[-n_val:]
    else:
        train, val = reversal_chats(train_words), reversal_chats(val_words)
    dtype = config.model.dtype
    module = ChatFineTuner(
        path, base_params=base_weights(path, dtype), lora_rank=config.lora.rank,
        lora_alpha=config.lora.alpha, lora_targets=parse_targets(config.lora.targets),
        lr=config.optim.lr, warmup_steps=config.optim.warmup_steps,
        weight_decay=config.optim.weight_decay, remat=config.model.remat, dtype=dtype)
    length = config.data.max_length
    batch = config.data.batch_size
    train_arrays = encode_chats(tokenizer, train, length)
    val_arrays = encode_chats(tokenizer, val, length)
    return module, RecipeData(
        train=ArrayLoader(train_arrays, batch, shuffle=True, seed=config.task.seed),
        val=ArrayLoader(val_arrays, batch, shuffle=False, drop_remainder=False),
        extras={"tokenizer": tokenizer, "val_chats": val},
    )


def after_fit_pretrained(fit, module: ChatFineTuner, data, config) -> dict:
    """Greedy answers to the validation prompts (exact match against the references), and the
    export in Hugging Face's layout when `--export.path` is given."""
    tokenizer: Tokenizer = data.extras["tokenizer"]
    chats = data.extras["val_chats"][:config.data.batch_size]
    prompts = [tokenizer.apply_chat_template(c[:-1], add_generation_prompt=True) for c in chats]
    model = module.model
    stop = [t for t in {tokenizer.eos_id, *(module.decoder_config.token_ids.get("eos") or [])}
            if t is not None]
    out = generate(model, prompts, 24, stop_tokens=sorted(stop), pad_id=tokenizer.pad_id,
                   strategy=fit.strategy if hasattr(fit.strategy, "spec_for") else None)
    answers = [tokenizer.decode(row).strip() for row in out]
    expected = [c[-1]["content"].strip() for c in chats]
    report: dict[str, Any] = {
        "generated_exact_match": float(np.mean([a == e for a, e in
                                                zip(answers, expected, strict=True)])),
        "examples": "\n".join(f"{c[-2]['content']!r} -> {a!r}"
                              for c, a in list(zip(chats, answers, strict=True))[:3]),
    }
    if config.export.path:
        save_pretrained(model, config.export.path, tokenizer_from=config.model.pretrained)
        report["exported"] = config.export.path
    return report


def lora_tensors(config, targets: tuple[str, ...]) -> list[str]:
    """The Hugging Face names of the weights LoRA adapts (for the docs and the report)."""
    return [e.hf.format(i="*") for e in tensor_table(config)
            if e.path[-2] in targets and e.path[-1] == "kernel"]
