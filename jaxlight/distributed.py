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

Example:
    >>> import jaxlight as jl
    >>> config = jl.distributed.initialize()   # no launcher variables: one process
    >>> config.num_processes
    1
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxlight._errors import ConfigurationError, DataError, DistributedError

__all__ = [
    "DistributedConfig",
    "DistributedError",
    "agree_stop",
    "all_gather_json",
    "check_same_across_processes",
    "detect",
    "initialize",
    "is_initialized",
    "process_count",
    "process_index",
]

logger = logging.getLogger("jaxlight.distributed")

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
            _split_address(self.coordinator_address, self._name("addr"))
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


def _split_address(address: str, name: str = "coordinator_address") -> tuple[str, int]:
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


# -- connecting ----------------------------------------------------------------------------------

_lock = threading.Lock()
_config: DistributedConfig | None = None
_timeout: float = DEFAULT_TIMEOUT
_round = itertools.count()


def is_initialized() -> bool:
    """True once this process has joined a multi-process job (through jaxlight or JAX)."""
    import jax

    return _config is not None or jax.distributed.is_initialized()


def process_index() -> int:
    """This process's index, joining a launched job first if the environment describes one."""
    import jax

    initialize()
    return jax.process_index()


def process_count() -> int:
    """The number of processes, joining a launched job first if the environment describes one."""
    import jax

    initialize()
    return jax.process_count()


def _backend_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _float_env(name: str) -> float | None:
    value = os.environ.get(name)
    if not value:
        return None
    try:
        out = float(value)
    except ValueError:
        raise ConfigurationError(f"{name}={value!r} is not a number of seconds.") from None
    if out <= 0:
        raise ConfigurationError(f"{name}={value!r} must be a positive number of seconds.")
    return out


def _free_port_hint() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_port_free(port: int, name: str = "the coordinator port") -> None:
    """Raises ConfigurationError if `port` cannot be bound on every interface.

    Process 0's coordinator binds `[::]:port`; gRPC crashes the process (a segfault in JAX 0.10)
    when the port is taken, so the port is tried first with the same options.
    """
    families = [(socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))]
    last: OSError | None = None
    for family, address in families:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                # gRPC sets SO_REUSEADDR too: a port in TIME_WAIT is free for it and for us.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                s.bind(address)
                return
        except OSError as err:
            last = err
            if err.errno == errno.EADDRINUSE:
                break
    if last is not None and last.errno == errno.EADDRINUSE:
        other = _free_port_hint()
        raise ConfigurationError(
            f"{name} is already in use on this machine (another job, an earlier run that is "
            "still shutting down, or a second process started with rank 0). Pick another "
            f"port, for example {other} (free now): `jaxlight launch --port {other}`, "
            f"MASTER_PORT={other}, or JAX_COORDINATOR_PORT={other} (under torchrun, whose own "
            "store holds MASTER_PORT)."
        )
    # No usable address family at all: let JAX report what it finds.


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _connect(config: DistributedConfig, timeout: float, heartbeat: float) -> None:
    """`jax.distributed.initialize` with a deadline that ends in a Python exception.

    JAX blocks in C++ until every process has registered and, past its own deadline, aborts the
    process with a log line. Connecting on a helper thread lets this process raise a clear
    DistributedError at `timeout` instead; JAX's deadline is set later as a backstop.
    """
    import jax

    box: dict[str, BaseException] = {}

    def run():
        try:
            jax.distributed.initialize(
                coordinator_address=config.coordinator_address,
                num_processes=config.num_processes,
                process_id=config.process_id,
                local_device_ids=list(config.local_device_ids) if config.local_device_ids
                else None,
                cluster_detection_method=config.cluster_detection_method,
                initialization_timeout=int(timeout) + 30,
                heartbeat_timeout_seconds=max(1, int(round(heartbeat))),
                shutdown_timeout_seconds=max(300, int(timeout)),
            )
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = err

    thread = threading.Thread(target=run, name="jaxlight-distributed-connect", daemon=True)
    thread.start()
    thread.join(timeout)
    n, pid = config.num_processes, config.process_id
    names = (config._name("num"), config._name("pid"))
    if thread.is_alive():
        what = (f"{names[0]}={n}" if n is not None else "the job's process count")
        advice = (f"Check that {what} matches the number of processes started (jaxlight launch "
                  "--nprocs, srun -n, the Job's parallelism), that every process uses the same "
                  "coordinator address, and look for a process that crashed before connecting. "
                  f"Slow starts need a longer timeout ({ENV_TIMEOUT}=seconds, jaxlight launch "
                  "--timeout, or initialize(timeout=...)). This process cannot use JAX any "
                  "more: let it exit.")
        if pid == 0:
            raise DistributedError(
                f"process 0 waited {timeout:g} s for the other processes of the job to connect "
                f"to its coordinator at {config.coordinator_address or '(chosen by JAX)'}, but "
                f"not all {n if n is not None else ''} arrived. {advice}"
            )
        addr = config.coordinator_address
        if addr is not None:
            host, port = _split_address(addr)
            if not _reachable(host, port):
                raise DistributedError(
                    f"process {pid} could not reach the coordinator at {addr} within "
                    f"{timeout:g} s: nothing is listening there. Process 0 has not started, "
                    f"crashed, or listens at another address; check {config._name('addr')} on "
                    f"every process. {advice}"
                )
        raise DistributedError(
            f"process {pid} reached the coordinator at {addr or '(chosen by JAX)'} but the job "
            f"did not assemble within {timeout:g} s: not every one of the {n} processes "
            f"({names[0]}) connected, or two processes share {names[1]}={pid}. {advice}"
        )
    error = box.get("error")
    if error is not None:
        raise DistributedError(
            f"jax.distributed.initialize failed for {config.describe()}: "
            f"{type(error).__name__}: {error}"
        ) from error


