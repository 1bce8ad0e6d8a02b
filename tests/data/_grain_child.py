"""A fit reading a grain pipeline, in its own process (one of a job's processes, or alone).

Usage: python _grain_child.py '<json config>'. Prints `STEP <n>` after every step; with
`pause_at` it commits that step's checkpoint, prints PAUSED and waits to be killed. At the end it
writes the final parameters and the records each step saw to `<out>.<process>.npz`. Without
`dir` (the checkpoint directory) it saves no checkpoint.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

cfg = json.loads(sys.argv[1])

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jaxlight as jl  # noqa: E402
from jaxlight import callbacks, strategies  # noqa: E402
from tests.data._grain import pipeline  # noqa: E402
from tests.models import Classifier  # noqa: E402

seen = {}


def on_step(fit, module, outputs, batch, batch_idx):
    seen[fit.global_step] = np.asarray(batch["index"]).tolist()
    print(f"STEP {fit.global_step}", flush=True)
    if fit.global_step == cfg.get("pause_at"):
        ckpt.save_now(fit, module, wait=True)  # committed: the parent kills after this
        print("PAUSED", flush=True)
        time.sleep(600)


def main():
    global ckpt
    # Without `dir` (a run nothing resumes from) the fit saves no checkpoint: seconds each.
    ckpt = callbacks.ModelCheckpoint(cfg["dir"], every_n_steps=cfg.get("every", 1000)) \
        if cfg.get("dir") else None
    fit = jl.Fit(strategies.DataParallel(), max_steps=cfg["max_steps"], logger=False,
                 callbacks=[*([ckpt] if ckpt else []),
                            callbacks.LambdaCallback(on_train_batch_end=on_step)],
                 enable_progress_bar=False, enable_model_summary=False,
                 enable_checkpointing=ckpt is not None)
    # After Fit: it joined the job, so grain's ShardByJaxProcess sees this process's index.
    log = f"{cfg['log']}.rank{jax.process_index()}" if cfg.get("log") else None
    data = pipeline(cfg["kind"], cfg["records"], log, cfg.get("workers", 1))
    module = Classifier()
    fit.fit(module, data, ckpt_path=cfg.get("ckpt_path"))
    params = nnx.to_pure_dict(nnx.state(module.model, nnx.Param))
    # DataParallel replicates the parameters: this process's copy is the whole array.
    flat = {jax.tree_util.keystr(p): np.asarray(x.addressable_data(0))
            for p, x in jax.tree_util.tree_leaves_with_path(params)}
    np.savez(f"{cfg['out']}.{jax.process_index()}.npz", **flat)
    with open(f"{cfg['out']}.{jax.process_index()}.json", "w") as f:
        json.dump(seen, f)
    print("DONE", flush=True)


if __name__ == "__main__":  # grain's worker processes import this file again
    main()
