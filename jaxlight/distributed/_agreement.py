"""Agreement between the processes of a job: small host-side exchanges through JAX's
coordination service (no device computation), stop decisions, version and device checks."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jaxlib
import optax
from jax._src import distributed as jd
from jax.experimental import multihost_utils

from jaxlight._errors import DistributedError
from jaxlight.distributed._environment import DEFAULT_TIMEOUT

_round = itertools.count()
#: Seconds a collective agreement waits for every process; `initialize(timeout=...)` sets it.
_settings = {"timeout": DEFAULT_TIMEOUT}


def set_timeout(seconds: float) -> None:
    """Sets how long later agreements wait for every process (called by `initialize`)."""
    _settings["timeout"] = float(seconds)


def process_count_and_index() -> tuple[int, int]:
    """(process count, process index) of the distributed runtime, without starting a backend."""
    state = jd.global_state
    if state.client is None:
        return 1, 0
    return state.num_processes, state.process_id


def _client():
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
    nproc, pid = process_count_and_index()
    if nproc == 1:
        return [value]
    client = _client()
    key = f"jaxlight/{tag}/{next(_round)}"
    wait = timeout if timeout is not None else _settings["timeout"]
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


def package_versions() -> dict[str, str]:
    # The parent package is always imported before its subpackage is used.
    return {"jaxlight": sys.modules["jaxlight"].__version__, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "optax": optax.__version__}


def check_versions(versions: Mapping[str, str] | None = None) -> None:
    """Refuses a job whose processes import different package versions (every process raises).

    `versions` replaces this process's report (for tests of the check itself).
    """
    mine = dict(package_versions() if versions is None else versions)
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


def local_devices_report() -> dict[str, Any]:
    """This process's devices as the job compares them: platform, kinds and count."""
    devices = jax.local_devices()
    kinds: dict[str, int] = {}
    for d in devices:
        kinds[d.device_kind] = kinds.get(d.device_kind, 0) + 1
    return {"platform": devices[0].platform, "kinds": kinds, "count": len(devices)}


def _describe_report(report: Mapping[str, Any]) -> str:
    kinds = ", ".join(f"{n} x {kind}" for kind, n in sorted(report["kinds"].items()))
    n = report["count"]
    return f"{n} {report['platform']} device{'s' if n != 1 else ''} ({kinds})"


def check_devices(report: Mapping[str, Any] | None = None) -> None:
    """Refuses a job whose processes hold different device kinds or counts (every process
    raises, with the list). Starts JAX's backend.

    A mesh spans every process's devices as one grid: one kind and one count per process is
    what its shardings, the data split per process and compiled programs assume.
    `report` replaces this process's `local_devices_report()` (for tests of the check itself).
    """
    if process_count_and_index()[0] == 1:
        return  # nothing to compare, and one process need not start its backend here
    mine = dict(local_devices_report() if report is None else report)
    values = all_gather_json("devices", mine)
    if all(v == values[0] for v in values):
        return
    groups: dict[str, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(_describe_report(v), []).append(i)
    listed = "; ".join(f"process{'es' if len(ids) > 1 else ''} {', '.join(map(str, ids))}: "
                       f"{text}" for text, ids in groups.items())
    raise DistributedError(
        f"the processes of this job hold different devices, so the devices are not "
        f"homogeneous ({listed}). jaxlight needs the same device kind and the same number of "
        "devices on every process: start one process per node with the same accelerators "
        "visible (CUDA_VISIBLE_DEVICES, --devices or XLA_FLAGS alike everywhere)."
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
    nproc, pid = process_count_and_index()
    if nproc == 1:
        return reason
    client = _client()
    key = f"jaxlight/stop/{next(_round)}"
    try:
        if reason is not None:
            client.key_value_set(f"{key}/{pid}", reason)
        client.wait_at_barrier(key, int(_settings["timeout"] * 1000))
        entries = client.key_value_dir_get(f"{key}/")
    except Exception as err:
        raise DistributedError(
            f"process {pid}: agreeing on whether to stop failed (waiting at most "
            f"{_settings['timeout']:g} s): a process is missing, died or took another code "
            f"path. ({err})"
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
    if process_count_and_index()[0] == 1 or jd.global_state.preemption_sync_manager is None:
        return False
    return bool(multihost_utils.reached_preemption_sync_point(step))

