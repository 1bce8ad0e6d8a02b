"""Trace-time guards: Lightning code that a step traced once would silently turn into constants.

A step is traced once and compiled (DESIGN.md): the Python in it runs once, at that trace, and
every host value it reads becomes a constant of the compiled program. Code written for
Lightning, where the step runs every batch, then computes something else without a word: an
environment stepped in `training_step` steps once in thirty steps; a target network kept on
`self` and re-synced from a hook never reaches the step. These guards find such code at the
trace (and at epoch ends), never per step, and say what to write instead:

- `watch(module, where)`, around every call into a user step (`call_user_step`): the host
  state the step can reach (`self`'s attributes, followed into containers and plain objects;
  NumPy's and Python's global random states) before and after the trace; a change means host
  code ran once, at the trace. It also records which of `self`'s attributes the step read
  (by swapping the module's class for a recording subclass during that call only, so reads
  cost nothing outside a trace), with a summary of their arrays and numbers.
- `refuse_assignment` (from `TrainModule.__setattr__`): assigning another value to an attribute
  a compiled step read, from a hook or anywhere outside a step.
- `check_reads` (at every training epoch's end): the arrays, networks and numbers a compiled
  step read are the ones it was traced with (an in-place `nnx.update` of a network on `self`).
- `check_frozen_writes`: a step that assigns to a variable it does not carry out (a frozen
  parameter: `TrainModule.trainable` leaves it out of training, and the step keeps its value).

Where a guard cannot be exact (docs/porting.md, 'What a compiled step cannot see') it says so:
objects are followed to a bounded depth and size, not into data (objects with `__iter__` or
`__next__`, which the prefetching thread may read while a step is traced), and in-place changes
inside an object that is not an array, a network, a number or a plain container are not
compared at epoch ends.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import inspect
import linecache
import random
import re
import sys
import textwrap
import types
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxlight._errors import PortingError, is_user_file, user_frame

#: Where the guards' messages point.
GUIDE = "docs/porting.md (section 'What a compiled step cannot see')"
#: The jaxlight form of a target network, momentum encoder or other synced copy.
SYNCED = ("keep the copy in the model configure_model returns, as jaxlight.nn.SyncedCopy(net), "
          "and update it inside training_step with model.target.sync(model.net, every=N) or "
          "model.target.sync(model.net, tau=...) (optax.periodic_update / incremental_update); "
          "it is carried and checkpointed with the rest of the model. See docs/rl.md")
#: The attributes TrainModule keeps for jaxlight itself (not the user's state).
INTERNAL = frozenset({"_model", "_model_source", "_trainer", "_hparams", "_step_reads"})

_MAX_NODES = 20_000  # values summarized per snapshot: a replay buffer of dicts fits
_MAX_DEPTH = 6
_DIGEST_BYTES = 64 << 20  # numpy arrays up to this size are hashed whole, larger ones sampled


# -- where in the user's code ----------------------------------------------------------------


def location(filename: str, lineno: int) -> str:
    """`file:line (`code`)`: where a message points in the user's code."""
    code = linecache.getline(filename, lineno).strip()
    return f"{filename}:{lineno}" + (f" (`{code}`)" if code else "")


def caller_location() -> str | None:
    """`file:line (`code`)` of the innermost frame of the user's code now running."""
    found = user_frame()
    return None if found is None else location(*found)


def _source_line(fn: Any, wanted) -> str | None:
    """The first line of `fn`'s source holding a node for which `wanted(node)` holds (else its
    `def` line), as `file:line (`code`)`; None without source."""
    try:
        fn = getattr(fn, "func", fn)  # a functools.partial
        fn = inspect.unwrap(getattr(fn, "__func__", fn))
        filename = inspect.getsourcefile(fn)
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    hits = sorted(node.lineno for node in ast.walk(tree)
                  if hasattr(node, "lineno") and wanted(node))
    return location(filename, first + (hits[0] if hits else 1) - 1)


# -- host state summaries ----------------------------------------------------------------------


@dataclasses.dataclass
class _Summary:
    """What a snapshot saw: `tokens[path]` compares, `shown[path]` describes; `keep` holds the
    objects compared by identity alive (so their ids are not reused)."""

    tokens: dict[str, Any] = dataclasses.field(default_factory=dict)
    shown: dict[str, str] = dataclasses.field(default_factory=dict)
    keep: list = dataclasses.field(default_factory=list)
    nodes: int = 0

    def add(self, path: str, token: Any, shown: str) -> None:
        self.tokens[path], self.shown[path] = token, shown


