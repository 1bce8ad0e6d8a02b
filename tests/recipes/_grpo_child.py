"""A grpo recipe fit in its own process (tests/recipes/test_grpo.py's SIGKILL resume).

    python _grpo_child.py '{"dir": ..., "steps": 6, "pause_at": 3}'   # checkpoint step 3,
        # print "paused" after step pause_at's checkpoint and wait to be killed
    python _grpo_child.py '{"dir": ..., "steps": 6, "resume": true}'  # resume from "last",
        # write the final policy and the feed's record to dir/resumed.npz
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.recipes.test_grpo import run_grpo  # noqa: E402

if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    import jaxlight as jl

    class Pause(jl.callbacks.Callback):
        def on_train_batch_end(self, fit, module, outputs, batch, batch_idx):
            if fit.global_step == cfg.get("pause_at"):
                print("paused", flush=True)
                time.sleep(600)

    # Every 3 steps: step 3's checkpoint (mid generation batch 1) is the one resumed; earlier
    # ones would only cost their saves.
    ckpt = jl.callbacks.ModelCheckpoint(os.path.join(cfg["dir"], "ckpt"), every_n_train_steps=3,
                                        async_save=False)
    out = run_grpo(cfg["steps"], callbacks=[ckpt, Pause()],
                   ckpt_path="last" if cfg.get("resume") else None)
    out.save(os.path.join(cfg["dir"], "resumed.npz"))
    print("done", flush=True)
