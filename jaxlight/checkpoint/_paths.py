"""Finding checkpoints: committed steps, the meta record, and what a `ckpt_path` names."""

from __future__ import annotations

import dataclasses
import os
import warnings

from jaxlight import distributed as _distributed
from jaxlight._errors import CheckpointError
from jaxlight.checkpoint import _verify
from jaxlight.checkpoint._format import (
    DEFAULT_SUBDIR,
    HPARAMS_ALIAS,
    META_ITEM,
    STATE_ITEM,
    TMP_MARK,
    is_finite,
    ocp,
)


@dataclasses.dataclass(frozen=True)
class CheckpointLocation:
    """A directory a fit writes checkpoints to (`Fit.checkpoint_locations`).

    `monitor`/`mode` are its ModelCheckpoint's; `default` marks `<default_root_dir>/checkpoints`
    (no ModelCheckpoint), which every "best" search includes.
    """

    dirpath: str
    monitor: str | None = None
    mode: str | None = None
    default: bool = False
    #: Its ModelCheckpoint's `best_model_path` in this process (without a monitor: its newest
    #: save, Lightning's "best"), or None.
    best: str | None = None


def _locations(fit) -> list[CheckpointLocation]:
    return list(fit.checkpoint_locations)


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


def incomplete(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if TMP_MARK in n) if os.path.isdir(root) else []


def is_step_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, STATE_ITEM)) and os.path.isdir(
        os.path.join(path, META_ITEM))


def read_meta(step_dir: str) -> dict:
    """The checkpoint's record, with Lightning's names a hook reads: "global_step" (also in
    records written before it was stored) and "hyper_parameters" (the "hparams" record)."""
    orbax = ocp()
    try:
        meta = orbax.Checkpointer(orbax.JsonCheckpointHandler()).restore(
            os.path.join(step_dir, META_ITEM))
    except Exception as exc:  # noqa: BLE001 - re-raised with the path and what to do
        raise _verify.DamagedCheckpoint(
            f"cannot read the checkpoint record {os.path.join(step_dir, META_ITEM)}: {exc}. "
            "Is this a jaxlight checkpoint step directory (<dirpath>/<step>)?"
        ) from exc
    if isinstance(meta, dict):
        if "step" in meta:
            meta.setdefault("global_step", meta["step"])
        if "hparams" in meta:
            meta.setdefault(HPARAMS_ALIAS, meta["hparams"])
    return meta


def agreed_checkpoint_root(default_root_dir: str) -> str:
    """Process 0's `<default_root_dir>/checkpoints`, absolute, on every process (a collective,
    called as each stage starts). As Lightning's ModelCheckpoint broadcasts its directory: with
    a root per process (a relative root, each process started in its own folder), every
    process saves into process 0's directory."""
    local = os.path.abspath(os.path.join(default_root_dir, DEFAULT_SUBDIR))
    return _distributed.all_gather_json("checkpoint_root", local)[0]


def default_dirpath(fit) -> str:
    """`<default_root_dir>/checkpoints` as an absolute path (orbax refuses relative ones; a
    relative root is the folder the run was started from); with several processes, process 0's
    (agreed when a stage starts), so that every process saves into one directory."""
    agreed = getattr(fit, "_checkpoint_root", None)
    if agreed is not None:
        return agreed
    return os.path.abspath(os.path.join(fit.default_root_dir, DEFAULT_SUBDIR))


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
        dirs = _locations(fit)
        if ckpt_path == "last":
            newest = [(steps[-1], loc.dirpath) for loc in dirs
                      if (steps := complete_steps(loc.dirpath))]
            if not newest:
                looked = ", ".join(os.path.abspath(loc.dirpath) for loc in dirs)
                warnings.warn(
                    f"ckpt_path='last': no complete checkpoint in {looked}; training starts "
                    "from scratch.", stacklevel=3)
                return None
            step, root = max(newest)
            return os.path.join(root, str(step))
        candidates = [loc for loc in dirs if loc.default or loc.monitor is not None]
        best = None
        for loc in candidates or dirs:
            found = _best_in(loc.dirpath, loc.mode)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1], loc.dirpath)
        if best is None:
            # Lightning's "best" of a ModelCheckpoint without a monitor is its newest save
            # (`best_model_path`), known to the fit that saved it.
            saved = [loc.best for loc in dirs if loc.monitor is None and loc.best
                     and is_step_dir(loc.best)]
            if saved:
                return saved[0]
            looked = ", ".join(os.path.abspath(loc.dirpath) for loc in dirs)
            raise CheckpointError(
                f"ckpt_path='best': no checkpoint in {looked} records a finite monitored value. "
                "Give ModelCheckpoint a monitor (ModelCheckpoint(dirpath, monitor='val_loss')), "
                "or pass ckpt_path='last' or a path."
            )
        return os.path.join(best[2], str(best[1]))
    path = os.path.abspath(os.fspath(ckpt_path))
    if is_step_dir(path):
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
    if TMP_MARK in os.path.basename(path):
        raise CheckpointError(
            f"ckpt_path {path} is an unfinished save (interrupted before orbax committed it); "
            f"use a complete step such as {complete_steps(os.path.dirname(path))}."
        )
    steps = complete_steps(path)
    if not steps:
        tmp = incomplete(path)
        extra = f" (only unfinished saves: {tmp})" if tmp else ""
        raise CheckpointError(
            f"ckpt_path {path} holds no complete checkpoint{extra}: expected step directories "
            "<step>/state and <step>/meta written by jaxlight's ModelCheckpoint."
        )
    return os.path.join(path, str(steps[-1]))


def fallback_candidates(fit, ckpt_path, step_dir: str) -> list[str]:
    """Older complete steps to try, newest first, when `step_dir` turns out damaged: for "last"
    every checkpoint directory's steps, for a checkpoint directory its own; none for "best" or
    a step directory the user named."""
    if ckpt_path == "last" and fit is not None:
        roots = [loc.dirpath for loc in _locations(fit)]
    elif ckpt_path != "best" and not is_step_dir(os.path.abspath(os.fspath(ckpt_path))):
        roots = [os.path.abspath(os.fspath(ckpt_path))]
    else:
        return []
    found = sorted(((step, os.path.join(root, str(step))) for root in roots
                    for step in complete_steps(root)), reverse=True)
    return [path for _, path in found if os.path.abspath(path) != os.path.abspath(step_dir)]
