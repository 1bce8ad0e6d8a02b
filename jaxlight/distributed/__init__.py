"""Multi-process and multi-node training on JAX's own distributed runtime (`jax.distributed`).

One Python process runs per host (or per accelerator); every process runs the same program.
`initialize()` connects them: explicitly, or from what a launcher left in the environment.

| launcher | variables read (coordinator) |
|---|---|
| `jaxlight launch`, torchrun | `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, |
|                             | `LOCAL_WORLD_SIZE` (`MASTER_ADDR:MASTER_PORT`) |
| plain JAX variables | `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID` |
| SLURM (`srun`) | `SLURM_NTASKS`, `SLURM_PROCID`, `SLURM_LOCALID`, ... (JAX picks it) |
| Open MPI (`mpirun`) | `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_RANK`, ... (JAX picks it) |
| Kubernetes indexed Job | `JOB_COMPLETION_INDEX` and the Kubernetes API (JAX picks it) |
| Cloud TPU on GKE | `TPU_WORKER_HOSTNAMES` / `TPU_PROCESS_ADDRESSES` (JAX picks it) |

`Fit` and `jaxlight.data.ArrayLoader` call `initialize()` themselves, so a training script
needs no distributed code at all; `jaxlight launch --nprocs 2 -- python train.py` runs it on two
processes. Call `initialize()` yourself only to pass arguments, and then before anything else
touches JAX (XLA starts its backend once, and a started backend cannot join a job).

On CPU the processes talk through gloo (`jax_cpu_collectives_implementation="gloo"`); on GPU
through NCCL. A process that never arrives, or dies, ends the others within `timeout` seconds
(missing at start) or the heartbeat timeout (dead later) with an error naming what happened,
instead of a hang.

The package has four parts: `_environment` (what a launcher left in the environment:
`detect`, `DistributedConfig`), `_connect` (joining the job: `initialize`), `_agreement`
(small host-side exchanges between processes: `all_gather_json`, `agree_stop`, version and
device checks) and `_gather` (`gather`: arrays that span processes, whole on the host, e.g.
the trained model after an FSDP fit).

Example:
    >>> import jaxlight as jl
    >>> config = jl.distributed.initialize()   # no launcher variables: one process
    >>> config.num_processes
    1

May import only the root modules (layer 2 of docs/architecture.md): every other folder may use it.
"""

from jaxlight._errors import DistributedError
from jaxlight.distributed._agreement import (
    agree_max,
    agree_stop,
    all_gather_json,
    check_devices,
    check_same_across_processes,
    check_versions,
    local_devices_report,
    package_versions,
    reached_preemption_sync_point,
)
from jaxlight.distributed._connect import (
    check_port_free,
    initialize,
    is_initialized,
    process_count,
    process_index,
)
from jaxlight.distributed._environment import (
    DEFAULT_HEARTBEAT,
    DEFAULT_TIMEOUT,
    ENV_DISABLE,
    ENV_HEARTBEAT,
    ENV_TIMEOUT,
    DistributedConfig,
    detect,
)
from jaxlight.distributed._gather import gather

__all__ = [
    "DEFAULT_HEARTBEAT",
    "DEFAULT_TIMEOUT",
    "ENV_DISABLE",
    "ENV_HEARTBEAT",
    "ENV_TIMEOUT",
    "DistributedConfig",
    "DistributedError",
    "agree_max",
    "agree_stop",
    "all_gather_json",
    "check_devices",
    "check_port_free",
    "check_same_across_processes",
    "check_versions",
    "detect",
    "gather",
    "initialize",
    "is_initialized",
    "local_devices_report",
    "package_versions",
    "process_count",
    "process_index",
    "reached_preemption_sync_point",
]
