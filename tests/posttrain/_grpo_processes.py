"""The grpo recipe's fit in one process or several (tests/posttrain/test_grpo_processes.py).

    python _grpo_processes.py OUT   # in each of 2 processes x 4 devices: OUT/rank{r}.npz

`run(out, name)` is the whole job: a 4-step FSDP fit on the tiny Qwen 3 fixture (2 prompts x 4
completions per generation batch, 2 updates each, the recipe's own learning rate), recording each
step's loss, `ppo_kl` and logged reward statistics, the first and last generation batches this
process holds and the policy before and after training.

The reward functions (`PATH.py:fn`, this file's) give random-weight completions rewards that
differ between rows and a function that applies to some rows only, so that the statistics of one
process's rows differ from the whole batch's. Both weigh 1: the advantages are non-zero (up to
1.35 in absolute value), so the updates follow the policy gradient, not only the KL term. The
first generation batch (`first_*`) and the last one (`batch_*`) are both recorded.
"""

from __future__ import annotations

import os
import sys

import numpy as np

import jaxlight as jl
from jaxlight import distributed

#: The logged figures compared with one process's.
STATS = ("reward", "reward_std", "rewards/first_token/mean", "rewards/first_token/std",
         "rewards/odd_start/mean", "rewards/odd_start/std")


def first_token(prompts, completions, completion_ids, **_):
    """The first completion token id modulo 7, over 7."""
    return [(ids[0] % 7) / 7 for ids in completion_ids]


def odd_start(prompts, completions, completion_ids, **_):
    """The last token id modulo 5, over 5, for completions whose first token id is odd; None
    for the others."""
    return [(ids[-1] % 5) / 5 if ids[0] % 2 else None for ids in completion_ids]


FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nn",
                       "pretrained", "fixtures", "qwen3")


def run(path: str, callbacks=(), ckpt_path: str | None = None) -> None:
    """The fit, with extra `callbacks` and `ckpt_path` for the SIGKILL resume
    (tests/posttrain/_grpo_processes_resume.py)."""
    from jaxlight.recipes import grpo

    config = grpo.Config()
    config.model.pretrained = FIXTURE
    config.data.prompts_per_step, config.grpo.group_size = 2, 4
    config.grpo.max_new_tokens, config.grpo.updates = 4, 2
    here = os.path.abspath(__file__)
    config.grpo.reward_funcs = f"{here}:first_token,{here}:odd_start"
    config.grpo.reward_weights = "1,1"
    module, data = grpo.build(config)
    losses, first = {}, {}
    generate = data.train._generate

    def record_first():
        batch = generate()
        first.setdefault("batch", batch)
        return batch

    data.train._generate = record_first

    start = {}

    class Losses(jl.callbacks.Callback):
        def on_train_start(self, fit, module):
            start.update(_policy_params(module))

        def on_log(self, fit, module, metrics, step):
            losses[step] = [metrics["loss"], metrics["ppo_kl"]] + [metrics[k] for k in STATS]

    # No default checkpoint at train end (read by no test; seconds per process): only the
    # resume test's ModelCheckpoint saves.
    saves = any(isinstance(cb, jl.callbacks.ModelCheckpoint) for cb in callbacks)
    fit = jl.Fit("fsdp", max_steps=4, log_every_n_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, callbacks=[Losses(), *callbacks],
                 enable_checkpointing=saves)
    fit.fit(module, data.train, ckpt_path=ckpt_path)
    flat = _policy_params(module)
    flat.update({"start_" + k: v for k, v in start.items()})
    batch = {"batch_" + k: v for k, v in data.train.batch.items()}
    # (none when a resumed fit continued the checkpoint's generation batch to the end)
    batch.update({"first_" + k: v for k, v in first.get("batch", {}).items()})
    logged = np.array([losses[s] for s in sorted(losses)])
    np.savez(path, losses=logged[:, 0], ppo_kl=logged[:, 1], stats=logged[:, 2:],
             steps=np.array(sorted(losses)), **batch, **flat)


def _policy_params(module) -> dict:
    import jax
    from flax import nnx

    params = distributed.gather(nnx.to_pure_dict(nnx.state(module.policy(module.model),
                                                           nnx.Param)))
    return {"param" + jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)}


if __name__ == "__main__":
    distributed.initialize()  # join the launched job before anything starts JAX's backend
    import jax

    run(os.path.join(sys.argv[1], f"rank{jax.process_index()}.npz"))
