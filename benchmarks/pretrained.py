"""Pretrained models: loading a ~1B Llama checkpoint into FSDP, and KV-cache sampling, each beside
transformers (torch, CPU) in the same run.

    python benchmarks/pretrained.py load      # ~1.24B random Llama 3.2 1B-shaped checkpoint
    python benchmarks/pretrained.py sample    # batch 8, prompt 64, 128 new tokens
    python benchmarks/pretrained.py lora-step # LoRA SFT step: Fit / hand-written jitted step
    HF_PYTHON=/path/to/python-with-transformers python benchmarks/pretrained.py load

`load` writes a random bfloat16 checkpoint in Hugging Face's layout (sharded safetensors, Llama
3.2 1B's shape: hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocab 128256, tied) to /tmp (never
committed), then loads it in a fresh process with `jaxlight.nn.from_pretrained(path, FSDP())`
over 8 simulated devices and in another with transformers' `from_pretrained` (bf16), reporting
each one's wall time and peak resident memory (VmHWM) and the jaxlight bound
1.25 x (the process's share + the largest tensor); one process holds all 8 simulated devices, so
its share is the whole model. The peak is compared after subtracting the process's resident
memory before loading (Python, JAX and the runtime's own pages are not the model's).

`sample` does the same for generation with a smaller random Llama (greedy, 128 new tokens, each
row decoding its full length): jaxlight's compiled KV-cache loop vs transformers' `generate`,
tokens per second of the second call (the first compiles; one compile per shape bucket is
checked).

Prints JSON; writes benchmarks/results/pretrained_<part>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from benchmarks._common import write_result  # noqa: E402

LLAMA_1B = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048,
                intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, rms_norm_eps=1e-5,
                tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=8192,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                hidden_act="silu", bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
SMALL = dict(LLAMA_1B, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=32000,
             torch_dtype="float32")

HF_CHILD = r"""
import json, os, resource, sys, time
import torch, transformers
path, part = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
before = status("VmRSS")
if part == "load":
    t = time.perf_counter()
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    seconds = time.perf_counter() - t
    peak = status("VmHWM")
    print(json.dumps({"seconds": seconds, "peak_rss": peak, "rss_before": before}))
