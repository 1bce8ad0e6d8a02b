"""Reading a multi-process job's layout from what a launcher left in the environment."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from jaxlight._errors import ConfigurationError

#: Environment variables jaxlight itself reads (the launcher sets them).
ENV_TIMEOUT = "JAXLIGHT_TIMEOUT"
ENV_HEARTBEAT = "JAXLIGHT_HEARTBEAT_TIMEOUT"
ENV_DISABLE = "JAXLIGHT_DISTRIBUTED"

#: Seconds to wait for every process to arrive; also the default for collective agreement.
DEFAULT_TIMEOUT = 300.0
#: JAX's own default heartbeat timeout; a dead process is noticed within this many seconds.
DEFAULT_HEARTBEAT = 100.0


# -- configuration -------------------------------------------------------------------------------

#: How each source spells its numbers, so that an error names the variable the user set.
_NAMES: dict[str, dict[str, str]] = {
    "explicit": {"num": "num_processes", "pid": "process_id", "addr": "coordinator_address",
                 "local_rank": "local_rank", "local_size": "local_world_size",
                 "nodes": "num_nodes"},
    "torchrun": {"num": "WORLD_SIZE", "pid": "RANK", "addr": "MASTER_ADDR:MASTER_PORT",
                 "local_rank": "LOCAL_RANK", "local_size": "LOCAL_WORLD_SIZE", "nodes": "NNODES"},
    "jax": {"num": "JAX_NUM_PROCESSES", "pid": "JAX_PROCESS_ID",
            "addr": "JAX_COORDINATOR_ADDRESS", "local_rank": "local_rank",
            "local_size": "local_world_size", "nodes": "num_nodes"},
    "slurm": {"num": "SLURM_NTASKS", "pid": "SLURM_PROCID", "addr": "coordinator_address",
              "local_rank": "SLURM_LOCALID", "local_size": "SLURM_NTASKS_PER_NODE",
              "nodes": "SLURM_STEP_NUM_NODES"},
    "ompi": {"num": "OMPI_COMM_WORLD_SIZE", "pid": "OMPI_COMM_WORLD_RANK",
             "addr": "coordinator_address", "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
             "local_size": "OMPI_COMM_WORLD_LOCAL_SIZE", "nodes": "num_nodes"},
    "k8s": {"num": "the Job's parallelism", "pid": "JOB_COMPLETION_INDEX",
            "addr": "coordinator_address", "local_rank": "local_rank",
            "local_size": "local_world_size", "nodes": "num_nodes"},
    "tpu": {"num": "TPU_WORKER_HOSTNAMES", "pid": "TPU_WORKER_ID", "addr": "coordinator_address",
            "local_rank": "local_rank", "local_size": "local_world_size", "nodes": "num_nodes"},
}

_SOURCE_TEXT = {
    "explicit": "initialize() arguments",
    "torchrun": "torchrun-style variables (jaxlight launch, torchrun)",
    "jax": "JAX_* variables",
    "slurm": "SLURM variables",
    "ompi": "Open MPI variables",
    "k8s": "a Kubernetes indexed Job",
    "tpu": "Cloud TPU variables",
    "jax.distributed": "an earlier jax.distributed.initialize() call",
    "none": "no launcher variables (one process)",
}


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where this process sits in a multi-process job, before and after connecting.

    Fields a cluster lets JAX fill in (the coordinator on SLURM, the process count on
    Kubernetes) are None until `initialize()` has connected.

    Attributes:
        num_processes: processes in the job (the world size).
        process_id: this process's index, 0 ... num_processes - 1 (the rank).
        coordinator_address: `host:port` of process 0's coordinator service.
        local_device_ids: the local devices this process uses (None: all it sees).
        local_rank: index of this process on its node.
        local_world_size: processes per node.
        num_nodes: nodes in the job.
        source: where the values came from ("explicit", "torchrun", "slurm", ...).
        cluster_detection_method: passed to `jax.distributed.initialize` for cluster sources.

    Example:
        >>> config = DistributedConfig(num_processes=4, process_id=1, local_world_size=2,
        ...                            num_nodes=2, coordinator_address="10.0.0.1:1234")
        >>> config.validate().describe()  # doctest: +ELLIPSIS
        'process 1 of 4 (2 nodes x 2 per node), coordinator 10.0.0.1:1234, from ...'
    """

    num_processes: int | None
    process_id: int | None
    coordinator_address: str | None = None
    local_device_ids: tuple[int, ...] | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    num_nodes: int | None = None
    source: str = "explicit"
    cluster_detection_method: str | None = None

    @property
    def is_multi_process(self) -> bool:
        """True unless the job is known to have one process."""
        return self.num_processes is None or self.num_processes > 1

    def _name(self, key: str) -> str:
        return _NAMES.get(self.source, _NAMES["explicit"])[key]

    def validate(self) -> DistributedConfig:
        """Checks the numbers agree with each other; raises ConfigurationError naming the first
        that does not. Returns self."""
        n, pid = self.num_processes, self.process_id
        src = _SOURCE_TEXT.get(self.source, self.source)
        if n is not None and n < 1:
            raise ConfigurationError(
                f"{self._name('num')}={n} (from {src}): the number of processes must be at "
                "least 1."
            )
        if pid is not None and pid < 0:
            raise ConfigurationError(
                f"{self._name('pid')}={pid} (from {src}): a process index is never negative; "
                f"ranks run from 0 to {self._name('num')} - 1."
            )
        if n is not None and pid is not None and pid >= n:
            raise ConfigurationError(
                f"{self._name('pid')}={pid} is not below {self._name('num')}={n} (from {src}): "
                f"with {n} processes the ranks are 0 ... {n - 1}. Start each process with its own "
                f"rank, or raise {self._name('num')} to the number of processes you start."
            )
        nodes, per_node = self.num_nodes, self.local_world_size
        if n is not None and nodes is not None and per_node is not None and nodes * per_node != n:
            raise ConfigurationError(
                f"{self._name('num')}={n} but {self._name('nodes')}={nodes} nodes x "
                f"{self._name('local_size')}={per_node} processes per node = {nodes * per_node} "
                f"(from {src}): the world size must equal nodes x processes per node. Fix "
                "whichever of the three is wrong."
            )
        if self.local_rank is not None:
            if self.local_rank < 0:
                raise ConfigurationError(
                    f"{self._name('local_rank')}={self.local_rank} (from {src}) is negative."
                )
            if per_node is not None and self.local_rank >= per_node:
                raise ConfigurationError(
                    f"{self._name('local_rank')}={self.local_rank} is not below "
                    f"{self._name('local_size')}={per_node} (from {src}): local ranks on a node "
                    f"run 0 ... {per_node - 1}."
                )
        if self.coordinator_address is not None:
            split_address(self.coordinator_address, self._name("addr"))
        return self

    def describe(self) -> str:
        """One line for logs: rank, layout, coordinator and where the values came from."""
        n = "?" if self.num_processes is None else self.num_processes
        pid = "?" if self.process_id is None else self.process_id
        layout = ""
        if self.num_nodes is not None and self.local_world_size is not None:
            layout = f" ({self.num_nodes} nodes x {self.local_world_size} per node)"
        coord = f", coordinator {self.coordinator_address}" if self.coordinator_address else ""
        return (f"process {pid} of {n}{layout}{coord}, from "
                f"{_SOURCE_TEXT.get(self.source, self.source)}")


