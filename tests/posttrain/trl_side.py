"""Writes the TRL oracle fixture for jaxlight's GRPO advantages and loss and DPO loss (run in
the TRL venv, never in jaxlight's).

    make trl-oracle            # builds .venv-trl (torch CPU, trl==1.16.0) and runs this

TRL's GRPO advantage computation is inline in `GRPOTrainer._generate_and_score_completions`
and its loss in `GRPOTrainer._compute_loss`, both methods of a trainer; DPO's loss is
`DPOTrainer._compute_loss`. So this builds real trainers, as a user does, on a tiny Llama made
from a config (no download) with a word-level tokenizer made in memory, and calls those methods:

- advantages: `_generate_and_score_completions` on a generation batch of 3 prompts x 4
  completions. The completions are the tiny model's samples; the rewards are given, as dataset
  columns that two reward functions return (weights 1 and 0.5, `None` where a function does
  not apply, one completion no function applies to, one group of equal rewards).
- GRPO loss: `_compute_loss(model, inputs)` on that batch, for each loss type, with given old
  and reference log-probabilities (the policy's own perturbed, so the clip and the KL term are
  active). The policy's per-token log-probabilities are TRL's own
  (`_get_per_token_logps_and_entropies`, recorded), and a forward hook on the model keeps the
  gradient of the loss with respect to them.
- DPO loss: `_compute_loss(model, inputs, False)` for the default `loss_type=["sigmoid"]` on
  given token ids and masks, with given (precomputed) reference log-probabilities.

Each records inputs, TRL's outputs and its logged metrics into
`fixtures/trl_oracle.json`; `tests/posttrain/test_trl_parity.py` compares jaxlight (it never
imports torch or trl).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from importlib import metadata

import datasets
import torch
import transformers
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

warnings.filterwarnings("ignore")
datasets.disable_progress_bars()
transformers.logging.set_verbosity_error()
torch.use_deterministic_algorithms(True)
HERE = os.path.dirname(os.path.abspath(__file__))
WORDS = [chr(c) for c in range(ord("a"), ord("a") + 14)]
VOCAB = {"<pad>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
G, MAX_NEW = 4, 6
PROMPTS = ["a b c", "d e", "f g h i"]
# Given rewards per completion (prompt-major, G each): two functions, None = not applicable.
# Row 5 gets None from both (unscorable); prompt 2's rows all total 1.5 (std 0).
ANSWER = [1.0, 0.0, 0.0, 1.0, None, None, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
FORMAT = [0.5, None, 0.5, 0.5, 0.0, None, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0]
WEIGHTS = [1.0, 0.5]
# TRL's default first (loss_type="dapo", beta=0, old = the policy itself), then each type
# with a KL term and given old log-probabilities that make the clip active.
GRPO_CASES = [
    dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=None, old=False),
    dict(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28, old=True),
    dict(loss_type="bnpo", beta=0.1, epsilon=0.2, epsilon_high=None, old=True),
    dict(loss_type="grpo", beta=0.04, epsilon=0.2, epsilon_high=None, old=True),
    dict(loss_type="dr_grpo", beta=0.04, epsilon=0.1, epsilon_high=None, old=True),
    # TRL's KL term is weighted by the ratio by default (use_bias_correction_kl); without:
    dict(loss_type="grpo", beta=0.04, epsilon=0.2, epsilon_high=None, old=True,
         use_bias_correction_kl=False),
    dict(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=None, old=False),
]
DPO_BETAS = [0.1, 0.5]  # TRL's default beta first
PAIRS, PROMPT_LEN, ANSWER_LEN = 6, 3, 4


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_llama(seed: int, out: str) -> str:
    """A tiny random Llama saved under `out` (a path, so a trainer with `beta > 0` can load
    its reference model from it as from a pretrained checkpoint)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=32, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None, tie_word_embeddings=False, initializer_range=0.6)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # the end-of-sequence token as likely as a frequent word ("i"), so
        model.lm_head.weight[1] = model.lm_head.weight[VOCAB["i"]]  # completions differ in length
    path = os.path.join(out, f"llama{seed}")
    model.save_pretrained(path)
    return path


