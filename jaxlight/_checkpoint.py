"""Checkpoints on orbax-checkpoint: what is saved, where, and how a fit resumes from it.

On-disk layout (docs/checkpoints.md): a checkpoint directory holds one subdirectory per saved
step, written by an orbax `CheckpointManager` (each process writes its own shards; process 0
coordinates). A step directory is complete once orbax has renamed it from
`<step>.orbax-checkpoint-tmp` to `<step>`:

    <dirpath>/<step>/state/     the train state in canonical layout (orbax StandardSave):
                                {"step", "params", "opt_state", "rest"}; PRNG keys as key data;
                                `rest` without frozen parameters (see `_frozen`: a LoRA
                                module's base weights are rebuilt by configure_model)
    <dirpath>/<step>/meta/      JSON (orbax JsonSave): step, epoch, batch index, loader position,
                                callbacks' states, hyperparameters, monitored value, key impls
    <dirpath>/<step>/metrics/   JSON {monitor: value} when ModelCheckpoint has a monitor
    <dirpath>/<step>/checksums/ JSON: a digest of every array in `state` (see `_verify`),
                                checked on every restore; a damaged newest step makes
                                `ckpt_path="last"` fall back to an older one

The state is saved as every strategy sees it (`strategy.to_canonical`), so a checkpoint written
under one strategy restores under any other: each process reads only the shards its target
sharding needs.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlight import _frozen, _hparams, _verify
from jaxlight._errors import CheckpointError
from jaxlight._state import TrainState, _logical_names, abstract_model, frozen_mask

#: Version of the `meta` record; bumped when its meaning changes.
FORMAT_VERSION = 1
STATE_ITEM = "state"
META_ITEM = "meta"
#: Where checkpoints go when no ModelCheckpoint names a directory (preemption, ckpt_path="last").
DEFAULT_SUBDIR = "checkpoints"
_TMP_MARK = ".orbax-checkpoint-tmp"


def _ocp():
    # orbax pulls in tensorstore; import it only when checkpoints are used.
    import orbax.checkpoint as ocp

    return ocp


# -- pytree helpers ------------------------------------------------------------------------------


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _state_tree(state: TrainState) -> dict:
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "rest": state.rest}


def _unwrap_keys(tree: Any) -> tuple[Any, dict[str, str]]:
    """Typed PRNG key arrays become their uint32 key data (plain orbax reads them)."""
    impls: dict[str, str] = {}

    def one(path, x):
        if not _is_key(x):
            return x
        impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
        return jax.random.key_data(x)

    return jax.tree_util.tree_map_with_path(one, tree), impls


def _abstract_key_data(tree: Any) -> Any:
    """The restore target of key leaves: their key data, with the key's sharding."""

    def one(x):
        if not _is_key(x):
            return x
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def _wrap_keys(tree: Any, abstract: Any, recorded: dict[str, str]) -> Any:
    """Inverse of `_unwrap_keys`: the target model's key implementation, else the recorded one."""

    def one(path, x, a):
        if not _is_key(a):
            return x
        impl = getattr(getattr(a.dtype, "_impl", None), "name", None)
        return jax.random.wrap_key_data(x, impl=impl or recorded[jax.tree_util.keystr(path)])

    return jax.tree_util.tree_map_with_path(one, tree, abstract)


def _normalized(tree: Any) -> Any:
    """Namedtuples as dicts, tuples as lists, empty namedtuples as None: orbax's metadata form."""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        if not tree._fields:
            return None
        return {f: _normalized(getattr(tree, f)) for f in tree._fields}
    if isinstance(tree, tuple | list):
        return [_normalized(x) for x in tree]
    if isinstance(tree, Mapping) and not hasattr(tree, "shape"):
        # orbax stores every key as a string (nnx.List gives int keys).
        return {str(k): _normalized(v) for k, v in tree.items()}
    return tree


def _shapes_by_path(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        _normalized(tree), is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype")
    )[0]
    return {jax.tree_util.keystr(p): (tuple(x.shape), str(x.dtype)) for p, x in leaves
            if hasattr(x, "shape")}


def _jsonable(obj: Any) -> Any:
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


# -- retention -----------------------------------------------------------------------------------


def is_finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