def _digest(x: np.ndarray) -> bytes:
    if x.dtype == object:
        return repr(x.tolist()).encode()
    data = np.ascontiguousarray(x).view(np.uint8).reshape(-1)
    if data.size > _DIGEST_BYTES:
        data = data[:: data.size // _DIGEST_BYTES + 1]
    return hashlib.blake2b(data.tobytes(), digest_size=16).digest()


def _summarize(path: str, value: Any, out: _Summary, deep: bool, depth: int = 0,
               seen: set | None = None) -> None:
    """Adds `value` (and, below it, its items) to `out`. `deep`: follow plain objects too."""
    seen = set() if seen is None else seen
    out.nodes += 1
    if out.nodes > _MAX_NODES:
        return
    if isinstance(value, jax.core.Tracer):
        out.add(path, ("traced", id(value)), "a traced value")
        out.keep.append(value)
    elif value is None or isinstance(value, bool | int | float | complex | str | bytes):
        out.add(path, (type(value).__name__, repr(value)), repr(value)[:60])
    elif isinstance(value, np.ndarray | np.generic):
        x = np.asarray(value)
        out.add(path, ("ndarray", x.shape, str(x.dtype), _digest(x)),
                f"a NumPy array {x.shape} {x.dtype}" if x.ndim else repr(value))
    elif isinstance(value, jax.Array):
        out.add(path, ("array", id(value)), f"a jax array {value.shape} {value.dtype}")
        out.keep.append(value)
    elif isinstance(value, nnx.Module | nnx.Variable):
        leaves = jax.tree.leaves(nnx.state(value) if isinstance(value, nnx.Module)
                                 else value.get_value())
        out.add(path, ("nnx", id(value), tuple(id(x) for x in leaves)),
                f"a {type(value).__name__} ({len(leaves)} arrays)")
        out.keep.append((value, leaves))
    elif id(value) in seen or depth >= _MAX_DEPTH:
        out.add(path, ("object", id(value)), f"a {type(value).__name__}")
        out.keep.append(value)
    elif isinstance(value, random.Random):
        out.add(path, ("random", value.getstate()), "a random.Random")
    elif isinstance(value, np.random.Generator | np.random.RandomState):
        state = (value.bit_generator.state if isinstance(value, np.random.Generator)
                 else value.get_state(legacy=False))
        _summarize(path, state, out, deep, depth + 1, seen)
    elif isinstance(value, list | tuple | deque | Mapping | set | frozenset):
        seen.add(id(value))
        items = (value.items() if isinstance(value, Mapping)
                 else enumerate(sorted(value, key=repr) if isinstance(value, set | frozenset)
                                else value))
        out.add(path, (type(value).__name__, len(value)),
                f"a {type(value).__name__} of {len(value)}")
        for key, item in items:
            _summarize(f"{path}[{key!r}]", item, out, deep, depth + 1, seen)
    elif (deep and hasattr(value, "__dict__")
          and not isinstance(value, type | types.ModuleType | types.FunctionType
                             | types.MethodType)
          and not type(value).__module__.startswith("jaxlight.")
          # Data (an iterable or iterator): the prefetching thread may read it during a trace.
          and not hasattr(type(value), "__iter__") and not hasattr(type(value), "__next__")):
        seen.add(id(value))
        out.add(path, ("object", id(value)), f"a {type(value).__name__}")
        out.keep.append(value)
        for name, item in vars(value).items():
            _summarize(f"{path}.{name}", item, out, deep, depth + 1, seen)
    else:
        out.add(path, ("object", id(value)), f"a {type(value).__name__}")
        out.keep.append(value)


def _host_state(module: Any) -> _Summary:
    """Everything a step could change on the host: `self`'s attributes (deep), and NumPy's
    and Python's global random states."""
    out, seen = _Summary(), set()  # an object reachable twice is followed once
    for name, value in list(vars(module).items()):
        if name not in INTERNAL:
            try:
                _summarize(f"self.{name}", value, out, deep=True, seen=seen)
            except Exception:  # noqa: BLE001 - an object that cannot be read is not compared
                out.add(f"self.{name}", ("unreadable", id(value)), "")
    state = np.random.get_state(legacy=False)
    out.add("numpy.random's global state (np.random.*)",
            ("np.random", _digest(state["state"]["key"]), state["state"]["pos"]), "")
    out.add("Python's global random state (random.*)", ("random", random.getstate()), "")
    return out


def _changes(before: _Summary, after: _Summary) -> list[tuple[str, str, str]]:
    """`(path, was, now)` for each changed path whose parent did not change."""
    changed = sorted(p for p in before.tokens.keys() | after.tokens.keys()
                     if before.tokens.get(p) != after.tokens.get(p))
    top = [p for p in changed if not any(p != q and p.startswith(q) for q in changed)]
    return [(p, before.shown.get(p, "absent"), after.shown.get(p, "absent")) for p in top]


# -- watching one call into a user step --------------------------------------------------------


@dataclasses.dataclass
class _Watch:
    module: Any
    assignments: dict[str, str] = dataclasses.field(default_factory=dict)
    reads: set[str] = dataclasses.field(default_factory=set)


_WATCH: contextvars.ContextVar[_Watch | None] = contextvars.ContextVar("jaxlight_watch",
                                                                       default=None)
def _recorder(cls: type) -> type:
    """A subclass of `cls` that notes every instance attribute read while a step is traced
    (made per trace, so that no class outlives the fit that traced it)."""
    def __getattribute__(self, name, _get=cls.__getattribute__):
        watch = _WATCH.get()
        if (watch is not None and watch.module is self and name not in INTERNAL
                and name in object.__getattribute__(self, "__dict__")):
            watch.reads.add(name)
        return _get(self, name)

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                       "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def watching() -> bool:
    """Whether a user step is being traced now (by `watch`)."""
    return _WATCH.get() is not None


def note_assignment(name: str) -> None:
    """Called by `TrainModule.__setattr__` while a step is traced: where `self.name` was set."""
    watch = _WATCH.get()
    if watch is not None and name not in watch.assignments:
        watch.assignments[name] = caller_location() or ""


@contextlib.contextmanager
def watch(module: Any, where: str, fn: Any) -> Iterator[None]:
    """Around one call into a user step while it is traced (see the module docstring)."""
    if module is None or not hasattr(module, "__dict__") or watching():
        yield
        return
    before = _host_state(module)
    cls = type(module)
    token = _WATCH.set(_Watch(module))
    module.__class__ = _recorder(cls)
    try:
        yield
        watched = _WATCH.get()
    finally:
        module.__class__ = cls
        _WATCH.reset(token)
    _refuse_host_changes(module, where, fn, before, _host_state(module), watched)
    _remember_reads(module, where, watched.reads)


def _refuse_host_changes(module, where: str, fn, before: _Summary, after: _Summary,
                         watched: _Watch) -> None:
    # A functools.cached_property computed for the first time is a cache, not a side effect.
    cached = {f"self.{n}" for c in type(module).__mro__ for n, v in vars(c).items()
              if isinstance(v, functools.cached_property)}
    changes = [c for c in _changes(before, after) if not (c[0] in cached and c[1] == "absent")]
    if not changes:
        return
    groups: dict[str, list] = {}  # per attribute of self (or global random state)
    for path, was, now in changes:
        attr = path[len("self."):].split(".")[0].split("[")[0] if path.startswith("self.") else None
        groups.setdefault(f"self.{attr}" if attr else path, []).append((path, was, now))
    lines = []
    for key, items in list(groups.items())[:6]:
        attr = key[len("self."):] if key.startswith("self.") else None
        if attr is not None and watched.assignments.get(attr):
            at = watched.assignments[attr]
        elif attr is not None:
            at = _source_line(fn, lambda n, a=attr: isinstance(n, ast.Attribute) and n.attr == a)
        else:
            at = _source_line(fn, lambda n: isinstance(n, ast.Attribute) and n.attr in (
                "random", "rand", "randn", "randint", "choice", "shuffle", "normal", "uniform",
                "sample", "permutation"))
        if len(items) == 1:
            path, was, now = items[0]
            change = f"{path}: {was} -> {now}" if was or now else f"{path}: advanced"
        else:  # several fields of one object: name them
            fields = dict.fromkeys(re.split(r"[.\[]", p[len(key):].lstrip("."), maxsplit=1)[0]
                                   or p[len(key):] for p, _, _ in items)
            change = f"{key}: {', '.join(fields)} changed"
        lines.append(f"  {change}" + (f", at {at}" if at else ""))
    more = f"\n  ... and {len(groups) - 6} more" if len(groups) > 6 else ""
    raise PortingError(
        f"{where} changed host state while jaxlight traced it:\n" + "\n".join(lines) + more
        + "\nA step is traced once and compiled: this Python ran once, at the trace, not at "
        "every step (an environment stepped there steps once per fit, a counter on self counts "
        "once, a NumPy or random draw is drawn once and compiled in as a constant). Move host "
        "work out of the step: step an environment or draw host randomness in a hook "
        "(on_train_batch_start) or in the data, and pass what the step needs in the batch; "
        "draw randomness inside the step with jax.random (a key from the model's nnx.Rngs or "
        f"from the batch); log host values from a hook with self.log. See {GUIDE} and "
        "docs/rl.md."
    )


# -- what compiled steps read from self --------------------------------------------------------


def _remember_reads(module, where: str, names: set[str]) -> None:
    """Records the attributes the step read (their arrays, networks and numbers) on the module
    until its compiled steps are forgotten (`forget_reads`)."""
    if not names:
        return
    reads = module.__dict__.setdefault("_step_reads", {})
    for name in sorted(names):
        if name in reads or name not in vars(module):
            continue
        summary = _Summary()
        _summarize(f"self.{name}", vars(module)[name], summary, deep=False)
        reads[name] = (where, summary)


def forget_reads(module: Any) -> None:
    """The compiled steps of `module` are gone (a new fit set-up): what they read no longer
    matters."""
    module.__dict__.pop("_step_reads", None)


def _read_by(module: Any, name: str) -> str | None:
    reads = module.__dict__.get("_step_reads")
    entry = reads.get(name) if reads else None
    return entry[0] if entry else None


def refuse_assignment(module: Any, name: str, value: Any) -> None:
    """Refuses giving `self.name` another value once a compiled step read it (called by
    `TrainModule.__setattr__` outside steps while a stage runs; between stages an assignment
    is allowed, and the next stage compiles its steps again: `changed_reads`)."""
    where = _read_by(module, name)
    if where is None or not is_user_file(sys._getframe(2).f_code.co_filename):
        return  # jaxlight's own assignments (a tuner's rate) are followed by a new set-up
    old = module.__dict__.get(name)
    if value is old:
        return
    if isinstance(value, bool | int | float | str) and type(value) is type(old) and value == old:
        return
    at = caller_location()
    raise PortingError(
        f"self.{name} = ... {f'at {at} ' if at else ''}assigns a new {type(value).__name__} to "
        f"an attribute that the compiled {where} read when it was traced: the compiled step "
        f"holds the old value as a constant, so the new one would never reach it (a target "
        f"network re-synced from a hook would never update). For a network synced with "
        f"another, {SYNCED}. For a value that changes during training, pass it in the batch, "
        f"or compute it inside the step from the model's variables or an optax schedule. "
        f"See {GUIDE}."
    )


def changed_reads(module: Any) -> list[tuple[str, str, str, str]]:
    """`(step, path, was, now)` for each attribute on `self` a compiled step read whose arrays,
    networks or numbers changed since (empty when none did)."""
    out = []
    for name, (where, summary) in (module.__dict__.get("_step_reads") or {}).items():
        now = _Summary()
        _summarize(f"self.{name}", vars(module).get(name), now, deep=False)
        out.extend((where, *change) for change in _changes(summary, now)[:1])
    return out


def check_reads(module: Any, when: str) -> None:
    """Refuses arrays, networks or numbers on `self` that changed since a compiled step read
    them (an in-place `nnx.update(self.target, ...)` in a hook); `when`: for the message."""
    for where, path, was, is_ in changed_reads(module)[:1]:
        raise PortingError(
            f"{path} changed ({was} -> {is_}, or its arrays replaced in place) by {when}, but "
            f"the compiled {where} read it when it was traced and holds the value it saw then "
            f"as a constant: the change never reaches the step (a target network synced from a "
            f"hook never updates). For a network synced with another, {SYNCED}. See {GUIDE}."
        )


# -- frozen parameters -----------------------------------------------------------------------


def check_frozen_writes(kept: Any, out: Any, mask: Any, where: str, trainable: Any) -> None:
    """Refuses a step that assigned to a frozen variable (`mask`: `ModelSpec.frozen`): the
    step carries out its value as it came in, so the write would be dropped. `kept`/`out`: the
    `rest` dicts the step received and produced (their leaves are tracers, compared by
    identity: a variable the step did not assign is the very tracer it received)."""
    written = []

    def visit(path, m, a, b):
        if isinstance(m, Mapping):
            for k, sub in m.items():
                if isinstance(a, Mapping) and isinstance(b, Mapping) and k in a and k in b:
                    visit(f"{path}.{k}", sub, a[k], b[k])
        elif m and a is not b:
            written.append(path.lstrip("."))

    visit("", mask, kept, out)
    if written:
        shown = ", ".join(f"model.{p}" for p in written[:4])
        more = f" and {len(written) - 4} more" if len(written) > 4 else ""
        raise PortingError(
            f"{where} assigned to {shown}{more}, frozen parameters: trainable={trainable!r} "
            "leaves them out of training, and the step carries them out as they came in (a "
            "frozen reference is never changed by the step), so the write would be dropped "
            f"without a word. For a copy that follows the trained network, {SYNCED}; it is not "
            f"an nnx.Param, so the step carries what it writes. See {GUIDE}."
        )
