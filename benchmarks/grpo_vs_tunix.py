"""GRPO step time, generation and update, jaxlight beside Tunix 0.1.7 on the same CPU.

    python benchmarks/grpo_vs_tunix.py     # writes benchmarks/results/grpo_vs_tunix.json

Both sides run the tiny Qwen 3 shape of jaxlight's test fixture (2 layers, hidden 64, 4 heads
of 16, 2 key/value heads, MLP 96, vocabulary 512; Tunix's own `tunix.models.qwen3.Qwen3` with
random weights, jaxlight's `DecoderLM` with the fixture's) on one CPU device (`XLA_FLAGS`
unset), one after the other in this run, each in its own process (Tunix in /work/venv-tunix,
or `--tunix-python`). A generation batch is 8 prompts x 8 completions (64 rows), prompts
left-padded to 32 tokens, 6 new tokens at temperature 1.

What is timed (median of `--rounds` after one warm-up call that compiles):
- generation: jaxlight's `posttrain.rollout` (KV-cache sampling, then the sampling policy's
  log-probabilities, rewards from the text) on the policy of a running `Fit`; Tunix's
  `generate.sampler.Sampler` call, then `rl.common.compute_per_token_logps` for the old policy
  and for the reference (Tunix's learner computes both after sampling; jaxlight computes the
  reference's inside the training step).
- update: one optimizer step on that batch. jaxlight: the `grpo` recipe's compiled train step
  (policy and reference forward, `grpo_loss`, Adam), called on the fit's state; Tunix:
  `nnx.value_and_grad` of `rl.algo_core.grpo_loss_fn` (the learner's loss) and an
  `nnx.Optimizer` Adam update, under `nnx.jit` (what its trainer's train step does).
Tunix's `GRPOLearner` itself (its `RLCluster` with rollout/inference/trainer workers) is not
driven; these are its sampler and its loss, the parts that do the work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(os.path.dirname(HERE), "tests", "nn", "pretrained", "fixtures", "qwen3")
ROWS_PROMPTS, GROUP, NEW, PROMPT_LEN = 8, 8, 6, 32


def _median_time(fn, rounds: int) -> float:
    fn()  # compiles
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def jaxlight_side(rounds: int) -> dict:
    import jax

    import jaxlight as jl
    from jaxlight import posttrain
    from jaxlight.recipes import grpo

    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.data.prompts_per_step, config.grpo.group_size = ROWS_PROMPTS, GROUP
    config.grpo.max_new_tokens, config.grpo.updates = NEW, 1
    config.data.prompt_len = PROMPT_LEN
    module, data = grpo.build(config)
    feed = data.train
    fit = jl.Fit("single", max_steps=1, enable_progress_bar=False, enable_model_summary=False,
                 logger=False)
    fit.fit(module, feed)  # compiles the step, sampler and log-probabilities
    prompts, seed = feed.prompt_rows(1)
    policy = module.policy(module.model)

    def generation():
        return posttrain.rollout(policy, prompts, group_size=GROUP, max_new_tokens=NEW,
                                 rewards=feed.rewards, decode=feed.tokenizer.decode,
                                 temperature=1.0, seed=seed, prompt_len=PROMPT_LEN,
                                 strategy=fit.strategy)

    gen = _median_time(generation, rounds)
    batch = {k: v for k, v in generation().items() if k in grpo._BATCH_KEYS}
    session = fit.session
    step = session.compiled_train_step
    device_batch = fit.strategy.put_batch(batch, session.train_batch_shardings)
    holder = {"state": session.state}

    def update():
        holder["state"], metrics = step(holder["state"], device_batch)
        jax.block_until_ready(metrics)

    upd = _median_time(update, rounds)
    session.state = holder["state"]
    return {"generation_s": gen, "update_s": upd, "rows": int(batch["tokens"].shape[0]),
            "versions": {"jax": jax.__version__, "jaxlight": jl.__version__}}


TUNIX = r'''
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np, optax, transformers
from flax import nnx
from tunix.generate import sampler as sm
from tunix.models.qwen3 import model as qm
from tunix.rl import algo_core, common
from tunix.rl.grpo import grpo_learner
from importlib import metadata
fixture, rounds, prompts_n, group, new, prompt_len = json.loads(sys.argv[1])
tok = transformers.PreTrainedTokenizerFast.from_pretrained(fixture)
pad, eos = tok.pad_token_id, tok.eos_token_id
cfg = qm.ModelConfig(num_layers=2, vocab_size=512, embed_dim=64, hidden_dim=96, num_heads=4,
                     head_dim=16, num_kv_heads=2, rope_theta=1_000_000, norm_eps=1e-6)
def median_time(fn):
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return statistics.median(times)
mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), devices=jax.devices()[:1])
with jax.set_mesh(mesh):
    policy, reference = qm.Qwen3(cfg, rngs=nnx.Rngs(0)), qm.Qwen3(cfg, rngs=nnx.Rngs(0))
    sampler = sm.Sampler(policy, tok, sm.CacheConfig(cache_size=prompt_len + new + 8,
                                                     num_layers=2, num_kv_heads=2, head_dim=16))
    words = ["abc", "bad", "cage", "deaf", "face", "bead", "dab", "ace"][:prompts_n]
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Reverse {w}"}],
                                     add_generation_prompt=True, tokenize=False)
             for w in words for _ in range(group)]
    rows = len(texts)
    rng = np.random.default_rng(0)
    prompt_ids = np.full((rows, prompt_len), pad, np.int32)
    for i, t in enumerate(texts):
        ids = tok(t)["input_ids"]; prompt_ids[i, prompt_len - len(ids):] = ids
    completion = jnp.asarray(rng.integers(4, 512, size=(rows, new)), jnp.int32)
    prompt_ids = jnp.asarray(prompt_ids)
    def logps_fn(g, s, p, c):  # jitted by Tunix (graphdef static, as its inference worker)
        return common.compute_per_token_logps(g, s, prompt_tokens=p, completion_tokens=c,
                                              pad_id=pad, eos_id=eos, stop_gradient=True,
                                              temperature=1.0)
    def generation():
        out = sampler(texts, max_generation_steps=new, max_prompt_length=prompt_len,
                      temperature=1.0, top_p=1.0, seed=1)
        old = logps_fn(*nnx.split(policy), prompt_ids, completion)
        ref = logps_fn(*nnx.split(reference), prompt_ids, completion)
        jax.block_until_ready((old, ref))
        return out
    gen = median_time(generation)
    algo = grpo_learner.GRPOConfig(num_generations=group, num_iterations=1)
    algo.temperature = 1.0  # the learner copies it from the rollout config
    ref = logps_fn(*nnx.split(reference), prompt_ids, completion)
    adv = jnp.asarray(rng.normal(size=rows), jnp.float32)
    example = grpo_learner.TrainExample(
        prompt_ids=prompt_ids, prompt_mask=prompt_ids != pad, completion_ids=completion,
        completion_mask=jnp.ones_like(completion), advantages=adv,
        ref_per_token_logps=ref, old_per_token_logps=None)
    optimizer = nnx.Optimizer(policy, optax.adam(3e-4), wrt=nnx.Param)
    @nnx.jit
    def step(model, optimizer, example):
        def loss_fn(m):
            return algo_core.grpo_loss_fn(m, example, algo, pad, eos)
        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return loss
    upd = median_time(lambda: jax.block_until_ready(step(policy, optimizer, example)))
print(json.dumps({"generation_s": gen, "update_s": upd, "rows": rows,
                  "versions": {"jax": jax.__version__, "tunix": metadata.version("google-tunix"),
                               "flax": metadata.version("flax")}}))
'''


def tunix_side(python: str, rounds: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    args = json.dumps([FIXTURE, rounds, ROWS_PROMPTS, GROUP, NEW, PROMPT_LEN])
    done = subprocess.run([python, "-c", TUNIX, args], capture_output=True, text=True, env=env,
                          timeout=1800)
    if done.returncode:
        raise RuntimeError(f"the Tunix side failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tunix-python", default="/work/venv-tunix/bin/python")
    p.add_argument("--side", choices=["jaxlight"], help=argparse.SUPPRESS)
    p.add_argument("--out", default=os.path.join(HERE, "results", "grpo_vs_tunix.json"))
    args = p.parse_args()
    if args.side == "jaxlight":
        print(json.dumps(jaxlight_side(args.rounds)))
        return
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as Tunix
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--side", "jaxlight",
                           "--rounds", str(args.rounds)], capture_output=True, text=True,
                          env=env, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"the jaxlight side failed:\n{done.stderr[-3000:]}")
    ours = json.loads(done.stdout.strip().splitlines()[-1])
    theirs = tunix_side(args.tunix_python, args.rounds)
    result = {
        "benchmark": "grpo_vs_tunix", "device": "cpu (1 device each)",
        "batch": {"prompts": ROWS_PROMPTS, "group": GROUP, "rows": ours["rows"],
                  "prompt_len": PROMPT_LEN, "new_tokens": NEW},
        "jaxlight": ours, "tunix": theirs,
        "generation_ratio_jaxlight_over_tunix": ours["generation_s"] / theirs["generation_s"],
        "update_ratio_jaxlight_over_tunix": ours["update_s"] / theirs["update_s"],
        "compared": "generation: jaxlight posttrain.rollout (sample + old logps + rewards) vs "
                    "Tunix Sampler + old and reference compute_per_token_logps; update: "
                    "jaxlight's grpo recipe compiled train step (reference forward inside) vs "
                    "Tunix grpo_loss_fn value_and_grad + nnx.Optimizer(adam) under nnx.jit",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
