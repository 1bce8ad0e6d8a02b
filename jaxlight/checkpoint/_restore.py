"""Restoring checkpoints: a fit's train state and loop position, or a model for inference.

The state is saved as every strategy sees it (`strategy.to_canonical`), so a checkpoint written
under one strategy restores under any other: each process reads only the shards its target
sharding needs. The on-disk layout is in `jaxlight.checkpoint._format`; finding checkpoints in
`_paths`; saving in `_writer`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from etils import epath
from flax import nnx
from jax.tree_util import keystr

from jaxlight import strategies as _strategies
from jaxlight._errors import CheckpointError
from jaxlight.checkpoint import _verify
from jaxlight.checkpoint._format import (
    FORMAT_VERSION,
    STATE_ITEM,
    abstract_key_data,
    ocp,
    shapes_by_path,
    state_tree,
    wrap_keys,
)
from jaxlight.checkpoint._paths import (
    CheckpointLocation,
    complete_steps,
    default_dirpath,
    fallback_candidates,
    read_meta,
    resolve_checkpoint,
)
from jaxlight.checkpoint._writer import CheckpointWriter
from jaxlight.hparams import _hparams
from jaxlight.state import _frozen
from jaxlight.state._state import TrainState, abstract_model, frozen_mask, logical_names
from jaxlight.strategies._base import Strategy

__all__ = ["CheckpointError", "CheckpointLocation", "CheckpointWriter", "Restored",
           "check_matches", "complete_steps", "default_dirpath", "load_checkpoint", "read_meta",
           "resolve_checkpoint", "restore_training"]


# -- matching a checkpoint to a model ------------------------------------------------------------


def _saved_shapes(step_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    path = epath.Path(os.path.abspath(os.path.join(step_dir, STATE_ITEM)))
    try:
        metadata = ocp().StandardCheckpointHandler().metadata(path)
    except Exception as exc:  # noqa: BLE001 - re-raised with the path
        raise _verify.DamagedCheckpoint(
            f"cannot read the array metadata of {path}: {exc}") from exc
    return shapes_by_path(getattr(metadata, "tree", metadata))


def check_matches(step_dir: str, target: dict, module, parts: Sequence[str]) -> None:
    """Refuses a checkpoint written for another model, naming paths and shapes that differ."""
    saved = _saved_shapes(step_dir)
    wanted = shapes_by_path({k: target[k] for k in parts})
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
    differ = [k for k in parts
              if any(p.startswith(f"['{k}']") for p in (*missing, *unexpected, *shape))]
    what = " and ".join(differ)
    if differ == ["opt_state"]:
        advice = (f"\nThe {' and '.join(k for k in parts if k != 'opt_state')} match: the "
                  "optimizer differs (another optax transformation, or other settings of it), "
                  "so its state cannot be resumed. Resume with the optimizer the checkpoint was "
                  "written with, or load the parameters alone, jaxlight.load_checkpoint(path, "
                  "module), and fit without ckpt_path (the optimizer then starts afresh).")
    else:
        advice = ("\nWas it written for another model, configuration or optimizer? Build the "
                  "module with the same hyperparameters (the checkpoint's are in its meta "
                  "record).")
    raise CheckpointError(
        f"checkpoint {step_dir} does not match {type(module).__name__}'s {what}:\n"
        + "\n".join(lines) + advice
    )


def _restore(step_dir: str, target: dict, partial: bool, meta: dict) -> dict:
    """Reads `target`'s arrays and checks them against the saved checksums."""
    orbax = ocp()
    path = os.path.join(step_dir, STATE_ITEM)
    target = abstract_key_data(target)
    record = _verify.read_record(step_dir)
    if record is None and meta.get("checksums"):
        raise _verify.DamagedCheckpoint(
            f"checkpoint {step_dir} lost its checksum record "
            f"({os.path.join(step_dir, _verify.CHECKSUM_ITEM)} is missing).")
    # Arrays are read in the dtype they were saved in (a bf16-true model's bfloat16), so that
    # their checksums can be checked, and only then cast to the target's dtype (a module built
    # in float32 loading them for inference): orbax's own cast on read would make every
    # checksum differ.
    wanted = target
    stored = _stored_dtypes(step_dir, target)
    target = jax.tree_util.tree_map_with_path(
        lambda p, x: jax.ShapeDtypeStruct(x.shape, stored[_saved_key(p)], sharding=x.sharding)
        if _saved_key(p) in stored else x, target)
    restore_args = orbax.checkpoint_utils.construct_restore_args(target)
    try:
        with orbax.PyTreeCheckpointer() as checkpointer:
            restored = checkpointer.restore(path, args=orbax.args.PyTreeRestore(
                item=target, restore_args=restore_args, partial_restore=partial))
    except Exception as exc:  # noqa: BLE001 - re-raised with the path
        raise _verify.DamagedCheckpoint(f"restoring {path} failed: {exc}") from exc
    if record is None:
        warnings.warn(f"checkpoint {step_dir} has no checksums (written by an older jaxlight): "
                      "its array values are not verified.", stacklevel=4)
    _verify.verify(step_dir, restored, record)
    if not stored:
        return restored
    return jax.tree.map(lambda x, w: x.astype(w.dtype) if x.dtype != w.dtype else x,
                        restored, wanted)