def split_address(address: str, name: str = "coordinator_address") -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    host = host.strip("[]")
    if not sep or not host:
        raise ConfigurationError(
            f"{name}={address!r} is not host:port; write it as, for example, 10.0.0.1:1234."
        )
    try:
        number = int(port)
    except ValueError:
        raise ConfigurationError(
            f"{name}={address!r}: port {port!r} is not an integer (write host:port)."
        ) from None
    if not 0 < number < 65536:
        raise ConfigurationError(f"{name}={address!r}: port {number} is not in 1 ... 65535.")
    return host, number


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigurationError(
            f"environment variable {name}={value!r} is not an integer."
        ) from None


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    """SLURM's uniform tasks per node ("4" or "4(x2)"), or None when it differs between nodes."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _env_int(env, "SLURM_NTASKS_PER_NODE")
    spec = env.get("SLURM_STEP_TASKS_PER_NODE", "")
    match = re.fullmatch(r"(\d+)(\(x\d+\))?", spec)
    return int(match.group(1)) if match else None


def detect(env: Mapping[str, str] | None = None) -> DistributedConfig | None:
    """Reads a multi-process job's layout from launcher variables; None when there are none.

    The order of precedence is torchrun-style variables, then `JAX_*` variables, then SLURM,
    Open MPI, a Kubernetes indexed Job and Cloud TPU (the clusters `jax.distributed` detects).
    Setting `JAXLIGHT_DISTRIBUTED=0` turns detection off.

    Example:
        >>> config = detect({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "RANK": "1",
        ...                  "WORLD_SIZE": "2"})
        >>> config.process_id, config.num_processes, config.coordinator_address
        (1, 2, '10.0.0.1:1234')
    """
    env = os.environ if env is None else env
    if env.get(ENV_DISABLE, "").lower() in ("0", "false", "no", "off"):
        return None
    if "WORLD_SIZE" in env:
        if env["WORLD_SIZE"].strip() == "1" and not env.get("MASTER_ADDR"):
            return DistributedConfig(num_processes=1, process_id=0, source="torchrun")
        missing = [v for v in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
                   if not env.get(v)]
        if missing:
            raise ConfigurationError(
                f"torchrun-style launch variables are incomplete: {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not set (WORLD_SIZE, RANK, MASTER_ADDR "
                "and MASTER_PORT go together). Start the processes with `jaxlight launch "
                "--nprocs N -- python train.py` or set all four."
            )
        port = env.get("JAX_COORDINATOR_PORT") or env["MASTER_PORT"]
        n = _env_int(env, "WORLD_SIZE")
        local_size = _env_int(env, "LOCAL_WORLD_SIZE")
        nodes = _env_int(env, "NNODES")
        if nodes is None and n is not None and local_size:
            nodes = n // local_size if n % local_size == 0 else None
        local_rank = _env_int(env, "LOCAL_RANK")
        # Several processes on one node: one accelerator each, as JAX does for SLURM and MPI.
        device_ids = (local_rank,) if local_rank is not None and (local_size or 1) > 1 else None
        return DistributedConfig(
            num_processes=n, process_id=_env_int(env, "RANK"),
            coordinator_address=f"{env['MASTER_ADDR']}:{port}", local_device_ids=device_ids,
            local_rank=local_rank, local_world_size=local_size, num_nodes=nodes,
            source="torchrun", cluster_detection_method="deactivate",
        )
    if env.get("JAX_COORDINATOR_ADDRESS") and "JAX_NUM_PROCESSES" in env:
        return DistributedConfig(
            num_processes=_env_int(env, "JAX_NUM_PROCESSES"),
            process_id=_env_int(env, "JAX_PROCESS_ID"),
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"], source="jax",
            cluster_detection_method="deactivate" if "JAX_PROCESS_ID" in env else None,
        )
    # The clusters below are detected exactly as jax._src.clusters does; JAX then finds the
    # coordinator itself (cluster_detection_method).
    if all(v in env for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                              "SLURM_PROCID", "SLURM_LOCALID")):
        return DistributedConfig(
            num_processes=_env_int(env, "SLURM_NTASKS"), process_id=_env_int(env, "SLURM_PROCID"),
            local_rank=_env_int(env, "SLURM_LOCALID"),
            local_world_size=_slurm_tasks_per_node(env),
            num_nodes=_env_int(env, "SLURM_STEP_NUM_NODES") or _env_int(env, "SLURM_NNODES"),
            source="slurm", cluster_detection_method="slurm",
        )
    if "OMPI_COMM_WORLD_SIZE" in env:
        # JAX finds the coordinator in OMPI_MCA_orte_hnp_uri, which Open MPI 5 no longer sets;
        # then the address must be given (checked by initialize()).
        uri = "OMPI_MCA_orte_hnp_uri" in env
        return DistributedConfig(
            num_processes=_env_int(env, "OMPI_COMM_WORLD_SIZE"),
            process_id=_env_int(env, "OMPI_COMM_WORLD_RANK"),
            coordinator_address=None if uri else env.get("JAX_COORDINATOR_ADDRESS"),
            local_rank=_env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            local_world_size=_env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
            source="ompi", cluster_detection_method="ompi" if uri else "deactivate",
        )
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        # The process count is the Job's parallelism, which only the Kubernetes API knows.
        return DistributedConfig(num_processes=None,
                                 process_id=_env_int(env, "JOB_COMPLETION_INDEX"), source="k8s")
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES")
    if hosts and ("," in hosts or _env_int(env, "MEGASCALE_NUM_SLICES") not in (None, 1)):
        return DistributedConfig(num_processes=None, process_id=_env_int(env, "TPU_WORKER_ID"),
                                 source="tpu", cluster_detection_method="gketpu")
    return None