@dataclasses.dataclass
class Retention:
    """Which checkpoints orbax keeps: the best `top_k` by a finite monitored value (or the latest
    `top_k` without a monitor), the newest one when `keep_last`, and `pinned` steps.

    An orbax `PreservationPolicy`: orbax deletes the others only after the newest save has
    committed, so a failed or interrupted save never deletes anything.
    """

    monitor: str | None = None
    mode: str = "min"
    top_k: int = 1
    keep_last: bool = True
    pinned: set = dataclasses.field(default_factory=set)

    def value(self, info) -> float | None:
        metrics = getattr(info, "metrics", None) or {}
        v = metrics.get(self.monitor) if self.monitor else None
        return float(v) if is_finite(v) else None

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any = None) -> list[bool]:
        del context
        n = len(checkpoints)
        keep = [info.step in self.pinned for info in checkpoints]
        if not n:
            return keep
        if self.top_k < 0:  # keep all, scored or not (a save before the monitor was logged too)
            return [True] * n
        if self.keep_last:
            keep[max(range(n), key=lambda i: checkpoints[i].step)] = True
        if self.monitor is None:
            ranked = sorted(range(n), key=lambda i: -checkpoints[i].step)
        else:
            scored = [i for i in range(n) if self.value(checkpoints[i]) is not None]
            sign = 1.0 if self.mode == "min" else -1.0
            # Best first; among equal values the newer checkpoint wins.
            ranked = sorted(scored, key=lambda i: (sign * self.value(checkpoints[i]),
                                                   -checkpoints[i].step))
        chosen = ranked if self.top_k < 0 else ranked[: self.top_k]
        for i in chosen:
            keep[i] = True
        return keep


# -- finding checkpoints ----------------------------------------------------------------------