def answer(prompts, completions, completion_ids, r_answer, **kwargs):
    return list(r_answer)


def fmt(prompts, completions, completion_ids, r_format, **kwargs):
    return list(r_format)


class KeepLogProbGrad:
    """A forward hook on the model: keeps the per-token log-probabilities of the fused LM head
    output and their gradient after `backward`."""

    def __init__(self, model):
        self.log_probs = None
        self.handle = model.register_forward_hook(self)

    def __call__(self, module, args, output):
        if torch.is_grad_enabled() and output.log_probs.requires_grad:
            output.log_probs.retain_grad()
            self.log_probs = output.log_probs


def grpo_trainer(case: dict, out: str) -> GRPOTrainer:
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=len(PROMPTS) * G, num_generations=G,
        max_completion_length=MAX_NEW, beta=case["beta"], epsilon=case["epsilon"],
        epsilon_high=case["epsilon_high"], loss_type=case["loss_type"],
        use_bias_correction_kl=case.get("use_bias_correction_kl", True),
        reward_weights=WEIGHTS, temperature=1.0, use_cpu=True, bf16=False, seed=0,
        report_to="none", logging_steps=1)
    dataset = Dataset.from_dict({"prompt": PROMPTS, "r_answer": [0.0] * 3, "r_format": [0.0] * 3})
    trainer = GRPOTrainer(model=tiny_llama(0, out), reward_funcs=[answer, fmt], args=args,
                          train_dataset=dataset, processing_class=tokenizer())
    trainer.model.train()
    # Set by the training loop at the start of each accumulation window (one micro-batch here).
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    return trainer


def logged(trainer) -> dict:
    """What the trainer logged since the last `clear_logged`: its metrics buffer, by name (read
    through vars(): `_metrics` is TRL's attribute, not jaxlight's Fit's, which
    tests/test_architecture.py keeps private)."""
    return {k: v[-1] for k, v in vars(trainer)["_metrics"]["train"].items()}


def clear_logged(trainer) -> None:
    vars(trainer)["_metrics"]["train"].clear()


def listed(t: torch.Tensor) -> list:
    return t.detach().to(torch.float64).cpu().tolist()


def run_grpo(out: str) -> dict:
    trainer = grpo_trainer(GRPO_CASES[0], out)
    inputs = [{"prompt": PROMPTS[i // G], "r_answer": ANSWER[i], "r_format": FORMAT[i]}
              for i in range(len(PROMPTS) * G)]
    torch.manual_seed(1)
    batch = trainer._generate_and_score_completions(inputs)
    metrics = {k: v for k, v in logged(trainer).items()
               if k.startswith("reward") or k == "frac_reward_zero_std"}
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, width)
    mask = batch["completion_mask"].float()
    gen = torch.Generator().manual_seed(2)
    old = (logps + 0.3 * torch.randn(logps.shape, generator=gen)) * mask
    ref = (logps + 0.2 * torch.randn(logps.shape, generator=gen)) * mask
    result = {"completion_ids": batch["completion_ids"].tolist(), "mask": listed(mask),
              "advantages": listed(batch["advantages"]), "logps": listed(logps * mask),
              "old_logps": listed(old), "ref_logps": listed(ref),
              "num_items_in_batch": float(batch["num_items_in_batch"]),
              "reward_metrics": metrics, "cases": []}
    for i, case in enumerate(GRPO_CASES):
        trainer = trainer if i == 0 else grpo_trainer(case, out)
        given = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                        "completion_mask", "advantages", "num_items_in_batch")}
        if case["old"]:
            given["old_per_token_logps"] = old
        if case["beta"]:
            given["ref_per_token_logps"] = ref
        clear_logged(trainer)
        hook = KeepLogProbGrad(trainer.model)
        loss = trainer._compute_loss(trainer.model, given)
        loss.backward()
        hook.handle.remove()
        seen = hook.log_probs[:, -width:]
        # The loss saw the log-probabilities recorded above (TRL's function, the same model).
        assert torch.allclose(seen * mask, logps * mask, atol=1e-6), (seen - logps).abs().max()
        metrics = logged(trainer)
        result["cases"].append({"config": case, "loss": float(loss),
                                "grad_logps": listed(hook.log_probs.grad[:, -width:] * mask),
                                "metrics": metrics})
    return result


