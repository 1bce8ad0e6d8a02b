"""Strategies: how a fit is laid out over devices.

| name | alias | what it is |
|---|---|---|
| `SingleDevice()` | `"single"` | one device, plain `jax.jit` |
| `DataParallel()` | `"dp"` | SPMD `jax.jit`, batch split over `data`, params replicated |
| `DDP()` | `"ddp"` | classic `jax.pmap`, replicated params, `pmean` of gradients |
| `FSDP()` | `"fsdp"` | params, gradients, optimizer state sharded over `fsdp` (ZeRO-3) |
| `TensorParallel(size)` | `"tp"` | Megatron column/row over `tp` (alias: all devices), `data` |
| `GPipe(stages, microbatches)` | `"gpipe"` | stacked layers in stages over `pipe`, GPipe schedule |
| `Hybrid(mesh_shape)` | — | any product of `data`, `fsdp`, `tp`, `pipe` |
| `Auto(...)` | `"auto"` | compiles candidate layouts, picks the fastest predicted that fits |

`"auto"` (Fit's default) is `Auto()`: SingleDevice on one device; DataParallel, without
compiling anything, when the model's parameters, optimizer state and batch take at most 1% of a
device's memory; otherwise the search described in `Auto` (docs/strategies.md).

`strategies.rules` holds ready-made path rules for stock Flax NNX layers
(`rules=strategies.rules.NNX`), so models without annotations shard by parameter name.

May import `step` (microbatch scans), `nn`'s building blocks, `sharding`, `analysis`,
`distributed` and the root modules (layer 11 of docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable

from jaxlight._errors import ConfigurationError, suggest
from jaxlight.strategies import rules
from jaxlight.strategies._auto import Auto
from jaxlight.strategies._auto_choice import AutoChoice
from jaxlight.strategies._base import Strategy
from jaxlight.strategies._ddp import DDP
from jaxlight.strategies._gpipe import GPipe
from jaxlight.strategies._mpmd import MpmdGPipe
from jaxlight.strategies._roofline import DEVICE_TABLE, DeviceSpec
from jaxlight.strategies._rules import DEFAULT_RULES
from jaxlight.strategies._sharded import FSDP, Hybrid, TensorParallel
from jaxlight.strategies._spmd import DataParallel, SingleDevice, SpmdStrategy

__all__ = [
    "ALIASES",
    "DDP",
    "DEFAULT_RULES",
    "DEVICE_TABLE",
    "Auto",
    "AutoChoice",
    "DeviceSpec",
    "FSDP",
    "DataParallel",
    "GPipe",
    "MpmdGPipe",
    "Hybrid",
    "SingleDevice",
    "SpmdStrategy",
    "Strategy",
    "TensorParallel",
    "resolve",
    "rules",
]


#: The one visible table of string aliases. Each value builds a fresh strategy.
ALIASES: dict[str, Callable[[], Strategy]] = {
    "auto": Auto,
    "single": SingleDevice,
    "dp": DataParallel,
    "ddp": DDP,
    "fsdp": FSDP,
    "tp": TensorParallel,
    "gpipe": GPipe,
}


def resolve(strategy: str | Strategy) -> Strategy:
    """Returns a Strategy for an alias or passes a Strategy instance through."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str):
        key = strategy.lower()
        if key in ALIASES:
            return ALIASES[key]()
        raise ConfigurationError(
            f"unknown strategy {strategy!r}; valid names are {sorted(ALIASES)}, or pass a "
            f"jaxlight.strategies object.{suggest(key, ALIASES)}"
        )
    raise ConfigurationError(
        f"strategy must be a name {sorted(ALIASES)} or a jaxlight.strategies.Strategy, got "
        f"{type(strategy).__name__}."
    )
