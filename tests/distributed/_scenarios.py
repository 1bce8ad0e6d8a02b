"""Multi-process scenarios for the tests, each run by every process: `python _scenarios.py OUT
NAME...`. Each scenario writes `OUT/NAME_rank{r}.json` with what this process saw, so that the
test (in the pytest process) checks every rank's outcome.

Scenarios that expect an error catch it on every process: the checks under test raise on all
processes alike, so the job stays in step and the next scenario runs in the same processes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

RANK = int(os.environ.get("RANK", "0"))


def _error(fn) -> dict:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - recorded for the test to check
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def versions(out: str) -> dict:
    """Process 1 reports another jaxlight version: every process refuses the job."""
    from jaxlight import distributed

    distributed.initialize()  # checks the real versions (equal) first
    mine = dict(distributed.package_versions())
    if RANK == 1:
        mine["jaxlight"] = "0.0.0-other"
    return _error(lambda: distributed.check_versions(mine))


def devices(out: str) -> dict:
    """Process 1 reports two devices of another kind: every process refuses the job."""
    from jaxlight import distributed

    distributed.initialize()  # checks the real devices (alike) first
    mine = distributed.local_devices_report()
    if RANK == 1:
        mine = {"platform": "gpu", "kinds": {"NVIDIA H100 80GB HBM3": 2}, "count": 2}
    return _error(lambda: distributed.check_devices(mine))


def batch_size(out: str) -> dict:
    """Process 1 feeds 8 examples per batch, process 0 feeds 16: refused before compiling."""
    import jaxlight as jl
    from tests.distributed._train_script import Module, data

    n = 16 if RANK == 0 else 8
    batches = [{k: v[:n] for k, v in data(64, 0).items()}] * 4
    fit = jl.Fit("dp", max_steps=2, enable_progress_bar=False, enable_model_summary=False,
                 logger=False)
    result = _error(lambda: fit.fit(Module(), batches))
    result["compiles"] = dict(fit.compile_counts)
    return result


def data_length(out: str) -> dict:
    """Process 1 has one batch fewer: refused at the start instead of hanging at the end."""
    import jaxlight as jl
    from tests.distributed._train_script import Module, data

    batches = [{k: v[:16] for k, v in data(64, 0).items()}] * (4 if RANK == 0 else 3)
    fit = jl.Fit("dp", max_epochs=1, enable_progress_bar=False, enable_model_summary=False,
                 logger=False)
    return _error(lambda: fit.fit(Module(), batches))


def stop_on_one_process(out: str) -> dict:
    """Only process 1 asks to stop (at step 3); both processes stop at the same step."""
    import jaxlight as jl
    from tests.distributed._train_script import Module, data

    def maybe_stop(fit, module, outputs, batch, batch_idx):
        if RANK == 1 and fit.global_step == 3:
            fit.request_stop("a host-side decision on process 1")

    loader = jl.data.ArrayLoader(data(512, 0), 32, seed=0)
    fit = jl.Fit("dp", max_steps=12, log_every_n_steps=2, enable_progress_bar=False,
                 enable_model_summary=False, logger=False, enable_checkpointing=False,
                 callbacks=[jl.callbacks.LambdaCallback(on_train_batch_end=maybe_stop)])
    fit.fit(Module(), loader)
    return {"global_step": fit.global_step, "reason": fit.stop_reason}


def tp_everywhere(out: str) -> dict:
    """TensorParallel over all 8 devices replicates the batch on both processes: refused."""
    import jaxlight as jl
    from jaxlight import strategies
    from tests.distributed._train_script import Module

    loader = jl.data.ArrayLoader({"x": np.zeros((64, 16), np.float32),
                                  "y": np.zeros(64, np.int32)}, 32)
    fit = jl.Fit(strategies.TensorParallel(), max_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False)
    return _error(lambda: fit.fit(Module(), loader))


def mesh_size(out: str) -> dict:
    """A 4-device mesh on a job of 2 processes x 4 devices: refused, naming the layout."""
    import jaxlight as jl
    from jaxlight import strategies
    from tests.distributed._train_script import Module, data

    fit = jl.Fit(strategies.Hybrid({"data": 2, "tp": 2}), max_steps=1, enable_progress_bar=False,
                 enable_model_summary=False, logger=False)
    return _error(lambda: fit.fit(Module(), [data(16, 0)]))


def die(out: str) -> dict:
    """Process $DIE_RANK (1) is killed (SIGKILL) once connected; the other must not hang."""
    from jaxlight import distributed

    distributed.initialize()
    if int(os.environ.get("DIE_RANK", "1")) == RANK:
        print(f"rank {RANK} dies at {time.time():.3f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
    return {}


SCENARIOS = {f.__name__: f for f in (versions, devices, batch_size, data_length,
                                     stop_on_one_process, tp_everywhere, mesh_size, die)}


def main(argv: list[str]) -> None:
    out, names = argv[0], argv[1:]
    for name in names:
        result = SCENARIOS[name](out)
        with open(os.path.join(out, f"{name}_rank{RANK}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
