"""Shared pieces of the benchmark scripts: simulated devices, a transformer LM, JSON output.

Import `setup_devices(n)` first, before anything imports JAX.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def setup_devices(n: int) -> None:
    """Simulates `n` CPU devices; must run before JAX is imported."""
    if "jax" in sys.modules:
        raise RuntimeError("setup_devices must run before jax is imported")
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if "force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def gpipe_precision() -> float | None:
    """The GPipe (`Stages`, p = 4) benchmark's committed max |measured − theory| bubble
    (`results/pipeline_stages.json`): the precision other pipeline bubbles are held to."""
    path = os.path.join(RESULTS, "pipeline_stages.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["schedule"]["p=4"]["max_bubble_abs_error"]


def write_result(name: str, report: dict, out: str | None = None) -> str:
    """Prints the report as JSON and writes benchmarks/results/<name>.json (or `out`)."""
    path = out or os.path.join(RESULTS, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def lm_module(vocab=512, embed=256, layers=4, heads=8, mlp=1024, lr=1e-3, weight_decay=1e-4):
    """A TrainModule around jaxlight.nn.TransformerLM (untied head, every rule used); AdamW
    (`weight_decay` defaults to optax's)."""
    import optax

    import jaxlight as jl
    from jaxlight import nn

    class LM(jl.TrainModule):
        def __init__(self):
            super().__init__()
            self.config = nn.TransformerConfig(vocab_size=vocab, embed_dim=embed,
                                               num_layers=layers, num_heads=heads, mlp_dim=mlp,
                                               tie_embeddings=False)

        def configure_model(self, rngs):
            return nn.TransformerLM(self.config, rngs=rngs)

        def configure_optimizers(self):
            return optax.adamw(lr, weight_decay=weight_decay)

        def training_step(self, model, batch):
            logits = model(batch["tokens"][:, :-1])
            return nn.lm_loss(logits, batch["tokens"][:, 1:])

        def tokens_per_batch(self, batch):
            return int(batch["tokens"][:, 1:].size)

    return LM()


def token_batch(batch: int, length: int, vocab: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, vocab, size=(batch, length + 1)).astype(np.int32)}


def strategy_from_name(name: str):
    """'single', 'dp', 'ddp', 'fsdp', 'tp2', 'tp4', 'hybrid' (data2×fsdp2×tp2), 'gpipe4'."""
    from jaxlight import strategies

    table = {
        "single": lambda: strategies.SingleDevice(),
        "dp": lambda: strategies.DataParallel(),
        "ddp": lambda: strategies.DDP(),
        "fsdp": lambda: strategies.FSDP(),
        "tp2": lambda: strategies.TensorParallel(2),
        "tp4": lambda: strategies.TensorParallel(4),
        "hybrid": lambda: strategies.Hybrid({"data": 2, "fsdp": 2, "tp": 2}),
        "gpipe4": lambda: strategies.GPipe(stages=4, microbatches=8),
    }
    return table[name]()


def quiet_fit(strategy, **kw):
    import jaxlight as jl

    kw.setdefault("max_steps", 1)
    return jl.Fit(strategy, enable_progress_bar=False, enable_model_summary=False, logger=False,
                  **kw)