def _prepare_cpu_collectives() -> None:
    """Cross-process collectives on CPU need gloo (XLA's default CPU collectives are in-process)."""
    import jax

    current = getattr(jax.config, "jax_cpu_collectives_implementation", None)
    if current in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _adopt_jax_state() -> DistributedConfig:
    from jax._src import distributed as jd

    state = jd.global_state
    return DistributedConfig(num_processes=state.num_processes, process_id=state.process_id,
                             coordinator_address=state.coordinator_address,
                             source="jax.distributed")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: int | Sequence[int] | None = None,
    *,
    cluster: str | None = None,
    timeout: float | None = None,
    heartbeat_timeout: float | None = None,
    check_versions: bool = True,
) -> DistributedConfig:
    """Joins this process to a multi-process job; idempotent; a no-op for a single process.

    With no arguments the layout comes from launcher variables (`detect()`): torchrun-style,
    `JAX_*`, SLURM, Open MPI, Kubernetes, Cloud TPU. Arguments override what is detected. It
    validates the layout (rank below world size, world size = nodes x processes per node), makes
    sure process 0's coordinator port is free, sets gloo CPU collectives, connects with a
    deadline, and checks that every process runs the same jaxlight, JAX and Flax versions.

    Args:
        coordinator_address: `host:port` of process 0 (all processes give the same).
        num_processes: processes in the job.
        process_id: this process's index.
        local_device_ids: local devices this process uses (default: all, or one per process
            when a launcher starts several per node).
        cluster: force a `jax.distributed` cluster detection method ("slurm", "ompi",
            "gketpu", "gcetpu", "mpi4py").
        timeout: seconds to wait for every process to connect, and for later agreements;
            default `$JAXLIGHT_TIMEOUT` or 300.
        heartbeat_timeout: seconds after which a silent process counts as dead and ends the
            others; default `$JAXLIGHT_HEARTBEAT_TIMEOUT`, else min(timeout, 100).
        check_versions: compare package versions across processes after connecting.

    Returns:
        The `DistributedConfig` this process runs with (`num_processes == 1` when alone).

    Raises:
        ConfigurationError: inconsistent numbers, a busy port, or a JAX backend that already
            started before this call.
        DistributedError: processes that did not all arrive in time, or that run different
            versions.

    Example:
        >>> import jaxlight as jl
        >>> jl.distributed.initialize().describe()
        'process 0 of 1, from no launcher variables (one process)'
    """
    global _config, _timeout
    import jax

    given = {k: v for k, v in (("coordinator_address", coordinator_address),
                               ("num_processes", num_processes), ("process_id", process_id))
             if v is not None}
    with _lock:
        if _config is not None or jax.distributed.is_initialized():
            if _config is None:
                _config = _adopt_jax_state()
            clash = {k: v for k, v in given.items() if getattr(_config, k) is not None
                     and getattr(_config, k) != v}
            if clash:
                raise ConfigurationError(
                    f"jaxlight.distributed is already initialized as {_config.describe()}; it "
                    f"cannot re-initialize with {clash}. Call initialize() once per process."
                )
            return _config

        timeout = timeout if timeout is not None else (_float_env(ENV_TIMEOUT) or DEFAULT_TIMEOUT)
        if heartbeat_timeout is None:
            heartbeat_timeout = _float_env(ENV_HEARTBEAT) or min(timeout, DEFAULT_HEARTBEAT)
        if timeout <= 0 or heartbeat_timeout <= 0:
            raise ConfigurationError(
                f"timeouts must be positive; got timeout={timeout}, "
                f"heartbeat_timeout={heartbeat_timeout}."
            )
        detected = detect()
        if isinstance(local_device_ids, int):
            local_device_ids = (local_device_ids,)
        if given or cluster is not None or local_device_ids is not None:
            base = detected or DistributedConfig(None, None)
            explicit = len(given) == 3
            config = dataclasses.replace(
                base,
                **given,
                local_device_ids=tuple(local_device_ids) if local_device_ids is not None
                else base.local_device_ids,
                source="explicit" if explicit or detected is None else base.source,
                cluster_detection_method=cluster if cluster is not None else (
                    "deactivate" if explicit else base.cluster_detection_method),
            )
        elif detected is None or not detected.is_multi_process:
            return DistributedConfig(num_processes=1, process_id=0, source=(
                detected.source if detected is not None else "none"))
        else:
            config = detected
        config.validate()
        if config.cluster_detection_method == "deactivate" and None in (
                config.coordinator_address, config.num_processes, config.process_id):
            missing = [k for k in ("coordinator_address", "num_processes", "process_id")
                       if getattr(config, k) is None]
            if config.source == "ompi":
                raise ConfigurationError(
                    "Open MPI variables are set (OMPI_COMM_WORLD_SIZE) but not "
                    "OMPI_MCA_orte_hnp_uri, from which JAX finds the coordinator (Open MPI 5 no "
                    "longer sets it). Pass coordinator_address='host:port' to "
                    "jaxlight.distributed.initialize(), or set JAX_COORDINATOR_ADDRESS=host:port."
                )
            raise ConfigurationError(
                f"jaxlight.distributed.initialize: {', '.join(missing)} not given and no "
                "launcher variables found to fill them in. Pass all three, or start the "
                "processes with `jaxlight launch --nprocs N -- python train.py`."
            )
        if config.coordinator_address is not None:
            host, port = _split_address(config.coordinator_address, config._name("addr"))
            if config.process_id == 0:
                check_port_free(port, f"coordinator port {port} ({config._name('addr')}="
                                      f"{config.coordinator_address})")
            else:
                try:
                    socket.getaddrinfo(host, port)
                except socket.gaierror as err:
                    raise ConfigurationError(
                        f"{config._name('addr')}={config.coordinator_address}: host {host!r} "
                        f"does not resolve ({err.strerror}); give process 0's address."
                    ) from None
        if _backend_started():
            raise ConfigurationError(
                f"this process should join a multi-process job ({config.describe()}), but JAX "
                "has already started its backend (something called jax.devices(), created an "
                "array or ran a computation first), and a started backend cannot join. Call "
                "jaxlight.distributed.initialize() at the top of the script, before any other "
                "JAX call; Fit and data.ArrayLoader call it when they are created first."
            )
        _prepare_cpu_collectives()
        started = time.perf_counter()
        _connect(config, timeout, heartbeat_timeout)
        from jax._src import distributed as jd

        config = dataclasses.replace(
            config, num_processes=jd.global_state.num_processes,
            process_id=jd.global_state.process_id,
            coordinator_address=jd.global_state.coordinator_address)
        _config, _timeout = config, timeout
    logger.info("jaxlight.distributed: %s, connected in %.2f s", config.describe(),
                time.perf_counter() - started)
    if check_versions:
        _check_versions()
    return config


