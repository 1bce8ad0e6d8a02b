"""Trains TinyLM under Hybrid({"context": 8}) (or the config's "mesh" and "kw") in its own
process, for the SIGKILL resume tests.

Usage: python _context_child.py '<json config>' with "dir" and "max_steps" (and optionally
"mesh", "kw"); checkpoints every step and prints `STEP <n>` after every step.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks, strategies  # noqa: E402
from tests.strategies.context_runs import context_data, context_module  # noqa: E402

cfg = json.loads(sys.argv[1])
printer = callbacks.LambdaCallback(
    on_train_batch_end=lambda fit, *a: print(f"STEP {fit.global_step}", flush=True))
saver = callbacks.ModelCheckpoint(cfg["dir"], every_n_steps=1, save_top_k=-1)
strategy = strategies.Hybrid(cfg.get("mesh", {"context": 8}), **cfg.get("kw", {}))
fit = jl.Fit(strategy, max_steps=cfg["max_steps"],
             callbacks=[saver, printer],
             enable_progress_bar=False, enable_model_summary=False, logger=False)
fit.fit(context_module(), context_data(cfg["max_steps"]))
print("DONE", flush=True)
