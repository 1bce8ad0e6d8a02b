"""Checkpoint format: what a jaxlight checkpoint holds, and the trees and records written.

The checkpoint modules: `_format` (this: layout, tree conversions, the meta record), `_paths`
(finding and resolving checkpoints), `_writer` (saving with retention) and `_restore`
(restoring a fit's state, `load_checkpoint`).

On-disk layout (docs/checkpoints.md): a checkpoint directory holds one subdirectory per saved
step, written by an orbax `CheckpointManager` (each process writes its own shards; process 0
coordinates). A step directory is complete once orbax has renamed it from
`<step>.orbax-checkpoint-tmp` to `<step>`:

    <dirpath>/<step>/state/     the train state in canonical layout (orbax PyTreeSave, the
                                format StandardSave writes; zstd only with compress=True):
                                {"step", "params", "opt_state", "rest"}; PRNG keys as key data;
                                `rest` without frozen parameters (see `_frozen`: a LoRA
                                module's base weights are rebuilt by configure_model)
    <dirpath>/<step>/meta/      JSON (orbax JsonSave): step, epoch, batch index, loader position,
                                callbacks' states, hyperparameters, monitored value, key impls,
                                the DataModule's state_dict() (under "datamodule", if any)
    <dirpath>/<step>/metrics/   JSON {monitor: value} when ModelCheckpoint has a monitor
    <dirpath>/<step>/checksums/ JSON: a digest of every array in `state` (see `_verify`),
                                checked on every restore; a damaged newest step makes
                                `ckpt_path="last"` fall back to an older one

The state is saved as every strategy sees it (`strategy.to_canonical`), so a checkpoint written
under one strategy restores under any other: each process reads only the shards its target
sharding needs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jaxlight._version import __version__
from jaxlight.data._datamodule import META_KEY, datamodule_state
from jaxlight.hparams import _hparams
from jaxlight.state._state import TrainState

#: Lightning's checkpoint key for the module's hyperparameters (jaxlight's record: "hparams").
HPARAMS_ALIAS = "hyper_parameters"
#: Version of the `meta` record; bumped when its meaning changes.
FORMAT_VERSION = 1
STATE_ITEM = "state"
META_ITEM = "meta"
#: Where checkpoints go when no ModelCheckpoint names a directory (preemption, ckpt_path="last").
DEFAULT_SUBDIR = "checkpoints"
TMP_MARK = ".orbax-checkpoint-tmp"


def ocp():
    """`orbax.checkpoint`, imported on first use."""
    # Import time: orbax pulls in tensorstore (about a second); only checkpointing needs it.
    import orbax.checkpoint

    return orbax.checkpoint


def is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


# -- pytree helpers ------------------------------------------------------------------------------


def is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def state_tree(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "rest": state.rest}


def unwrap_keys(tree: Any) -> tuple[Any, dict[str, str]]:
    """Typed PRNG key arrays become their uint32 key data (plain orbax reads them)."""
    impls: dict[str, str] = {}

    def one(path, x):
        if not is_key(x):
            return x
        impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
        return jax.random.key_data(x)

    return jax.tree_util.tree_map_with_path(one, tree), impls


def abstract_key_data(tree: Any) -> Any:
    """The restore target of key leaves: their key data, with the key's sharding."""

    def one(x):
        if not is_key(x):
            return x
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def wrap_keys(tree: Any, abstract: Any, recorded: dict[str, str]) -> Any:
    """Inverse of `unwrap_keys`: the target model's key implementation, else the recorded one."""

    def one(path, x, a):
        if not is_key(a):
            return x
        impl = getattr(getattr(a.dtype, "_impl", None), "name", None)
        return jax.random.wrap_key_data(x, impl=impl or recorded[jax.tree_util.keystr(path)])

    return jax.tree_util.tree_map_with_path(one, tree, abstract)


def normalized(tree: Any) -> Any:
    """Namedtuples as dicts, tuples as lists, empty namedtuples as None: orbax's metadata form."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        if not tree._fields:
            return None
        return {f: normalized(getattr(tree, f)) for f in tree._fields}
    if isinstance(tree, tuple | list):
        return [normalized(x) for x in tree]
    if isinstance(tree, Mapping) and not hasattr(tree, "shape"):
        # orbax stores every key as a string (nnx.List gives int keys).
        return {str(k): normalized(v) for k, v in tree.items()}
    return tree


def shapes_by_path(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        normalized(tree), is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    )[0]
    return {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves
            if hasattr(x, "shape")}


def jsonable(obj: Any) -> Any:
    """A JSON-safe copy (numpy scalars to numbers, unknown objects to their repr)."""

    def default(o):
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray | jax.Array):
            return np.asarray(o).tolist()
        if isinstance(o, set | frozenset | tuple):
            return list(o)
        return repr(o)

    return json.loads(json.dumps(obj, default=default))


# -- the meta record ----------------------------------------------------------------------------


def build_meta(fit, module, key_impls: dict[str, str], monitor: dict | None,
               frozen: dict | None = None) -> dict:
    feed = fit.train_feed
    # The position after the last trained batch (prefetching reads ahead of it); None outside
    # fit (a checkpoint saved by validate/test has no data position).
    loader = feed.state() if feed is not None else None
    callbacks = {}
    for cb in fit.callbacks:
        state = cb.state_dict()
        if state:
            callbacks[cb.state_key] = state
    meta = {
        "format": FORMAT_VERSION,
        "step": int(fit.global_step),
        "global_step": int(fit.global_step),  # Lightning's name, which hooks read
        "epoch": int(fit.current_epoch),
        "batch_idx": int(fit.batch_idx),
        "loader": loader,
        "callbacks": callbacks,
        "monitor": monitor,
        "prng_keys": key_impls,
        "module": f"{type(module).__module__}.{type(module).__qualname__}",
        "hparams": module.hparams,
        "fit": fit.config,
        "strategy": fit.strategy.describe(),
        "process_count": jax.process_count(),
        "versions": {"jax": jax.__version__, "jaxlight": __version__},
        "time": time.time(),
    }
    datamodule = getattr(fit, "datamodule", None)
    if datamodule is not None:  # only fits with a DataModule: others' records unchanged
        meta[META_KEY] = datamodule_state(datamodule)
    if frozen is not None:  # only for modules with frozen parameters: others' records unchanged
        meta["frozen_params"] = frozen
    lossy = _hparams.unrestorable(module.hparams)
    if lossy:  # kept as text only: rebuilding the module from the record needs them given again
        meta["hparams_unrestorable"] = lossy
    # Lightning's name for the hyperparameters, while the hooks run (one record is stored;
    # `read_meta` gives it back under both names).
    meta[HPARAMS_ALIAS] = meta["hparams"]
    for cb in fit.callbacks:
        cb.on_save_checkpoint(fit, module, meta)
    module.on_save_checkpoint(meta)  # after the callbacks, as Lightning
    meta["hparams"] = meta.pop(HPARAMS_ALIAS)
    return jsonable(meta)