def complete_steps(root: str) -> list[int]:
    """Steps under `root` whose save committed (orbax renames the temporary directory last)."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.isdigit() and os.path.isdir(path) and os.path.isdir(os.path.join(path, STATE_ITEM)):
            steps.append(int(name))
    return sorted(steps)


def _incomplete(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if _TMP_MARK in n) if os.path.isdir(root) else []


def _is_step_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, STATE_ITEM)) and os.path.isdir(
        os.path.join(path, META_ITEM))


def read_meta(step_dir: str) -> dict:
    ocp = _ocp()
    try:
        return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
            os.path.join(step_dir, META_ITEM))
    except Exception as exc:  # noqa: BLE001 - re-raised with the path and what to do
        raise _verify.DamagedCheckpoint(
            f"cannot read the checkpoint record {os.path.join(step_dir, META_ITEM)}: {exc}. "
            "Is this a jaxlight checkpoint step directory (<dirpath>/<step>)?"
        ) from exc


def default_dirpath(fit) -> str:
    """`<default_root_dir>/checkpoints` as an absolute path (orbax refuses relative ones; a
    relative root is the folder the run was started from)."""
    return os.path.abspath(os.path.join(fit.default_root_dir, DEFAULT_SUBDIR))


def _checkpoint_dirs(fit) -> list[tuple[str, Any]]:
    """(directory, ModelCheckpoint or None) for every place this fit writes checkpoints."""
    from jaxlight.callbacks._checkpoint import ModelCheckpoint

    found = [(os.path.abspath(cb.resolved_dirpath(fit)), cb) for cb in fit.callbacks
             if isinstance(cb, ModelCheckpoint)]
    return found or [(default_dirpath(fit), None)]


def _best_in(root: str, fallback_mode: str | None) -> tuple[float, int] | None:
    best = None
    for step in complete_steps(root):
        record = read_meta(os.path.join(root, str(step))).get("monitor") or {}
        value, mode = record.get("value"), record.get("mode", fallback_mode)
        if not is_finite(value) or mode not in ("min", "max"):
            continue
        key = value if mode == "min" else -value
        if best is None or key < best[0] or (key == best[0] and step > best[1]):
            best = (key, step)
    return best


def resolve_checkpoint(fit, ckpt_path: str | os.PathLike) -> str | None:
    """The step directory `ckpt_path` names; None for "last" when nothing was saved yet.

    Accepts "last" (the newest complete checkpoint in the ModelCheckpoint directories, or
    `<default_root_dir>/checkpoints`), "best" (the best by the monitored value), a step
    directory (`<dirpath>/<step>`) or a checkpoint directory (its newest complete step).
    """
    if ckpt_path in ("last", "best"):
        if fit is None:
            raise CheckpointError(
                f"ckpt_path={ckpt_path!r} needs a Fit to know where checkpoints are; pass a "
                "path such as 'checkpoints/100' (a step) or 'checkpoints' (its newest step)."
            )
        dirs = _checkpoint_dirs(fit)
        if ckpt_path == "last":
            newest = [(steps[-1], root) for root, _ in dirs if (steps := complete_steps(root))]
            if not newest:
                looked = ", ".join(os.path.abspath(root) for root, _ in dirs)
                warnings.warn(
                    f"ckpt_path='last': no complete checkpoint in {looked}; training starts "
                    "from scratch.", stacklevel=3)
                return None
            step, root = max(newest)
            return os.path.join(root, str(step))
        candidates = [(root, cb) for root, cb in dirs if cb is None or cb.monitor is not None]
        best = None
        for root, cb in candidates or dirs:
            found = _best_in(root, cb.mode if cb is not None else None)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1], root)
        if best is None:
            looked = ", ".join(os.path.abspath(root) for root, _ in dirs)
            raise CheckpointError(
                f"ckpt_path='best': no checkpoint in {looked} records a finite monitored value. "
                "Give ModelCheckpoint a monitor (ModelCheckpoint(dirpath, monitor='val_loss')), "
                "or pass ckpt_path='last' or a path."
            )
        return os.path.join(best[2], str(best[1]))
    path = os.path.abspath(os.fspath(ckpt_path))
    if _is_step_dir(path):
        return path
    if not os.path.exists(path):
        parent = os.path.dirname(path)
        hint = ""
        if os.path.isdir(parent) and complete_steps(parent):
            hint = f" {parent} holds steps {complete_steps(parent)}."
        raise CheckpointError(
            f"ckpt_path {os.fspath(ckpt_path)!r} does not exist (looked for {path}).{hint} Pass "
            "'last', 'best', a checkpoint directory or one of its step directories."
        )
    if _TMP_MARK in os.path.basename(path):
        raise CheckpointError(
            f"ckpt_path {path} is an unfinished save (interrupted before orbax committed it); "
            f"use a complete step such as {complete_steps(os.path.dirname(path))}."
        )
    steps = complete_steps(path)
    if not steps:
        tmp = _incomplete(path)
        extra = f" (only unfinished saves: {tmp})" if tmp else ""
        raise CheckpointError(
            f"ckpt_path {path} holds no complete checkpoint{extra}: expected step directories "
            "<step>/state and <step>/meta written by jaxlight's ModelCheckpoint."
        )
    return os.path.join(path, str(steps[-1]))


# -- matching a checkpoint to a model ------------------------------------------------------------


def _saved_shapes(step_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    from etils import epath

    ocp = _ocp()
    path = epath.Path(os.path.abspath(os.path.join(step_dir, STATE_ITEM)))
    try:
        metadata = ocp.StandardCheckpointHandler().metadata(path)
    except Exception as exc:  # noqa: BLE001 - re-raised with the path
        raise _verify.DamagedCheckpoint(
            f"cannot read the array metadata of {path}: {exc}") from exc
    return _shapes_by_path(getattr(metadata, "tree", metadata))


def check_matches(step_dir: str, target: dict, module, parts: Sequence[str]) -> None:
    """Refuses a checkpoint written for another model, naming paths and shapes that differ."""
    saved = _saved_shapes(step_dir)
    wanted = _shapes_by_path({k: target[k] for k in parts})
    saved = {p: v for p, v in saved.items() if any(p.startswith(f"['{k}']") for k in parts)}
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    shape = sorted(p for p in set(wanted) & set(saved) if wanted[p][0] != saved[p][0])
    if not (missing or unexpected or shape):
        return
    lines = []

    def listing(title, paths, fmt):
        if paths:
            shown = [fmt(p) for p in paths[:8]]
            more = f" ... and {len(paths) - 8} more" if len(paths) > 8 else ""
            lines.append(f"  {title}: " + "; ".join(shown) + more)

    listing("in the model but not in the checkpoint", missing, lambda p: f"{p} {wanted[p][0]}")
    listing("in the checkpoint but not in the model", unexpected, lambda p: f"{p} {saved[p][0]}")
    listing("shape differs", shape,
            lambda p: f"{p} checkpoint {saved[p][0]} vs model {wanted[p][0]}")
    what = " and ".join(parts)
    raise CheckpointError(
        f"checkpoint {step_dir} does not match {type(module).__name__}'s {what}:\n"
        + "\n".join(lines)
        + "\nWas it written for another model, configuration or optimizer? Build the module with "
        "the same hyperparameters (the checkpoint's are in its meta record)."
        + ("" if "opt_state" not in parts else " If only the optimizer differs, "
           "jaxlight.load_checkpoint reads the parameters alone.")
    )


def _restore(step_dir: str, target: dict, partial: bool, meta: dict) -> dict:
    """Reads `target`'s arrays and checks them against the saved checksums."""
    ocp = _ocp()
    path = os.path.join(step_dir, STATE_ITEM)
    target = _abstract_key_data(target)
    record = _verify.read_record(step_dir)
    if record is None and meta.get("checksums"):
        raise _verify.DamagedCheckpoint(
            f"checkpoint {step_dir} lost its checksum record "
            f"({os.path.join(step_dir, _verify.CHECKSUM_ITEM)} is missing).")
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    try:
        with ocp.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=partial))
    except Exception as exc:  # noqa: BLE001 - re-raised with the path
        raise _verify.DamagedCheckpoint(f"restoring {path} failed: {exc}") from exc
    if record is None:
        warnings.warn(f"checkpoint {step_dir} has no checksums (written by an older jaxlight): "
                      "its array values are not verified.", stacklevel=4)
    _verify.verify(step_dir, restored, record)
    return restored


