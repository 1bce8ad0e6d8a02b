"""The persistent compilation cache: a re-run loads its compiled steps from disk.

`Fit` turns JAX's persistent compilation cache on by default, so that a second run of the same
program (same model, shapes, strategy, devices, jax and XLA flags) skips XLA's compiles of the
init, train, eval and predict steps. Where the cache lives, first match wins:

1. `Fit(compilation_cache=...)` / `--compilation-cache`: a directory, `True` (the default
   directory), or `False` (off);
2. the environment variable `JAXLIGHT_COMPILATION_CACHE`: a directory, or `0`/`off`/`false`;
3. JAX's own setting, when the user made one (`JAX_COMPILATION_CACHE_DIR` or
   `jax.config.update("jax_compilation_cache_dir", ...)`): left as it is;
4. `$XDG_CACHE_HOME/jaxlight/xla`, else `~/.cache/jaxlight/xla`.

The cache is process-wide (JAX has one): the last `Fit` constructed decides it. Entries are
written whatever their compile time (JAX's default skips compiles under 1 s, which is every
compile of a small model on CPU). The directory is kept to `MAX_BYTES` by jaxlight, least
recently used entries first, once per process when a `Fit` first configures it (`trim`): JAX's
own bound (`jax_compilation_cache_max_size`) lists and reads every entry of the directory on
every write, so each compile cost time linear in the entries (measured with JAX's LRU:
52 / 312 / 468 ms per write at 1,000 / 2,000 / 3,000 entries, on a loaded 2-core machine) and
a run that compiles many programs paid it quadratically. JAX writes unbounded entries without a
lock; several processes may share the directory (a torn read of an entry another process is
writing is reported by JAX and compiled again). Within one multi-process job only process 0
writes (JAX's rule). A `JAX_COMPILATION_CACHE_MAX_SIZE` the user set is left to JAX. The
cache is trusted code: it is created readable by its owner only.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache as cc

from jaxlight._errors import ConfigurationError

#: Environment variable that moves (a path) or disables (`0`, `off`, `false`, `no`) the cache.
ENV = "JAXLIGHT_COMPILATION_CACHE"

#: Size bound of the cache directory (least recently used entries are removed past it).
MAX_BYTES = 4 * 2**30

#: The file name ending of JAX's cache entries (and of the access times its own bound kept).
_ENTRY, _ATIME = "-cache", "-atime"

_OFF = {"0", "off", "false", "no", "none", ""}

#: The directory jaxlight last configured (None: jaxlight turned the cache off or never ran).
_configured: str | None = None


def cache_home() -> str:
    """jaxlight's cache folder: `$XDG_CACHE_HOME/jaxlight`, else `~/.cache/jaxlight`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxlight")


def default_dir() -> str:
    """`$XDG_CACHE_HOME/jaxlight/xla`, else `~/.cache/jaxlight/xla`."""
    return os.path.join(cache_home(), "xla")


def resolve(setting: Any = None) -> str | bool | None:
    """The cache directory `setting` asks for: a path, False (off) or None (JAX's own setting).

    Args:
        setting: `Fit(compilation_cache=...)`: None (environment, then JAX's setting, then the
            default directory), True (the default directory), False (off), or a path.
    """
    if setting is False:
        return False
    if setting is True:
        return default_dir()
    if setting is not None:
        text = os.fspath(setting)
        return False if text.strip().lower() in _OFF else os.path.abspath(os.path.expanduser(text))
    env = os.environ.get(ENV)
    if env is not None:
        return resolve(env if env.strip().lower() not in _OFF else False)
    if jax.config.jax_compilation_cache_dir and _configured is None:
        return None  # the user set JAX's cache: theirs to keep
    return default_dir()


def configure(setting: Any = None) -> str | None:
    """Applies `setting` (see `resolve`) to JAX; returns the cache directory in use, or None.

    Cheap when nothing changes. Refuses (ConfigurationError) a directory it cannot create.
    """
    global _configured
    target = resolve(setting)
    current = jax.config.jax_compilation_cache_dir
    enabled = jax.config.jax_enable_compilation_cache
    if target is None:
        return current if enabled else None
    if target is False:
        if enabled:  # also stops JAX hashing every program for a cache key
            jax.config.update("jax_enable_compilation_cache", False)
            cc.reset_cache()
        _configured = None
        return None
    try:
        os.makedirs(target, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ConfigurationError(
            f"cannot create the compilation cache directory {target!r} ({e.strerror}); pass "
            f"another directory with Fit(compilation_cache=PATH) or --compilation-cache PATH, "
            f"or turn the cache off with compilation_cache=False / {ENV}=off."
        ) from None
    if current == target and enabled and _configured == target:
        return target
    jax.config.update("jax_compilation_cache_dir", target)
    jax.config.update("jax_enable_compilation_cache", True)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ:
        jax.config.update("jax_compilation_cache_max_size", -1)  # unbounded: no scan per write
        trim(target, MAX_BYTES)
    cc.reset_cache()  # JAX opens its cache once; a new directory needs a fresh start
    _configured = target
    return target


def trim(directory: str, max_bytes: int) -> int:
    """Removes the least recently used entries of `directory` until it holds at most
    `max_bytes` of them; returns the bytes removed. One listing of the directory, done when a
    process first configures it (JAX's own bound lists it on every write)."""
    entries, total = [], 0
    try:
        with os.scandir(directory) as listing:
            for entry in listing:
                if entry.name.endswith(_ENTRY) and entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    entries.append((max(st.st_atime, st.st_mtime), entry.path, st.st_size))
                    total += st.st_size
    except OSError:
        return 0
    removed = 0
    for _, path, size in sorted(entries):
        if total - removed <= max_bytes:
            break
        for name in (path, path[:-len(_ENTRY)] + _ATIME):
            with contextlib.suppress(OSError):  # another process removed it first
                os.remove(name)
        removed += size
    return removed