# -- agreement between processes ------------------------------------------------------------------


def _nproc() -> tuple[int, int]:
    """(process count, process index) of the distributed runtime, without starting a backend."""
    from jax._src import distributed as jd

    state = jd.global_state
    if state.client is None:
        return 1, 0
    return state.num_processes, state.process_id


def _client():
    from jax._src import distributed as jd

    client = jd.global_state.client
    if client is None:
        raise DistributedError(
            "this needs JAX's distributed runtime, which is not initialized; call "
            "jaxlight.distributed.initialize() first."
        )
    return client


def all_gather_json(tag: str, value: Any, timeout: float | None = None) -> list[Any]:
    """Every process's `value` (JSON-able), in process order, through the coordinator's store.

    A host-side exchange (no device computation, no compile): for agreeing on small facts such
    as batch shapes or versions. Every process must call it with the same `tag`, in the same
    order, as with any collective. With one process it returns `[value]`.

    Example:
        >>> all_gather_json("batch_size", 16)
        [16]
    """
    nproc, pid = _nproc()
    if nproc == 1:
        return [value]
    client = _client()
    key = f"jaxlight/{tag}/{next(_round)}"
    wait = timeout if timeout is not None else _timeout
    try:
        client.key_value_set(f"{key}/{pid}", json.dumps(value))
        client.wait_at_barrier(key, int(wait * 1000))
        entries = client.key_value_dir_get(f"{key}/")
    except Exception as err:  # the runtime raises its own error types
        raise DistributedError(
            f"process {pid}: exchanging {tag!r} with the other processes failed (waiting at "
            f"most {wait:g} s): a process is missing, died or took another code path. ({err})"
        ) from err
    values = {int(k.rsplit("/", 1)[1]): json.loads(v) for k, v in entries}
    return [values[i] for i in sorted(values)]


