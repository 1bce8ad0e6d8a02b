"""The 2-process grpo fit of _grpo_processes.py, checkpointed and SIGKILLed, then resumed
(tests/posttrain/test_grpo_processes.py).

    python _grpo_processes_resume.py DIR pause   # checkpoint every step into DIR/ckpt; after
        # step PAUSE_AT's checkpoint (every process past it) write DIR/paused{rank}, wait to be
        # killed
    python _grpo_processes_resume.py DIR resume  # resume from "last": DIR/rank{r}.npz
"""

import os
import sys
import time

import jaxlight as jl
from jaxlight import distributed

#: Paused after this step's checkpoint: generation batch 1 (steps 3 and 4) has fed one of its two
#: updates, so the resume must continue with the batch each process held, not sample anew.
PAUSE_AT = 3

if __name__ == "__main__":
    distributed.initialize()  # join the launched job before anything starts JAX's backend
    import jax

    from tests.posttrain import _grpo_processes as script

    out, mode = sys.argv[1], sys.argv[2]
    rank = jax.process_index()

    class Pause(jl.callbacks.Callback):
        def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
            if fit.global_step == PAUSE_AT:
                distributed.all_gather_json("paused", rank)  # both past the checkpoint
                with open(os.path.join(out, f"paused{rank}"), "w") as f:
                    f.write(str(fit.global_step))
                time.sleep(600)

    ckpt = jl.callbacks.ModelCheckpoint(os.path.join(out, "ckpt"), every_n_train_steps=1,
                                        save_top_k=-1, async_save=False)
    pause = [Pause()] if mode == "pause" else []
    script.run(os.path.join(out, f"rank{rank}.npz"), callbacks=[ckpt, *pause],
               ckpt_path="last" if mode == "resume" else None)