def _restore_shardings(strategy, abstract: Any, shardings: Any) -> Any:
    """Target shardings of the canonical state: the strategy's own for SPMD strategies; for a
    strategy whose layout differs from the canonical one (DDP's device axis), this process's
    first device, from which `from_canonical` lays the state out."""
    from jaxlight.strategies._base import Strategy

    if type(strategy).to_canonical is Strategy.to_canonical:
        return shardings
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: device, abstract)


def _with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


# -- resume and load -----------------------------------------------------------------------------


def _fallback_candidates(fit, ckpt_path, step_dir: str) -> list[str]:
    """Older complete steps to try, newest first, when `step_dir` turns out damaged: for "last"
    every checkpoint directory's steps, for a checkpoint directory its own; none for "best" or
    a step directory the user named."""
    if ckpt_path == "last" and fit is not None:
        roots = [root for root, _ in _checkpoint_dirs(fit)]
    elif ckpt_path != "best" and not _is_step_dir(os.path.abspath(os.fspath(ckpt_path))):
        roots = [os.path.abspath(os.fspath(ckpt_path))]
    else:
        return []
    found = sorted(((step, os.path.join(root, str(step))) for root in roots
                    for step in complete_steps(root)), reverse=True)
    return [path for _, path in found if os.path.abspath(path) != os.path.abspath(step_dir)]


def _epoch_length(fit, data) -> int | None:
    """Batches per epoch (after limit_train_batches), or None when the data has no len()."""
    try:
        n = len(data)
    except TypeError:
        n = None
    limit = fit.limit_train_batches
    if isinstance(limit, float):
        limit = fit._limit(limit, data) if n is not None else None
    elif limit is not None:
        limit = int(limit)
    if n is None:
        return limit
    return min(n, limit) if limit else n


