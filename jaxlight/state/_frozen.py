"""Frozen parameters: the `nnx.Param` leaves of `TrainState.rest`, which a module does not train.

A module whose `trainable` selects only some parameters (the sft recipe's LoRA sets
`trainable = nnx.LoRAParam`) carries the others, its base weights, unchanged in `rest`.
Checkpoints leave them out: they come from `configure_model` (a pretrained checkpoint, in-process
pretraining, or a seeded initialization), which rebuilds them on restore. So that a restore
never silently combines the trained adapters with other base weights, a checkpoint's meta record
holds the shape, dtype and a 32-bit fingerprint of every frozen parameter, and the rebuilt ones
must match.

`mask` below is `ModelSpec.frozen` (`_state.frozen_mask`): a pure dict shaped like `rest` with
True at the frozen parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from jaxlight._errors import CheckpointError
from jaxlight.distributed._devices import device_groups
from jaxlight.state._state import build_model, split_model

_SKIP = object()


def has_frozen(mask: Any) -> bool:
    """Whether `rest` holds any frozen parameter (never for a module training every Param)."""
    return mask is not None and any(jax.tree.leaves(mask))


def select(tree: Any, mask: Any, frozen: bool) -> Any:
    """The leaves of the `rest`-shaped `tree` whose mask equals `frozen`, as nested dicts
    without empty branches (so plain orbax readers see no skeleton of the skipped weights)."""

    def one(t, m):
        if isinstance(m, Mapping):
            out = {}
            for k, sub_mask in m.items():
                sub = one(t[k], sub_mask)
                if sub is not _SKIP:
                    out[k] = sub
            return out if out or not m else _SKIP
        return t if bool(m) == frozen else _SKIP

    out = one(tree, mask)
    return {} if out is _SKIP else out


def join(mask: Any, kept: Any, frozen: Any) -> Any:
    """Inverse of `select`: the whole `rest`, frozen leaves from `frozen`, others from `kept`."""
    if isinstance(mask, Mapping):
        return {k: join(m, _child(kept, k), _child(frozen, k)) for k, m in mask.items()}
    return frozen if mask else kept


def _child(tree: Any, key: Any) -> Any:
    return tree[key] if isinstance(tree, Mapping) and key in tree else None


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """sum_i bits(x_i) * w_i mod 2**32 with odd weights w_i: any single changed element changes
    it, integer addition makes it independent of the sharding, and it needs no reshape (which
    could gather a sharded array)."""
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if x.dtype == jnp.bool_:
        u = x.astype(jnp.uint32)
    elif bits is None:  # 64-bit (x64 mode) or packed types: fold through float32's bits
        u = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    else:
        u = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, axis) * np.uint32(
            stride % 2**32)
        stride *= x.shape[axis]
    weight = index * np.uint32(0x9E3779B1) | np.uint32(1)
    return jnp.sum(u * weight, dtype=jnp.uint32)


_fingerprint_list = jax.jit(lambda leaves: [_leaf_fingerprint(x) for x in leaves])


def _fingerprints(tree: Any) -> Any:
    """Every leaf's fingerprint, one jitted call per group of leaves on the same devices."""
    leaves, treedef = jax.tree.flatten(tree)
    out = [None] * len(leaves)
    for group in device_groups(leaves).values():
        for i, h in zip(group, _fingerprint_list([leaves[i] for i in group]), strict=True):
            out[i] = h
    return jax.tree.unflatten(treedef, out)


def _host_scalar(x: jax.Array) -> int:
    if getattr(x, "is_fully_addressable", True):
        return int(np.asarray(x))
    if x.is_fully_replicated:
        return int(np.asarray(x.addressable_data(0)))
    return int(np.asarray(multihost_utils.process_allgather(x)))


def records(frozen: Any) -> dict[str, dict]:
    """Per frozen parameter (`['rest']...` path): shape, dtype and fingerprint, JSON-ready."""
    prints = jax.tree_util.tree_flatten_with_path(_fingerprints(frozen))[0]
    leaves = jax.tree.leaves(frozen)
    return {
        "['rest']" + jax.tree_util.keystr(path): {
            "shape": list(x.shape), "dtype": str(x.dtype), "fingerprint": _host_scalar(h)}
        for (path, h), x in zip(prints, leaves, strict=True)
    }


def build(module, seed: int, mask: Any, shardings: Any, strategy) -> Any:
    """The frozen parameters as `configure_model` makes them, created in `shardings`."""
    def frozen_only():
        _, _, rest = split_model(build_model(module, seed), module.trainable)
        return select(rest, mask, True)  # XLA drops the computation of everything else

    return strategy.create(frozen_only, shardings)


def check(step_dir: str, recorded: dict | None, rebuilt: dict, module, seed: int) -> None:
    """Refuses rebuilt frozen parameters that differ from those the checkpoint was trained
    with, naming them."""
    if recorded is None:
        raise CheckpointError(
            f"checkpoint {step_dir} has no record of the frozen parameters that "
            f"{type(module).__name__} keeps outside module.trainable={module.trainable!r} "
            "(meta.frozen_params): it was written by a module that trains every parameter. "
            "Load it with a module of the same configuration as the one that wrote it."
        )
    lines = []
    for path in sorted(set(recorded) | set(rebuilt)):
        was, now = recorded.get(path), rebuilt.get(path)
        if was is None:
            lines.append(f"{path} {tuple(now['shape'])}: not frozen in the checkpoint's model")
        elif now is None:
            lines.append(f"{path} {tuple(was['shape'])}: frozen in the checkpoint's model, "
                         "not in this one")
        elif (was["shape"], was["dtype"]) != (now["shape"], now["dtype"]):
            lines.append(f"{path}: checkpoint {tuple(was['shape'])} {was['dtype']} vs model "
                         f"{tuple(now['shape'])} {now['dtype']}")
        elif was["fingerprint"] != now["fingerprint"]:
            lines.append(f"{path} {tuple(now['shape'])}: other values")
    if not lines:
        return
    shown = lines[:8] + ([f"... and {len(lines) - 8} more"] if len(lines) > 8 else [])
    raise CheckpointError(
        f"checkpoint {step_dir} was trained on other frozen parameters than "
        f"{type(module).__name__}.configure_model (seed {seed}) builds now. A module with "
        f"trainable={module.trainable!r} checkpoints only what it trains; its frozen "
        f"parameters (base weights) come from configure_model and must be the same bits. "
        f"{len(lines)} differ:\n  " + "\n  ".join(shown)
        + "\nBuild the module from the same base weights the checkpoint was trained on (the "
        "same pretrained checkpoint, pretraining settings and seed; for the sft recipe the "
        "same --base.checkpoint or --base.pretrain_steps)."
    )
