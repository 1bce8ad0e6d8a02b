"""Trains `StageMLP` under GPipe in its own process, for the SIGKILL resume test.

Usage: python _stages_child.py '<json config>'; prints `STEP <n>` after every step.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks, strategies  # noqa: E402
from tests.nn.stages_mlp import StageMLP, stage_data  # noqa: E402

cfg = json.loads(sys.argv[1])
printer = callbacks.LambdaCallback(
    on_train_batch_end=lambda fit, *a: print(f"STEP {fit.global_step}", flush=True))
fit = jl.Fit(strategies.GPipe(3, 4, devices=jax.devices()[:6]), max_steps=cfg["max_steps"],
             callbacks=[callbacks.ModelCheckpoint(cfg["dir"], every_n_steps=1), printer],
             enable_progress_bar=False, enable_model_summary=False, logger=False)
fit.fit(StageMLP(), jl.data.ArrayLoader(stage_data(192), 24, seed=1), ckpt_path=cfg.get("resume"))
print("DONE", flush=True)