def resume_fit(fit, module, ckpt_path) -> dict | None:
    """Restores a fit from a checkpoint: state, counters, loader position, callbacks' states.

    Called by `Fit.fit(..., ckpt_path=...)` after set-up. Returns the checkpoint's meta record,
    or None when `ckpt_path="last"` found nothing (the fit then starts from scratch).
    """
    step_dir = resolve_checkpoint(fit, ckpt_path)
    if step_dir is None:
        return None
    step_dir, (meta, state) = _verify.with_fallback(
        step_dir, _fallback_candidates(fit, ckpt_path, step_dir),
        lambda path: _restore_state(fit, module, path))
    fit._state = state

    step, epoch, batch_idx = int(meta["step"]), int(meta["epoch"]), int(meta["batch_idx"])
    data = fit.train_data
    fit.train_feed.restore(meta.get("loader"))
    # A checkpoint taken after an epoch's last batch resumes at the start of the next epoch
    # (that epoch's end-of-epoch hooks and validation had run, or are skipped).
    length = _epoch_length(fit, data)
    if length is not None and batch_idx >= length:
        epoch, batch_idx = epoch + 1, 0
    fit._global_step, fit._epoch, fit._batch_idx = step, epoch, batch_idx

    states = meta.get("callbacks", {})
    for cb in fit.callbacks:
        if cb.state_key in states:
            cb.load_state_dict(states[cb.state_key])
    for cb in fit.callbacks:
        cb.on_load_checkpoint(fit, module, meta)
    if jax.process_index() == 0:
        print(f"jaxlight: resumed from {step_dir} (step {step}, epoch {epoch}, batch {batch_idx}).",
              flush=True)
    return meta


def _restore_state(fit, module, step_dir: str) -> tuple[dict, TrainState]:
    """The meta record and the verified train state of one step, in the fit's layout."""
    meta = read_meta(step_dir)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{step_dir} has checkpoint format {meta.get('format')!r}; this jaxlight reads "
            f"format {FORMAT_VERSION}."
        )
    mask = getattr(fit._spec, "frozen", None)
    frozen = _frozen.has_frozen(mask)
    abstract = _state_tree(fit._spec.abstract_state)
    shardings = _state_tree(_restore_shardings(fit.strategy, fit._spec.abstract_state,
                                               fit._shardings))
    if frozen:
        rest_shardings = shardings["rest"]
        abstract["rest"] = _frozen.select(abstract["rest"], mask, False)
        shardings["rest"] = _frozen.select(rest_shardings, mask, False)
    check_matches(step_dir, _abstract_key_data(abstract), module,
                  ("params", "opt_state", "rest"))
    if frozen:
        fresh = _rebuild_frozen(step_dir, meta, module, mask, rest_shardings, fit.strategy,
                                fit.seed)
    restored = _restore(step_dir, _with_shardings(abstract, shardings), partial=False,
                        meta=meta)
    tree = _wrap_keys(restored, abstract, meta.get("prng_keys", {}))
    rest = _frozen.join(mask, tree["rest"], fresh) if frozen else tree["rest"]
    state = TrainState(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"],
                       rest=rest)
    return meta, fit.strategy.from_canonical(state, fit._shardings)


def _rebuild_frozen(step_dir, meta, module, mask, rest_shardings, strategy, default_seed):
    """The frozen parameters (not in the checkpoint) from configure_model, checked against the
    checkpoint's record; built with the seed of the fit that wrote it."""
    seed = (meta.get("fit") or {}).get("seed", default_seed)
    fresh = _frozen.build(module, seed, mask, _frozen.select(rest_shardings, mask, True),
                          strategy)
    _frozen.check(step_dir, meta.get("frozen_params"), _frozen.records(fresh), module, seed)
    return fresh


