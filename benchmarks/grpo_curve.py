"""GRPO learns: mean reward per generation batch on the grpo recipe's reversal task (CPU).

    python benchmarks/grpo_curve.py            # writes benchmarks/results/grpo_curve.{json,png}

A tiny model is pretrained-then-SFT'd first: the Qwen 3 test fixture (random weights,
tests/nn/pretrained/fixtures/qwen3) fine-tuned by the `sft` recipe on the same reversal chats
for `--sft-steps` steps and exported in Hugging Face's layout; the `grpo` recipe then trains it
(`--model.pretrained` that directory). The curve is the mean reward of each fresh generation
batch (sampled from the policy after the previous step), the held-out greedy reward is measured
before and after. The `dpo` recipe's held-out reward accuracy before and after is measured on
the same fixture (its pairs are the same task).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(os.path.dirname(HERE), "tests", "nn", "pretrained", "fixtures", "qwen3")


def sft_model(out: str, steps: int) -> dict:
    import jaxlight as jl
    from jaxlight.recipes import sft
    from jaxlight.recipes._chat_sft import after_fit_pretrained

    config = sft.Config()
    config.model.pretrained = FIXTURE
    config.lora.rank = 0
    config.task.max_len = 4
    config.task.train_examples, config.task.val_examples = 1024, 64
    config.data.batch_size = 32
    config.export.path = out
    module, data = sft.build(config, steps)
    fit = jl.Fit("single", max_steps=steps, enable_progress_bar=False, logger=False,
                 enable_model_summary=False)
    fit.fit(module, data.train)
    report = after_fit_pretrained(fit, module, data, config)
    return {"steps": steps, "generated_exact_match": report["generated_exact_match"]}


def grpo_run(path: str, args) -> dict:
    import jaxlight as jl
    from jaxlight.nn.pretrained._generate import compiled_programs
    from jaxlight.recipes import grpo

    config = grpo.Config()
    config.model.pretrained = path
    config.grpo.group_size, config.grpo.updates = args.group, args.updates
    config.data.prompts_per_step = args.prompts
    config.optim.lr = args.lr
    module, data = grpo.build(config)
    before = grpo.before_fit(None, module, data, config)
    fit = jl.Fit("single", max_steps=args.steps, prefetch_batches=0, log_every_n_steps=2,
                 enable_progress_bar=False, logger=False, enable_model_summary=False)
    programs = compiled_programs()
    start = time.perf_counter()
    fit.fit(module, data.train)
    seconds = time.perf_counter() - start
    programs = compiled_programs() - programs
    after = grpo.after_fit(fit, module, data, config)
    feed = data.train
    return {"config": {"group_size": args.group, "updates_per_generation": args.updates,
                       "prompts_per_generation": args.prompts, "lr": args.lr,
                       "max_steps": args.steps, "beta": config.grpo.beta,
                       "max_new_tokens": config.grpo.max_new_tokens},
            "mean_reward_per_generation": [round(r, 4) for _, r, _ in feed.history],
            "generation_seconds": round(sum(s for _, _, s in feed.history), 2),
            "fit_seconds": round(seconds, 2),
            "held_out_greedy_before": before, "held_out_greedy_after": after,
            "compiles": dict(fit.compile_counts),
            "sampler_programs_compiled_in_fit": programs}


def dpo_run() -> dict:
    import jaxlight as jl
    from jaxlight.recipes import dpo

    config = dpo.Config()
    config.model.pretrained = FIXTURE
    config.data.pairs, config.data.batch_size = 96, 16
    module, data = dpo.build(config)
    fit = jl.Fit("single", max_steps=12, enable_progress_bar=False, enable_model_summary=False,
                 logger=False)
    before = fit.validate(module, data.val)
    fit.fit(module, data.train)
    after = fit.validate(module, data.val)
    return {"held_out_pairs": 19, "steps": 12,
            "reward_accuracy_before": before["val_reward_accuracy"],
            "reward_accuracy_after": after["val_reward_accuracy"],
            "loss_before": round(before["val_loss"], 4), "loss_after": round(after["val_loss"], 4)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--steps", type=int, default=60, help="GRPO optimizer steps")
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--no-dpo", action="store_true")
    p.add_argument("--out", default=os.path.join(HERE, "results", "grpo_curve.json"))
    args = p.parse_args()
    import jax

    with tempfile.TemporaryDirectory() as tmp:
        sft = sft_model(tmp, args.sft_steps)
        result = {"benchmark": "grpo_curve", "device": jax.devices()[0].device_kind,
                  "model": "tiny Qwen 3 fixture (2 layers, hidden 64, vocab 512), SFT'd on "
                           "reversal chats", "sft": sft, "grpo": grpo_run(tmp, args)}
    if not args.no_dpo:
        result["dpo"] = dpo_run()
    curve = result["grpo"]["mean_reward_per_generation"]
    k = max(1, len(curve) // 4)
    result["grpo"]["first_quarter_mean"] = round(sum(curve[:k]) / k, 4)
    result["grpo"]["last_quarter_mean"] = round(sum(curve[-k:]) / k, 4)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.plot([args.updates * i for i in range(len(curve))], curve, marker="o")
        ax.set_xlabel("optimizer step (generation batch start)")
        ax.set_ylabel("mean reward (max 1.5)")
        ax.set_title("GRPO on reversal, tiny Qwen 3 after SFT (CPU)")
        fig.tight_layout()
        fig.savefig(args.out.replace(".json", ".png"), dpi=100)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