def run_dpo(out: str) -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(2, len(VOCAB), (PAIRS, PROMPT_LEN), generator=gen)
    rows, masks, attention = [], [], []
    for _ in range(2):  # chosen, then rejected: TRL's batch layout
        answers = torch.randint(2, len(VOCAB), (PAIRS, ANSWER_LEN), generator=gen)
        lengths = torch.randint(1, ANSWER_LEN + 1, (PAIRS,), generator=gen)
        lengths[0] = ANSWER_LEN
        keep = torch.arange(ANSWER_LEN)[None] < lengths[:, None]
        rows.append(torch.cat([prompts, torch.where(keep, answers, 0)], 1))
        masks.append(torch.cat([torch.zeros(PAIRS, PROMPT_LEN, dtype=torch.long), keep.long()], 1))
        attention.append(torch.cat([torch.ones(PAIRS, PROMPT_LEN, dtype=torch.long),
                                    keep.long()], 1))
    input_ids, completion_mask = torch.cat(rows), torch.cat(masks)
    attention_mask = torch.cat(attention)
    ref = (-2.5 * completion_mask.sum(1).float()
           + 0.8 * torch.randn(2 * PAIRS, generator=gen))
    # The trainer's dataset is only what its constructor needs; the loss runs on `inputs` below.
    dataset = Dataset.from_dict({"prompt": ["a"] * 2, "chosen": ["b"] * 2, "rejected": ["c"] * 2})
    cases = []
    for beta in DPO_BETAS:
        args = DPOConfig(output_dir=out, beta=beta, precompute_ref_log_probs=True, use_cpu=True,
                         bf16=False, report_to="none", per_device_train_batch_size=2, seed=0)
        trainer = DPOTrainer(model=tiny_llama(4, out), args=args, train_dataset=dataset,
                             processing_class=tokenizer())
        trainer.model.train()
        clear_logged(trainer)
        hook = KeepLogProbGrad(trainer.model)
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "completion_mask": completion_mask, "ref_chosen_logps": ref[:PAIRS],
                  "ref_rejected_logps": ref[PAIRS:]}
        loss = trainer._compute_loss(trainer.model, inputs, False)
        loss.backward()
        hook.handle.remove()
        shift = completion_mask[:, 1:].float()
        token_logps = hook.log_probs[:, -shift.shape[1]:]
        grad = hook.log_probs.grad[:, -shift.shape[1]:]
        metrics = logged(trainer)
        cases.append({"beta": beta, "loss_type": list(args.loss_type), "loss": float(loss),
                      "input_ids": input_ids.tolist(), "completion_mask": completion_mask.tolist(),
                      "token_logps": listed(token_logps * shift), "grad_token_logps":
                      listed(grad * shift), "ref_logps": listed(ref), "metrics": metrics})
    return cases


def main() -> None:
    with tempfile.TemporaryDirectory() as out:
        results = {"grpo": run_grpo(out), "dpo": run_dpo(out)}
    results["versions"] = {name: metadata.version(name) for name in
                           ("trl", "torch", "transformers", "accelerate")}
    results["python"] = sys.version.split()[0]
    results["setup"] = dict(G=G, max_completion_length=MAX_NEW, reward_weights=WEIGHTS,
                            rewards={"answer": ANSWER, "fmt": FORMAT}, prompts=PROMPTS)
    os.makedirs(os.path.join(HERE, "fixtures"), exist_ok=True)
    with open(os.path.join(HERE, "fixtures", "trl_oracle.json"), "w") as f:
        json.dump(results, f, indent=None, sort_keys=True)
        f.write("\n")
    print(json.dumps(results["versions"]))


if __name__ == "__main__":
    main()