def load_checkpoint(path, module, strategy=None, *, fit=None) -> nnx.Module:
    """Loads a checkpoint's parameters into `module.model` for inference; returns the model.

    Reads only the parameters and the model's other variables (not the optimizer state), each
    process only the shards its layout needs. No `Fit` is needed.

    Args:
        path: a step directory (`ckpt/200`), a checkpoint directory (its newest step), or
            "last"/"best" when `fit` is given.
        module: the `TrainModule` the checkpoint was trained with (same hyperparameters), or
            its class: built from the checkpoint's hyperparameters (`meta["hparams"]`; use
            `Class.load_from_checkpoint` to get the module back and to override some).
        strategy: lay the parameters out as this strategy does (default: one device).
        fit: resolves "last" and "best" through its ModelCheckpoint callbacks.

    Example:
        >>> model = jaxlight.load_checkpoint("checkpoints/100", Classifier())  # doctest: +SKIP
        >>> logits = model(x)  # doctest: +SKIP
    """
    from jaxlight import strategies as _strategies

    step_dir = resolve_checkpoint(fit, path)
    if step_dir is None:
        raise CheckpointError(f"ckpt_path={path!r}: no checkpoint has been saved yet.")
    if isinstance(module, type):
        module = _hparams.rebuild(module, read_meta(step_dir), step_dir, {})
    strategy = _strategies.resolve(strategy if strategy is not None else "single")
    if strategy.mesh is None:
        strategy.setup(None)
    _, graphdef, params_state, rest_state = abstract_model(module)
    params, rest = nnx.to_pure_dict(params_state), nnx.to_pure_dict(rest_state)
    abstract = TrainState(step=jax.ShapeDtypeStruct((), np.int32), params=params, opt_state={},
                          rest=rest)
    logical = TrainState(step=None, params=_logical_names(params_state), opt_state={},
                         rest=_logical_names(rest_state))
    shardings = _restore_shardings(strategy, abstract,
                                   strategy.state_shardings(abstract, logical))
    target = {"params": params, "rest": rest}
    sh = {"params": shardings.params, "rest": shardings.rest}
    mask = frozen_mask(rest_state)
    frozen = _frozen.has_frozen(mask)
    if frozen:
        target["rest"] = _frozen.select(rest, mask, False)
        sh["rest"] = _frozen.select(shardings.rest, mask, False)

    def one(step_dir):
        meta = read_meta(step_dir)
        check_matches(step_dir, _abstract_key_data(target), module, ("params", "rest"))
        if frozen:
            fresh = _rebuild_frozen(step_dir, meta, module, mask, shardings.rest, strategy,
                                    fit.seed if fit is not None else 0)
        restored = _restore(step_dir, _with_shardings(target, sh), partial=True, meta=meta)
        tree = _wrap_keys({"params": restored["params"], "rest": restored["rest"]}, target,
                          meta.get("prng_keys", {}))
        rest_ = _frozen.join(mask, tree["rest"], fresh) if frozen else tree["rest"]
        return nnx.merge(graphdef, tree["params"], rest_)

    _, model = _verify.with_fallback(step_dir, _fallback_candidates(fit, path, step_dir), one)
    module.model = model
    return model


# -- writing -------------------------------------------------------------------------------------


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
        "versions": {"jax": jax.__version__, "jaxlight": _version()},
        "time": time.time(),
    }
    if frozen is not None:  # only for modules with frozen parameters: others' records unchanged
        meta["frozen_params"] = frozen
    lossy = _hparams.unrestorable(module.hparams)
    if lossy:  # kept as text only: rebuilding the module from the record needs them given again
        meta["hparams_unrestorable"] = lossy
    for cb in fit.callbacks:
        cb.on_save_checkpoint(fit, module, meta)
    return _jsonable(meta)


def _version() -> str:
    import jaxlight

    return getattr(jaxlight, "__version__", "?")


