"""The persistent compilation cache: real processes write it, a second process reads every step.

The suite runs with the cache off (conftest); these tests give each child process its own
temporary cache directory, so the user's cache is never touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxlight._errors import ConfigurationError
from jaxlight._fit import _cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A small fit, validate and predict; reports which compiled programs the persistent cache
# served (hits) and which it had to compile (misses), by module name, from JAX's own log.
CHILD = r"""
import json, logging, sys
import numpy as np, optax
from flax import nnx
import jaxlight as jl

hits, misses = [], []
class Seen(logging.Handler):
    def emit(self, record):
        text = record.getMessage()
        name = text.split("'")[1] if "'" in text else text
        if text.startswith("Persistent compilation cache hit"):
            hits.append(name)
        elif text.startswith("PERSISTENT COMPILATION CACHE MISS"):
            misses.append(name)
log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG)
log.addHandler(Seen())

class Tiny(jl.TrainModule):
    def configure_model(self, rngs):
        return nnx.Linear(8, 4, rngs=rngs)
    def configure_optimizers(self):
        return optax.adam(1e-2)
    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()
    def validation_step(self, model, batch):
        return {"loss": ((model(batch["x"]) - batch["y"]) ** 2).mean()}
    def predict_step(self, model, batch):
        return model(batch["x"])

rng = np.random.default_rng(0)
data = jl.data.ArrayLoader({"x": rng.normal(size=(32, 8)).astype(np.float32),
                            "y": rng.normal(size=(32, 4)).astype(np.float32)}, 8)
setting = json.loads(sys.argv[1])
kwargs = {} if setting is None else {"compilation_cache": setting}
# No checkpoint: orbax's import gives the root logger a handler, which would print the
# compiler's DEBUG records this process asks for (and the checks read stderr).
fit = jl.Fit("single", max_steps=3, enable_progress_bar=False, enable_model_summary=False,
             logger=False, enable_checkpointing=False, **kwargs)
module = Tiny()
fit.fit(module, data, data)
fit.validate(module, data)
fit.predict(module, data)
print("RESULT " + json.dumps({"dir": fit.compilation_cache_dir, "hits": hits,
                              "misses": misses, "compiles": fit.compile_counts}))
"""


def _spawn(setting, env_extra=None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in (_cache.ENV, "JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update({"PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", **(env_extra or {})})
    return subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(setting)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    # A torn or unreadable entry shows up as JAX's "Error reading persistent compilation cache".
    assert "persistent compilation cache" not in err.lower(), err[-3000:]
    line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _entries(path) -> list[str]:
    return [n for n in os.listdir(path) if not n.startswith(".") and not n.endswith("-atime")]


@pytest.mark.slow
def test_second_process_reads_every_step_from_the_cache(tmp_path):
    cache = str(tmp_path / "xla")
    # Two processes start on an empty directory at once: each compiles what it does not
    # find (yet) and writes it; neither may read a torn entry (checked in _result).
    first = [_result(p) for p in [_spawn(cache), _spawn(cache)]]
    assert all(r["dir"] == cache for r in first)
    assert any("jit_train_step" in r["misses"] for r in first), first
    written = _entries(cache)
    assert len(written) >= 4, written
    warm = _result(_spawn(cache))
    assert not warm["misses"], warm
    # init, train, eval and predict steps all come from disk.
    served = " ".join(warm["hits"])
    for kind in ("init", "train", "eval", "predict"):
        assert kind in served, (kind, warm["hits"])
    assert sorted(_entries(cache)) == sorted(written)


@pytest.mark.slow
def test_default_directory_and_environment(tmp_path):
    xdg = tmp_path / "xdg"
    r = _result(_spawn(None, {"XDG_CACHE_HOME": str(xdg)}))
    assert r["dir"] == str(xdg / "jaxlight" / "xla")
    assert _entries(r["dir"])
    moved = tmp_path / "moved"
    r = _result(_spawn(None, {_cache.ENV: str(moved), "XDG_CACHE_HOME": str(xdg)}))
    assert r["dir"] == str(moved) and _entries(moved)


@pytest.mark.slow
def test_off_writes_nothing(tmp_path):
    xdg = tmp_path / "xdg"
    r = _result(_spawn(False, {"XDG_CACHE_HOME": str(xdg)}))
    assert r["dir"] is None and not r["hits"] and not r["misses"]
    assert not (xdg / "jaxlight").exists()
    r = _result(_spawn(None, {_cache.ENV: "off", "XDG_CACHE_HOME": str(xdg)}))
    assert r["dir"] is None and not (xdg / "jaxlight").exists()


def test_resolve_rules(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(_cache.ENV, raising=False)
    assert _cache.default_dir() == str(tmp_path / "jaxlight" / "xla")
    assert _cache.resolve(True) == _cache.default_dir()
    assert _cache.resolve(False) is False
    assert _cache.resolve("off") is False
    assert _cache.resolve(tmp_path / "x") == str(tmp_path / "x")
    monkeypatch.setenv(_cache.ENV, str(tmp_path / "env"))
    assert _cache.resolve(None) == str(tmp_path / "env")
    assert _cache.resolve(tmp_path / "arg") == str(tmp_path / "arg")  # the argument wins
    monkeypatch.setenv(_cache.ENV, "0")
    assert _cache.resolve(None) is False


def test_uncreatable_directory_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigurationError, match="compilation cache directory"):
        _cache.configure(blocker / "xla")


def test_trim_removes_the_least_recently_used_entries_past_the_bound(tmp_path):
    # Five entries of 100 bytes, used at times 1..5 (JAX's -atime companions beside two).
    for i in range(5):
        entry = tmp_path / f"key{i}-cache"
        entry.write_bytes(b"x" * 100)
        os.utime(entry, (i + 1, i + 1))
    (tmp_path / "key0-atime").write_bytes(b"t")
    (tmp_path / "key4-atime").write_bytes(b"t")
    (tmp_path / ".lockfile").write_bytes(b"")
    assert _cache.trim(str(tmp_path), max_bytes=500) == 0
    assert _cache.trim(str(tmp_path), max_bytes=250) == 300
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".lockfile", "key3-cache", "key4-atime", "key4-cache"], left
    assert _cache.trim(str(tmp_path / "missing"), max_bytes=0) == 0


def test_jax_does_not_scan_the_directory_on_every_write(tmp_path, monkeypatch):
    """JAX's own size bound lists every entry on every write (time linear in the entries, per
    compile); jaxlight leaves JAX's cache unbounded and trims the directory itself, once."""
    import jax

    monkeypatch.delenv("JAX_COMPILATION_CACHE_MAX_SIZE", raising=False)
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache,
              jax.config.jax_compilation_cache_max_size, _cache._configured)
    big = tmp_path / "xla"
    big.mkdir()
    for i in range(3):
        (big / f"old{i}-cache").write_bytes(b"x" * 10)
    monkeypatch.setattr(_cache, "MAX_BYTES", 15)
    try:
        assert _cache.configure(big) == str(big)
        assert jax.config.jax_compilation_cache_max_size == -1
        assert len(list(big.glob("*-cache"))) == 1  # trimmed to the bound when configured
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_enable_compilation_cache", before[1])
        jax.config.update("jax_compilation_cache_max_size", before[2])
        _cache._configured = before[3]
        from jax.experimental.compilation_cache import compilation_cache as cc
        cc.reset_cache()
