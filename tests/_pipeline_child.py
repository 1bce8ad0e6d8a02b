"""Trains a pipelined test model in its own process, for the SIGKILL resume tests.

Usage: python _pipeline_child.py '<json config>' with "kind": "stages" (StageMLP under
GPipe(3, 4) on 6 devices), "stages_mpmd" (the same under GPipe(3, 4, mpmd=True) on 3),
"stages_1f1b" and "stages_zb-h1" (that under schedule="1f1b" or "zb-h1"),
"staged_lm" (StagedTransformerLM under GPipe(4, 4) on 8 devices) or
"interleaved" (the 8-layer stack under GPipe(4, 4, repeats=2) on 4 devices); prints `STEP <n>`
after every step.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks  # noqa: E402
from tests.pipeline_runs import pipelined_run  # noqa: E402

cfg = json.loads(sys.argv[1])
printer = callbacks.LambdaCallback(
    on_train_batch_end=lambda fit, *a: print(f"STEP {fit.global_step}", flush=True))
strategy, module, data = pipelined_run(cfg["kind"], jax.devices())
fit = jl.Fit(strategy, max_steps=cfg["max_steps"],
             callbacks=[callbacks.ModelCheckpoint(cfg["dir"], every_n_steps=1), printer],
             enable_progress_bar=False, enable_model_summary=False, logger=False)
fit.fit(module, data)
print("DONE", flush=True)
