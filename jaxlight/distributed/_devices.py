"""`Fit(devices=...)`: which of the visible devices a fit uses (Lightning's `devices=`).

The selection happens before the strategy builds its mesh, so every strategy sees only the
chosen devices (their number sets the mesh); the other devices stay idle: they hold no array
and run no program of this fit. As in Lightning, the choice is per process: `devices=2` on a
job of 2 processes with 8 devices each uses 4 devices, the first 2 of each process.

| `devices=` | uses |
|---|---|
| `None`, `"auto"`, `-1` | every device |
| `N` (int) | the first N devices of each process |
| `[i, j, ...]` (ints) | the devices at these positions in each process's `jax.local_devices()` |
| `[jax.Device, ...]` | exactly these devices |
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxlight._errors import ConfigurationError

ALL = (None, "auto", -1)


def _local_of(process: int) -> list[jax.Device]:
    return sorted((d for d in jax.devices() if d.process_index == process), key=lambda d: d.id)


def _describe(local: list[jax.Device]) -> str:
    platform = local[0].platform if local else "?"
    return f"{len(local)} {platform} device{'s' if len(local) != 1 else ''}"


def _repeated_devices(devices: Sequence, local: list) -> str:
    """The message for a device list naming a device twice, with what to pass instead."""
    given = list(devices)
    shown = [d if isinstance(d, int) else d.id for d in given]
    repeated = sorted({d for d in shown if shown.count(d) > 1})
    distinct = list(dict.fromkeys(shown))
    wanted = len(given)
    more = (f" For {wanted} devices, pass devices={wanted} (the first {wanted}) or "
            f"{wanted} different indices, e.g. devices={list(range(wanted))}."
            if wanted <= len(local) else
            f" This process has {len(local)} devices, so at most devices={len(local)}.")
    return (f"Fit(devices={shown}) names a device more than once (device "
            f"{', '.join(map(str, repeated))}); "
            f"each device holds one share of the mesh, so a list names each device once. Pass "
            f"devices={distinct} to use {'it' if len(distinct) == 1 else 'them'} once each."
            + more)


def select_devices(devices: Any) -> list[jax.Device] | None:
    """The devices a fit uses, in mesh order; None means every device.

    Raises:
        ConfigurationError: naming the request, the devices this process has, and valid values.
    """
    if devices is None or (isinstance(devices, str) and devices == "auto") or (
            isinstance(devices, int) and not isinstance(devices, bool) and devices == -1):
        return None
    local = _local_of(jax.process_index())
    per_process = ("" if jax.process_count() == 1
                   else f" per process ({jax.process_count()} processes)")
    if isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ConfigurationError(
                f"Fit(devices={devices}): give a positive number of devices (1 to "
                f"{len(local)}), a list of device indices, or 'auto' / -1 for all."
            )
        if devices > len(local):
            raise ConfigurationError(
                f"Fit(devices={devices}) asks for {devices} devices{per_process}, but this "
                f"process has {_describe(local)} (ids {[d.id for d in local]}). Pass "
                f"devices <= {len(local)}, or 'auto' for all of them."
            )
        return [d for p in range(jax.process_count()) for d in _local_of(p)[:devices]]
    if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices:
        raise ConfigurationError(
            f"Fit(devices={devices!r}): give a number of devices (1 to {len(local)}), a "
            "non-empty list of device indices or jax.Device objects, or 'auto' for all."
        )
    if all(isinstance(d, jax.Device) for d in devices):
        chosen = list(devices)
        unknown = [d for d in chosen if d not in jax.devices()]
        if unknown:
            raise ConfigurationError(
                f"Fit(devices=...) names {unknown}, which JAX does not list in jax.devices()."
            )
    elif all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
        bad = [i for i in devices if not 0 <= i < len(local)]
        if bad:
            raise ConfigurationError(
                f"Fit(devices={list(devices)}): indices {bad} are out of range; this process "
                f"has {_describe(local)}, indices 0 to {len(local) - 1}{per_process}."
            )
        chosen = [_local_of(p)[i] for p in range(jax.process_count()) for i in devices]
    else:
        kinds = sorted({type(d).__name__ for d in devices})
        raise ConfigurationError(
            f"Fit(devices=...) got a list of {kinds}; give device indices (ints) or "
            "jax.Device objects, not a mix."
        )
    if len(set(chosen)) != len(chosen):
        raise ConfigurationError(_repeated_devices(devices, local))
    if jax.process_count() > 1:
        counts = {p: sum(d.process_index == p for d in chosen)
                  for p in range(jax.process_count())}
        if len(set(counts.values())) != 1:
            raise ConfigurationError(
                f"Fit(devices=...) uses {counts} devices per process; every process must use "
                "the same number (the batch is split evenly over processes)."
            )
    return chosen


def check_strategy_devices(strategy: Any, chosen: list[jax.Device] | None) -> None:
    """Refuses `Fit(devices=...)` together with a strategy built on other devices."""
    if chosen is None:
        return
    if strategy.name == "single" and len(chosen) > 1:
        raise ConfigurationError(
            f"Fit(devices=...) selects {len(chosen)} devices, but the strategy is SingleDevice, "
            "which uses one: pass devices=1 (or a list of one index), or a strategy that "
            "spreads over several ('dp', 'ddp', 'fsdp', 'auto')."
        )
    own = strategy.requested_devices
    if own is None:
        return
    if list(own) != list(chosen):
        raise ConfigurationError(
            f"Fit(devices=...) selects devices {[d.id for d in chosen]}, but the strategy "
            f"{type(strategy).__name__} was built with devices {[d.id for d in own]}; choose "
            "the devices in one place."
        )


def device_groups(leaves: Sequence[Any]) -> dict[frozenset | None, list[int]]:
    """Indices of `leaves` by the devices their arrays live on (the key), for helpers that run
    one jitted call over a tree: one group when every array shares a mesh (each SPMD
    strategy), one per device under `GPipe(mpmd=True)`, whose stages' arrays sit on their own
    devices (a jitted call cannot take arrays of different devices). Non-arrays join the first
    group (key None when there is no array)."""
    groups: dict = {}
    loose = []
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array):
            groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
        else:
            loose.append(i)
    if not groups:
        return {None: loose}
    first = next(iter(groups))
    groups[first] = sorted(groups[first] + loose)
    return groups
