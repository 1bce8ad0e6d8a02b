"""The grpo recipe's fit in one process or several (tests/posttrain/test_grpo_processes.py).

    python _grpo_processes.py OUT   # in each of 2 processes x 4 devices: OUT/rank{r}.npz

`run(out, name)` is the whole job: a 4-step FSDP fit on the tiny Qwen 3 fixture (2 prompts x 4
completions per generation batch, 2 updates each), recording each step's loss, the last
generation batch this process holds and the trained policy.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import jaxlight as jl
from jaxlight import distributed

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                       "pretrained", "fixtures", "qwen3")


def run(path: str) -> None:
    import jax
    from flax import nnx

    from jaxlight.recipes import grpo

    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.updates = 4, 2
    config.optim.lr = 1e-2
    module, data = grpo.build(config)
    losses = {}

    class Losses(jl.callbacks.Callback):
        def on_log(self, fit, module, metrics, step):
            losses[step] = metrics["loss"]

    fit = jl.Fit("fsdp", max_steps=4, log_every_n_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, callbacks=[Losses()])
    fit.fit(module, data.train)
    params = distributed.gather(nnx.to_pure_dict(nnx.state(module.policy(module.model),
                                                           nnx.Param)))
    flat = {"param" + jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}
    batch = {"batch_" + k: v for k, v in data.train.batch.items()}
    np.savez(path, losses=np.array([losses[s] for s in sorted(losses)]),
             steps=np.array(sorted(losses)), **batch, **flat)


if __name__ == "__main__":
    distributed.initialize()  # join the launched job before anything starts JAX's backend
    import jax

    run(os.path.join(sys.argv[1], f"rank{jax.process_index()}.npz"))