def _saved_key(path: tuple) -> str:
    """The keystr of a leaf's path as orbax's metadata names it (`_format.normalized`:
    namedtuple fields and dict keys as string keys)."""
    tu = jax.tree_util
    return keystr(tuple(tu.DictKey(p.name) if isinstance(p, tu.GetAttrKey)
                        else tu.DictKey(str(p.key)) if isinstance(p, tu.DictKey) else p
                        for p in path))


def _stored_dtypes(step_dir: str, target: Any) -> dict[str, Any]:
    """keystr path -> saved dtype, for the leaves of `target` saved in another dtype."""
    saved = _saved_shapes(step_dir)
    out = {}
    for p, x in jax.tree_util.tree_flatten_with_path(target)[0]:
        key = _saved_key(p)
        if key in saved and hasattr(x, "dtype") and np.dtype(saved[key][1]) != x.dtype:
            out[key] = np.dtype(saved[key][1])
    return out


def _restore_shardings(strategy, abstract: Any, shardings: Any) -> Any:
    """Target shardings of the canonical state: the strategy's own for SPMD strategies; for a
    strategy whose layout differs from the canonical one (DDP's device axis), this process's
    first device, from which `from_canonical` lays the state out."""
    if type(strategy).to_canonical is Strategy.to_canonical:
        return shardings
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.tree.map(lambda _: device, abstract)


def _with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


# -- resuming a fit ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Restored:
    """A fit's checkpoint, read and verified: for `Fit` to adopt (it owns its state)."""

    #: The step directory actually read (an older one when the named one was damaged).
    step_dir: str
    #: The meta record (`jaxlight.checkpoint._format.build_meta`).
    meta: dict
    #: The train state in the session's layout.
    state: TrainState

    @property
    def position(self) -> tuple[int, int, int]:
        """(global step, epoch, batch index) as saved."""
        meta = self.meta
        return int(meta["step"]), int(meta["epoch"]), int(meta["batch_idx"])


def restore_training(session, ckpt_path, fit=None) -> Restored | None:
    """Reads the train state `ckpt_path` names into `session`'s layout (nothing is assigned).

    `session` is a set-up `jaxlight._fit.Session`; `fit` (optional) resolves "last"/"best"
    through `fit.checkpoint_locations`. A damaged newest step falls back to an older one where
    the path allows it (`_verify.with_fallback`). Returns None when `ckpt_path="last"` found
    nothing.
    """
    step_dir = resolve_checkpoint(fit, ckpt_path)
    if step_dir is None:
        return None
    step_dir, (meta, state) = _verify.with_fallback(
        step_dir, fallback_candidates(fit, ckpt_path, step_dir),
        lambda path: _restore_state(session, path))
    return Restored(step_dir=step_dir, meta=meta, state=state)


def _restore_state(session, step_dir: str) -> tuple[dict, TrainState]:
    """The meta record and the verified train state of one step, in the session's layout."""
    meta = read_meta(step_dir)
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{step_dir} has checkpoint format {meta.get('format')!r}; this jaxlight reads "
            f"format {FORMAT_VERSION}."
        )
    spec, strategy, module = session.spec, session.strategy, session.module
    mask = spec.frozen
    frozen = _frozen.has_frozen(mask)
    abstract = state_tree(spec.abstract_state)
    shardings = state_tree(_restore_shardings(strategy, spec.abstract_state, session.shardings))
    if frozen:
        rest_shardings = shardings["rest"]
        abstract["rest"] = _frozen.select(abstract["rest"], mask, False)
        shardings["rest"] = _frozen.select(rest_shardings, mask, False)
    check_matches(step_dir, abstract_key_data(abstract), module,
                  ("params", "opt_state", "rest"))
    if frozen:
        fresh = _rebuild_frozen(step_dir, meta, module, mask, rest_shardings, strategy,
                                session.seed)
    restored = _restore(step_dir, _with_shardings(abstract, shardings), partial=False,
                        meta=meta)
    tree = wrap_keys(restored, abstract, meta.get("prng_keys", {}))
    rest = _frozen.join(mask, tree["rest"], fresh) if frozen else tree["rest"]
    state = TrainState(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"],
                       rest=rest)
    return meta, strategy.from_canonical(state, session.shardings)


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
    logical = TrainState(step=None, params=logical_names(params_state), opt_state={},
                         rest=logical_names(rest_state))
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
        check_matches(step_dir, abstract_key_data(target), module, ("params", "rest"))
        if frozen:
            fresh = _rebuild_frozen(step_dir, meta, module, mask, shardings.rest, strategy,
                                    fit.seed if fit is not None else 0)
        restored = _restore(step_dir, _with_shardings(target, sh), partial=True, meta=meta)
        tree = wrap_keys({"params": restored["params"], "rest": restored["rest"]}, target,
                          meta.get("prng_keys", {}))
        rest_ = _frozen.join(mask, tree["rest"], fresh) if frozen else tree["rest"]
        return nnx.merge(graphdef, tree["params"], rest_)

    _, model = _verify.with_fallback(step_dir, fallback_candidates(fit, path, step_dir), one)
    module.model = model
    return model