def check_same_across_processes(tag: str, value: Any, what: str,
                                error: type[Exception] = DistributedError) -> None:
    """Raises `error` on every process if `value` differs between processes, naming them."""
    values = all_gather_json(tag, value)
    if all(v == values[0] for v in values):
        return
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(json.dumps(v, sort_keys=True), []).append(i)
    listed = "; ".join(f"process{'es' if len(ids) > 1 else ''} "
                       f"{', '.join(map(str, ids))}: {text}" for text, ids in groups.items())
    raise error(f"{what} differs between processes: {listed}.")


def _versions() -> dict[str, str]:
    import flax
    import jax
    import jaxlib
    import optax

    import jaxlight

    return {"jaxlight": jaxlight.__version__, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__}


def _check_versions(versions: Mapping[str, str] | None = None) -> None:
    """Refuses a job whose processes import different package versions (every process raises).

    `versions` replaces this process's report (for tests of the check itself).
    """
    mine = dict(_versions() if versions is None else versions)
    values = all_gather_json("versions", mine)
    differing = sorted({k for v in values for k in v if v.get(k) != values[0].get(k)})
    if not differing:
        return
    rows = "; ".join(f"process {i}: " + ", ".join(f"{k} {v.get(k)}" for k in differing)
                     for i, v in enumerate(values))
    raise DistributedError(
        f"the processes run different versions of {', '.join(differing)} ({rows}). Install "
        "the same versions everywhere (one environment or container image for all nodes): "
        "mixed versions can compile different programs and hang in a collective."
    )


def check_batch_agreement(batch: Any, what: str = "training batch",
                          num_batches: int | None = None) -> None:
    """Refuses per-process batches whose shapes or dtypes differ between processes.

    The global batch is assembled from equal shares; a process feeding more or fewer examples
    than the others would make them compile different programs and wait forever in the first
    collective, and one whose data runs out first leaves the others waiting at the next step.
    Called once, on the first batch, before compiling; `num_batches` is `len(data)` if known.
    """
    import jax
    import numpy as np

    nproc, _ = _nproc()
    if nproc == 1:
        return
    desc = {jax.tree_util.keystr(p): f"{tuple(np.shape(x))} {np.asarray(x).dtype}"
            for p, x in jax.tree_util.tree_leaves_with_path(batch)}
    values = all_gather_json(f"batch:{what}", {"batch": desc, "len": num_batches})
    share = f"global batch size / {nproc} processes"
    if any(v["batch"] != values[0]["batch"] for v in values):
        listed = "; ".join(f"process {i}: " + ", ".join(f"{k or 'batch'} {d}"
                                                         for k, d in v["batch"].items())
                           for i, v in enumerate(values))
        raise DataError(
            f"the per-process {what} differs between processes ({listed}). Every process must "
            f"feed the same number of examples ({share}) with the same shapes; "
            "jaxlight.data.ArrayLoader does this given the global batch size."
        )
    if any(v["len"] != values[0]["len"] for v in values):
        listed = ", ".join(f"process {i}: {v['len']}" for i, v in enumerate(values))
        raise DataError(
            f"the processes' {what} iterables have different lengths ({listed} batches): the "
            "process whose data ends first would leave the others waiting in the next step. "
            "Give every process the same number of batches (jaxlight.data.ArrayLoader does)."
        )


