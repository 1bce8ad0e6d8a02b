"""Hyperparameters: `save_hyperparameters()`, `module.hparams.x`, and rebuilding from a checkpoint.

`TrainModule.__new__` records the constructor arguments on its own (no call needed);
`save_hyperparameters()` replaces that record with Lightning's semantics: the arguments of the
`__init__` frames that called it (values as they are at the call, so an argument reassigned before
the call is recorded as reassigned), optionally only some names or without `ignore`d ones.
Checkpoints keep the record in their meta (`meta["hparams"]`); `rebuild` constructs the module
again from it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any

from jaxlight._errors import CheckpointError, ConfigurationError, MissingAttributeError, suggest


class AttributeDict(dict):
    """A dict whose keys read and write as attributes: `hparams.lr` is `hparams["lr"]`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise MissingAttributeError(
                f"no hyperparameter {name!r}; recorded: {sorted(self)}.{suggest(name, self)} "
                "Hyperparameters are the __init__ arguments (see save_hyperparameters)."
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise MissingAttributeError(
                f"no hyperparameter {name!r} to delete; recorded: {sorted(self)}."
                f"{suggest(name, self)}"
            ) from None

    def __repr__(self) -> str:
        return repr(dict(self))


def init_arguments(cls, args: tuple, kwargs: dict) -> AttributeDict:
    """The arguments of `cls(*args, **kwargs)` by name, defaults filled in (**kwargs flattened)."""
    out = AttributeDict()
    try:
        signature = inspect.signature(cls.__init__)
        bound = signature.bind(None, *args, **kwargs)
    except (TypeError, ValueError):
        return out  # __init__ will raise the real error with Python's own message
    bound.apply_defaults()
    for name, value in list(bound.arguments.items())[1:]:
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out


def _frame_arguments(frame) -> dict[str, Any]:
    """The named arguments of a frame as they are now (keyword catch-alls flattened)."""
    info = inspect.getargvalues(frame)
    out = {name: info.locals[name] for name in info.args[1:] if name in info.locals}
    if info.keywords and isinstance(info.locals.get(info.keywords), dict):
        out.update(info.locals[info.keywords])
    return out


def collect(module, names: tuple, ignore, frame) -> AttributeDict:
    """What `module.save_hyperparameters(*names, ignore=ignore)` records, called from `frame`."""
    if len(names) == 1 and not isinstance(names[0], str):
        given = names[0]
        if isinstance(given, Mapping):
            return AttributeDict(given)
        if hasattr(given, "__dict__"):  # argparse.Namespace and the like
            return AttributeDict(vars(given))
        raise ConfigurationError(
            f"save_hyperparameters({type(given).__name__}): pass argument names (strings), a "
            "dict, a Namespace, or nothing (every __init__ argument)."
        )
    # Walk out through the __init__ frames of this object (a subclass calling super().__init__
    # calls save_hyperparameters from the parent's frame): outer frames first, inner override.
    frames = []
    while frame is not None and frame.f_code.co_name == "__init__":
        info = inspect.getargvalues(frame)
        if not info.args or info.locals.get(info.args[0]) is not module:
            break
        frames.append(frame)
        frame = frame.f_back
    if not frames:
        raise ConfigurationError(
            f"{type(module).__name__}.save_hyperparameters() reads the arguments of the __init__ "
            "that calls it; call it inside __init__, or pass a dict of hyperparameters."
        )
    found: dict[str, Any] = {}
    for f in reversed(frames):
        found.update(_frame_arguments(f))
    if names:
        missing = [n for n in names if n not in found]
        if missing:
            raise ConfigurationError(
                f"save_hyperparameters{tuple(names)}: {missing} are not arguments of "
                f"{type(module).__name__}.__init__ (arguments: {sorted(found)})."
                f"{suggest(missing[0], found)}"
            )
        found = {n: found[n] for n in names}
    ignored = [ignore] if isinstance(ignore, str) else list(ignore or ())
    unknown = [n for n in ignored if n not in found and n not in names]
    if unknown:
        raise ConfigurationError(
            f"save_hyperparameters(ignore={ignored}): {unknown} are not arguments of "
            f"{type(module).__name__}.__init__ (arguments: {sorted(found)})."
            f"{suggest(unknown[0], found)}"
        )
    return AttributeDict({k: v for k, v in found.items() if k not in ignored})


class HyperparametersMixin:
    """`hparams` and `save_hyperparameters()`, shared by `TrainModule` and `DataModule` (as
    Lightning's mixin is): the constructor arguments are recorded without any call."""

    def __new__(cls, *args, **kwargs):
        self = super().__new__(cls)
        object.__setattr__(self, "_hparams", init_arguments(cls, args, kwargs))
        return self

    def save_hyperparameters(self, *names, ignore=None) -> None:
        """Records the `__init__` arguments as `self.hparams`, as Lightning does.

        Reads the arguments of the `__init__` that calls it (and of subclass `__init__`s above
        it) as they are at the call (an argument reassigned before the call is recorded as
        reassigned, and `load_from_checkpoint` passes that value back to `__init__`). Without a
        call, every constructor argument is recorded as given.

        Args:
            *names: record only these arguments; or one dict / Namespace to record as it is.
            ignore: argument names (or one name) to leave out, e.g. a backbone module.
        """
        frame = inspect.currentframe().f_back
        try:
            object.__setattr__(self, "_hparams", collect(self, names, ignore, frame))
        finally:
            del frame  # no reference cycle through the caller's frame

    @property
    def hparams(self) -> AttributeDict:
        """The hyperparameters (constructor arguments, defaults filled in): `hparams.lr` or
        `hparams["lr"]`. Checkpoints and loggers record them."""
        return self._hparams


# -- checkpoints ---------------------------------------------------------------------------------


def _restorable(value: Any) -> bool:
    """Whether a value comes back from the checkpoint's JSON record as the same value (tuples
    come back as lists, which every constructor that iterates them accepts)."""
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return json.loads(json.dumps(value)) == value or value != value  # nan survives as NaN
    if isinstance(value, list | tuple):
        return all(_restorable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _restorable(v) for k, v in value.items())
    return False


def unrestorable(hparams: Mapping) -> list[str]:
    """Names whose values the JSON record keeps only as a repr (arrays, objects, modules)."""
    return sorted(k for k, v in hparams.items() if not _restorable(v))


def rebuild(cls, meta: dict, step_dir: str, overrides: dict):
    """`cls(**hparams)` from a checkpoint's record, with `overrides` taking precedence."""
    recorded = meta.get("hparams")
    if recorded is None:
        raise CheckpointError(f"{step_dir}: the checkpoint records no hyperparameters; build "
                              f"the module yourself and pass it: load_checkpoint(path, "
                              f"{cls.__name__}(...)).")
    lossy = [n for n in meta.get("hparams_unrestorable", ()) if n not in overrides]
    if lossy:
        raise CheckpointError(
            f"{step_dir}: hyperparameters {lossy} of {meta.get('module', '?')} were recorded only "
            f"as text (not JSON values), so they cannot be rebuilt; pass them: "
            f"{cls.__name__}.load_from_checkpoint(path, {lossy[0]}=...)."
        )
    kwargs = {**{k: v for k, v in recorded.items() if k not in overrides}, **overrides}
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise CheckpointError(
            f"{step_dir}: cannot rebuild {cls.__name__} from the checkpoint's hyperparameters "
            f"{sorted(recorded)} (written by {meta.get('module', '?')}): {exc}. Pass the missing "
            f"or renamed arguments: {cls.__name__}.load_from_checkpoint(path, name=value)."
        ) from None
    return cls(**kwargs)