else:
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = torch.randint(3, 1000, (8, 64), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        m.generate(prompts, **dict(kw, max_new_tokens=2, min_new_tokens=2))  # warm-up
        t = time.perf_counter()
        m.generate(prompts, **kw)
        seconds = time.perf_counter() - t
    print(json.dumps({"seconds": seconds, "tokens_per_s": 8 * 128 / seconds,
                      "threads": torch.get_num_threads()}))
"""


def write_checkpoint(path: str, config: dict, dtype: str, shard_bytes: int = 2**30) -> None:
    """A random checkpoint of `config` in Hugging Face's layout (skipped if already there)."""
    import ml_dtypes
    import numpy as np

    from jaxlight.nn.pretrained import _safetensors as st
    from jaxlight.nn.pretrained import from_hf_config
    from jaxlight.nn.pretrained._hf import tensor_table

    if os.path.exists(os.path.join(path, "config.json")):
        return
    os.makedirs(path, exist_ok=True)
    cfg = from_hf_config(config)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(0)
    entries = []
    for entry in tensor_table(cfg):
        for layer in (range(cfg.num_layers) if entry.stacked else [None]):
            def fetch(shape=entry.hf_shape, norm="norm" in entry.hf):
                if norm:
                    return np.ones(shape, np.float32)
                return (rng.standard_normal(shape, np.float32) * 0.02)
            entries.append((entry.name(layer), entry.hf_shape, np_dtype, fetch))
    shards, size = [[]], 0
    for e in entries:
        nbytes = int(np.prod(e[1])) * np_dtype.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        st.write_lazy(os.path.join(path, name), shard, {"format": "pt"})
        weight_map.update({e[0]: name for e in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _status(key: str) -> int:
    """Bytes of a /proc/self/status entry: VmRSS now, VmHWM the peak of this process's own
    memory (ru_maxrss would carry the parent's peak across fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def child_load(path: str) -> dict:
    import jax
    import numpy as np

    from jaxlight import strategies
    from jaxlight.nn.pretrained import from_pretrained
    from jaxlight.nn.pretrained._hf import checkpoint_tensors

    strategy = strategies.FSDP()
    strategy.setup()
    tensors = checkpoint_tensors(path)
    sizes = [int(np.prod(i.shape)) * i.dtype.itemsize for i in tensors.values()]
    before = _status("VmRSS")
    t = time.perf_counter()
    model = from_pretrained(path, strategy)
    jax.block_until_ready(jax.tree.leaves(model))
    seconds = time.perf_counter() - t
    peak = _status("VmHWM")
    return {"seconds": seconds, "peak_rss": peak, "rss_before": before,
            "model_bytes": sum(sizes), "largest_tensor_bytes": max(sizes),
            "devices": jax.device_count()}


def child_sample(path: str) -> dict:
    import jax.numpy as jnp
    import numpy as np

    from jaxlight.nn.pretrained import compiled_programs, from_pretrained, generate

    model = from_pretrained(path, "single", param_dtype=jnp.float32)
    prompts = np.random.default_rng(0).integers(3, 1000, (8, 64)).tolist()
    t = time.perf_counter()
    generate(model, prompts, 128, stop_tokens=[])
    first = time.perf_counter() - t
    t = time.perf_counter()
    out = generate(model, prompts, 128, stop_tokens=[])
    seconds = time.perf_counter() - t
    assert all(len(r) == 128 for r in out)
    return {"seconds": seconds, "first_call_seconds": first, "tokens_per_s": 8 * 128 / seconds,
            "compiled_programs": compiled_programs()}


def child_lora_step(path: str, steps: int, rounds: int, warmup: int = 5) -> dict:
    """Fit's LoRA step against a hand-written jitted step of the same loss and optimizer,
    alternated per round, each keeping two steps in flight; median step times."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import jaxlight as jl
    from jaxlight import callbacks, strategies
    from jaxlight.recipes._chat_sft import ChatFineTuner, base_weights

    base = base_weights(path, "float32")
    rng = np.random.default_rng(0)
    n, length = 64, 65
    data = {"tokens": rng.integers(3, 1000, (n, length)).astype(np.int32),
            "mask": (rng.random((n, length - 1)) < 0.5).astype(np.float32)}

    def module():
        return ChatFineTuner(path, base_params=base, lora_rank=8,
                             lora_targets=("q_proj", "v_proj"), lr=1e-3, warmup_steps=1)

    def fit_round():
        stamps = []
        rec = callbacks.LambdaCallback(
            on_train_batch_end=lambda f, m, o, b, i: stamps.append(time.perf_counter()))
        mod = module()
        fit = jl.Fit(strategies.SingleDevice(), max_steps=steps, callbacks=[rec],
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     log_every_n_steps=10**6)
        fit.fit(mod, jl.data.ArrayLoader(data, 8, seed=0))
        return stamps, jax.device_get(nnx.to_pure_dict(nnx.state(mod.model, nnx.LoRAParam)))

    def hand_round():
        mod = module()
        model = mod.configure_model(nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)
        # On the device once, as Fit places its state (base_weights are host arrays: passing
        # them each step would copy the whole base to an accelerator every step).
        params, rest = jax.device_put((nnx.to_pure_dict(params), nnx.to_pure_dict(rest)))
        tx = mod.configure_optimizers()
        opt_state = tx.init(params)

        # The frozen base goes in as an argument (as Fit passes it): a closed-over module would be
        # a constant of another trace level inside the model's nnx.scan.
        def step(params, opt_state, rest, batch):
            def loss_fn(p):
                return mod.training_step(nnx.merge(graphdef, p, rest), batch)[0]

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(step, donate_argnums=(0, 1))
        loader = jl.data.ArrayLoader(data, 8, seed=0)
        it, stamps, prev = iter(loader), [], None
        for _ in range(steps):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(loader)
                batch = next(it)
            params, opt_state, loss = step(params, opt_state, rest, jax.device_put(batch))
            if prev is not None:
                prev.block_until_ready()
            prev = loss
            stamps.append(time.perf_counter())
        prev.block_until_ready()
        return stamps, jax.device_get(params)

    def median(stamps):
        return float(np.median(np.diff(stamps[warmup:])))

    rows = []
    for _ in range(rounds):
        f, fp = fit_round()
        h, hp = hand_round()
        rows.append({"fit_ms": median(f) * 1e3, "hand_ms": median(h) * 1e3})
    for r in rows:
        r["ratio"] = r["fit_ms"] / r["hand_ms"]
    rel = max(float(np.linalg.norm(np.asarray(a) - np.asarray(b)) /
                    max(np.linalg.norm(np.asarray(b)), 1e-30))
              for a, b in zip(jax.tree.leaves(fp), jax.tree.leaves(hp), strict=True))
    ratio = float(np.median([r["ratio"] for r in rows]))
    del jnp
    return {"device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
            "steps": steps, "batch": 8, "tokens": length - 1, "lora_rank": 8,
            "targets": ["q_proj", "v_proj"], "rounds": rows, "median_ratio": ratio,
            "target_ratio": 1.02, "met": ratio <= 1.02, "final_adapters_max_rel_err": rel}


def run_child(args: list[str], devices: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=os.path.dirname(HERE))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], env=env,
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_hf(path: str, part: str) -> dict | None:
    python = os.environ.get("HF_PYTHON", "/work/venv-hf/bin/python")
    if not os.path.exists(python):
        return None
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    out = subprocess.run([python, "-c", HF_CHILD, path, part], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["load", "sample", "lora-step", "child-load",
                                    "child-sample", "child-lora-step"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--path", default=None, help="checkpoint directory (default under /tmp)")
    args = p.parse_args()
    if args.part == "child-load":
        print(json.dumps(child_load(args.path)))
        return
    if args.part == "child-sample":
        print(json.dumps(child_sample(args.path)))
        return
    if args.part == "child-lora-step":
        print(json.dumps(child_lora_step(args.path, args.steps, args.rounds)))
        return
    if args.part == "lora-step":
        path = args.path or "/tmp/jaxlight-bench-llama-small"
        write_checkpoint(path, SMALL, "float32")
        report = run_child(["child-lora-step", "--path", path, "--steps", str(args.steps),
                            "--rounds", str(args.rounds)], 1)
        report["checkpoint"] = path
        # A CPU figure keeps the plain name; an accelerator's is suffixed with its kind
        # (pretrained_lora_step_nvidia_h200.json), as the GPU benchmarks' files are.
        suffix = "" if report["platform"] == "cpu" else "_" + "_".join(
            report["device"].lower().replace("-", " ").split()[:2])
        write_result("pretrained_lora_step" + suffix, report)
        return
    if args.part == "load":
        path = args.path or "/tmp/jaxlight-bench-llama-1b"
        t = time.perf_counter()
        write_checkpoint(path, LLAMA_1B, "bfloat16")
        written = time.perf_counter() - t
        ours = run_child(["child-load", "--path", path], 8)
        theirs = run_hf(path, "load")
        bound = 1.25 * (ours["model_bytes"] + ours["largest_tensor_bytes"])
        grown = ours["peak_rss"] - ours["rss_before"]
        report = {
            "checkpoint": path, "parameters": ours["model_bytes"] // 2, "dtype": "bfloat16",
            "checkpoint_write_seconds": written, "jaxlight": ours, "transformers": theirs,
            "jaxlight_peak_rss_growth": grown, "rss_bound": bound,
            "rss_growth_over_bound": grown / bound, "met_rss": grown <= bound,
            "load_time_ratio_jaxlight_over_transformers":
                ours["seconds"] / theirs["seconds"] if theirs else None,
        }
        write_result("pretrained_load", report)
    else:
        path = args.path or "/tmp/jaxlight-bench-llama-small"
        write_checkpoint(path, SMALL, "float32")
        ours = run_child(["child-sample", "--path", path], 1)
        theirs = run_hf(path, "sample")
        report = {
            "checkpoint": path, "batch": 8, "prompt": 64, "new_tokens": 128, "dtype": "float32",
            "jaxlight": ours, "transformers": theirs,
            "tokens_per_s_ratio_jaxlight_over_transformers":
                ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs else None,
            "met": bool(theirs) and ours["tokens_per_s"] >= theirs["tokens_per_s"]
            and ours["compiled_programs"] == 1,
        }
        write_result("pretrained_sample", report)


if __name__ == "__main__":
    main()
