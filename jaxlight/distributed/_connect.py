"""Connecting this process to a multi-process job with a deadline and clear errors."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import jax
from jax._src import distributed as jd
from jax._src import xla_bridge

from jaxlight._errors import ConfigurationError, DistributedError
from jaxlight.distributed import _agreement
from jaxlight.distributed._environment import (
    DEFAULT_HEARTBEAT,
    DEFAULT_TIMEOUT,
    ENV_HEARTBEAT,
    ENV_TIMEOUT,
    DistributedConfig,
    detect,
    split_address,
)

logger = logging.getLogger("jaxlight.distributed")

_lock = threading.Lock()
_config: DistributedConfig | None = None


def is_initialized() -> bool:
    """True once this process has joined a multi-process job (through jaxlight or JAX)."""
    return _config is not None or jax.distributed.is_initialized()


def process_index() -> int:
    """This process's index, joining a launched job first if the environment describes one."""
    initialize()
    return jax.process_index()


def process_count() -> int:
    """The number of processes, joining a launched job first if the environment describes one."""
    initialize()
    return jax.process_count()


def _backend_started() -> bool:
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
            host, port = split_address(addr)
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
    current = getattr(jax.config, "jax_cpu_collectives_implementation", None)
    if current in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _adopt_jax_state() -> DistributedConfig:
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
        check_versions: compare package versions, device kinds and device counts across
            processes after connecting.

    Returns:
        The `DistributedConfig` this process runs with (`num_processes == 1` when alone).

    Raises:
        ConfigurationError: inconsistent numbers, a busy port, or a JAX backend that already
            started before this call.
        DistributedError: processes that did not all arrive in time, that run different
            versions, or that hold different device kinds or counts.

    Example:
        >>> import jaxlight as jl
        >>> jl.distributed.initialize().describe()
        'process 0 of 1, from no launcher variables (one process)'
    """
    global _config
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
            host, port = split_address(config.coordinator_address, config._name("addr"))
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
        config = dataclasses.replace(
            config, num_processes=jd.global_state.num_processes,
            process_id=jd.global_state.process_id,
            coordinator_address=jd.global_state.coordinator_address)
        _config = config
        _agreement.set_timeout(timeout)
    logger.info("jaxlight.distributed: %s, connected in %.2f s", config.describe(),
                time.perf_counter() - started)
    if check_versions:
        _agreement.check_versions()
        _agreement.check_devices()  # starts the backend, now that the job is joined
    return config