class CheckpointWriter:
    """An orbax `CheckpointManager` over one directory with jaxlight's retention policy.

    Saves are asynchronous by default: `save` returns once this process's shards of the state
    have been copied to host memory (orbax's synchronous device-to-host transfer), so the next
    step may reuse (donate) the device buffers; the write and the commit (a rename) happen in a
    background thread. At most one save is in flight: orbax waits for the previous one before
    starting the next, so the host memory held by checkpointing is bounded by one copy of this
    process's shards.
    """

    def __init__(self, dirpath: str, *, monitor: str | None = None, mode: str = "min",
                 save_top_k: int = 1, save_last: bool = True, async_save: bool = True):
        ocp = _ocp()
        self.dirpath = os.path.abspath(dirpath)
        self.monitor = monitor
        self.retention = Retention(monitor, mode, save_top_k, save_last)
        options = ocp.CheckpointManagerOptions(
            create=True,
            cleanup_tmp_directories=True,  # unfinished saves of a killed run
            enable_async_checkpointing=async_save,
            preservation_policy=self.retention,
            # best_fn only makes orbax write and reload the `metrics` item the retention reads.
            best_fn=(lambda m: m.get(monitor)) if monitor else None,
            best_mode=mode,
        )
        try:
            self.manager = ocp.CheckpointManager(self.dirpath, options=options)
        except Exception as exc:  # noqa: BLE001 - re-raised with the directory
            raise CheckpointError(
                f"cannot open checkpoint directory {self.dirpath}: {exc}") from exc
        self.last_saved_step: int | None = None
        self._moved_aside_seen = _verify.moved_aside_count
        self._warned_exists: set[int] = set()
        self._failed = False

    def step_dir(self, step: int) -> str:
        return os.path.join(self.dirpath, str(step))

    def save(self, fit, module, monitor_value: float | None = None, *,
             pin: bool = False) -> bool:
        """Starts saving the current state under `fit.global_step`; False if already saved."""
        ocp = _ocp()
        step = int(fit.global_step)
        if step == self.last_saved_step:
            return False
        if self._moved_aside_seen != _verify.moved_aside_count:
            # A resume moved a damaged step aside: re-list, so that step is written again.
            self._moved_aside_seen = _verify.moved_aside_count
            self.manager.reload()
        if step in self.manager.all_steps():
            if step not in self._warned_exists:
                self._warned_exists.add(step)
                warnings.warn(
                    f"checkpoint step {step} already exists in {self.dirpath} (from an earlier "
                    "run); it is kept and not overwritten.", stacklevel=3)
            return False
        if fit.state is None:
            return False
        self.wait()  # orbax would wait too; waiting here reports a failed earlier save as such
        tree = _state_tree(fit.strategy.to_canonical(fit.state))
        mask, frozen = getattr(fit._spec, "frozen", None), None
        if _frozen.has_frozen(mask):
            # configure_model rebuilds them on restore; their fingerprints prove it did.
            frozen = _frozen.records(_frozen.select(tree["rest"], mask, True))
            tree["rest"] = _frozen.select(tree["rest"], mask, False)
        tree, key_impls = _unwrap_keys(tree)
        # Dispatched now, read by orbax's writer thread: the loop does not wait for it.
        digests = _verify.start_digests(tree)
        record = None
        if self.monitor is not None:
            record = {"name": self.monitor, "value": monitor_value,
                      "mode": self.retention.mode}
        meta = build_meta(fit, module, key_impls, record, frozen)
        meta["checksums"] = True  # a step without its checksums item is then known damaged
        metrics = None
        if self.monitor is not None:  # an empty record: saved before the metric existed
            metrics = {} if monitor_value is None else {self.monitor: monitor_value}
        if pin:
            self.retention.pinned.add(step)
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(tree),
                                           META_ITEM: ocp.args.JsonSave(meta),
                                           _verify.CHECKSUM_ITEM: _verify.save_args(digests)}),
                metrics=metrics,
                force=True,
            )
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise CheckpointError(
                f"saving checkpoint step {step} to {self.dirpath} failed: {exc}. Checkpoints "
                f"saved before are untouched: {complete_steps(self.dirpath)}."
            ) from exc
        self.last_saved_step = step
        return True

    def wait(self) -> None:
        """Blocks until the save in flight has committed; raises CheckpointError if it failed."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            self._failed = True
            raise CheckpointError(
                f"an asynchronous checkpoint save to {self.dirpath} failed: "
                f"{type(exc).__name__}: {exc}. Checkpoints saved before are untouched: "
                f"steps {complete_steps(self.dirpath)}."
            ) from exc

    def close(self) -> None:
        """Waits for the save in flight and releases orbax's threads.

        A failure already raised by `wait` or `save` is not raised again (close runs in
        teardown, where it would hide the exception being handled).
        """
        reported = self._failed
        try:
            self.wait()
        except CheckpointError:
            if not reported:
                raise
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 - the failure was reported by wait()
                if not self._failed:
                    raise


def save_on_preemption(fit, module) -> str:
    """Saves the current state (through the first ModelCheckpoint, or under
    `<default_root_dir>/checkpoints`) and waits for the commit; returns the step directory."""
    from jaxlight.callbacks._checkpoint import ModelCheckpoint

    for cb in fit.callbacks:
        if isinstance(cb, ModelCheckpoint):
            return cb.save_now(fit, module, wait=True, pin=True)
    writer = CheckpointWriter(default_dirpath(fit), save_top_k=1, save_last=True,
                              async_save=False)
    try:
        writer.save(fit, module)
        writer.wait()
    finally:
        writer.close()
    return writer.step_dir(fit.global_step)