def agree_max(tag: str, value: int) -> int:
    """The largest `value` over all processes (for example a padded evaluation batch size)."""
    return max(all_gather_json(tag, int(value)))


def agree_stop(reason: str | None) -> str | None:
    """Agrees on stopping: returns a reason on every process if any process gave one.

    Host callbacks (early stopping, a time limit, a preemption signal) may decide on one process
    only; every process must leave the loop at the same step or the rest wait forever in the next
    step's collectives. Costs one barrier; only requesting processes write to the store.

    Example:
        >>> agree_stop(None) is None
        True
    """
    nproc, pid = _nproc()
    if nproc == 1:
        return reason
    client = _client()
    key = f"jaxlight/stop/{next(_round)}"
    try:
        if reason is not None:
            client.key_value_set(f"{key}/{pid}", reason)
        client.wait_at_barrier(key, int(_timeout * 1000))
        entries = client.key_value_dir_get(f"{key}/")
    except Exception as err:
        raise DistributedError(
            f"process {pid}: agreeing on whether to stop failed (waiting at most "
            f"{_timeout:g} s): a process is missing, died or took another code path. ({err})"
        ) from err
    if not entries:
        return None
    # An error (a reason starting "error:", which ends the fit with TrainingStopped) wins over a
    # plain stop, so that every process ends the same way; then the lowest process.
    first = min(entries, key=lambda kv: (not kv[1].startswith("error:"),
                                         int(kv[0].rsplit("/", 1)[1])))
    source = int(first[0].rsplit("/", 1)[1])
    return first[1] if source == pid else f"{first[1]} (on process {source})"


def reached_preemption_sync_point(step: int) -> bool:
    """True on every process at the same step once any process received SIGTERM.

    After `jax.distributed.initialize`, JAX catches SIGTERM itself and agrees on a step through
    its coordination service; polling this each step is a local check until then.
    """
    from jax._src import distributed as jd

    if _nproc()[0] == 1 or jd.global_state.preemption_sync_manager is None:
        return False
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


def check_batch_layout(shardings: Any, abstract_batch: Any, what: str = "batch") -> None:
    """Checks that process p's devices hold rows [p*B/P, (p+1)*B/P) of every batch leaf.

    Each process feeds a contiguous share of the global batch (in process order), which is
    right when the mesh's batch axes run over processes in device order. A mesh that
    replicates the batch over processes, or interleaves them, needs a different feeding;
    it is refused here, before compiling, instead of training on misplaced rows.
    """
    import jax

    from jaxlight._errors import ShardingError

    nproc, _ = _nproc()
    if nproc == 1:
        return
    leaves = jax.tree_util.tree_leaves_with_path(abstract_batch)
    shards = jax.tree.leaves(shardings)
    for (path, leaf), sharding in zip(leaves, shards, strict=False):
        rows = int(leaf.shape[0])
        share = rows // nproc
        held: dict[int, set[tuple[int, int]]] = {}
        spec = getattr(sharding, "spec", None)
        if spec is not None and len(spec) != len(leaf.shape):
            continue  # a strategy's own view of the batch (DDP's (devices, B/devices, ...))
        for device, index in sharding.devices_indices_map(tuple(leaf.shape)).items():
            start, stop, _ = index[0].indices(rows)
            held.setdefault(device.process_index, set()).add((start, stop))
        for p in range(nproc):
            spans = sorted(held.get(p, ()))
            lo = min((s for s, _ in spans), default=0)
            hi = max((e for _, e in spans), default=0)
            covered = sum(e - s for s, e in _merge(spans))
            if (lo, hi) != (p * share, (p + 1) * share) or covered != share:
                mesh = getattr(sharding, "mesh", None)
                shape = dict(mesh.shape) if mesh is not None else "?"
                raise ShardingError(
                    f"{what} leaf {jax.tree_util.keystr(path)}: on mesh {shape} the devices of "
                    f"process {p} hold batch rows {_format_spans(spans)} of {rows}, but each "
                    f"process feeds rows [{p * share}, {(p + 1) * share}) (its contiguous 1/"
                    f"{nproc} share). The batch axes (data, fsdp) must span the processes in "
                    "device order: make the data-parallel degree a multiple of the process count "
                    "and keep model axes (tp, pipe) within a process."
                )


def _merge(spans):
    out: list[list[int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _format_spans(spans) -> str:
    merged = _merge(spans)
    return ", ".join(f"[{s}, {e})" for s, e in merged) or "none"
