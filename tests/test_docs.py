"""Every code block of the user guide and the README runs.

Per page (docs/*.md, README.md): `python` blocks run top to bottom in one namespace; each line of
a `bash` block is a `jaxlight` command, run in this process through the CLI's `main` and required
to exit 0; a block (`yaml`, `json`, `python`, ...) right after `<!-- file: NAME -->` is written to
NAME first instead of being run; one after `<!-- save: NAME -->` is written to NAME and run (the
page's folder is importable, as a script's is). A block right after `<!-- skip: reason -->` is
not run; one after `<!-- needs: MODULE -->` runs wherever MODULE is installed (an optional
library jaxlight does not depend on, e.g. torch). Other fences (`text`, `sh`, `console`) are
output or shell the suite cannot run (`make test` inside the tests), and must not hide a
`jaxlight` command.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import pathlib
import re
import shlex
import sys

import jax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import Fit
from jaxlight._cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
_MARK = re.compile(r"<!--\s*(skip|file|save|needs):\s*(.*?)\s*-->\s*$")


def blocks(text: str) -> list[tuple[str, str, int, dict]]:
    """(language, body, line, marks) of every fenced block, marks from the comment above it."""
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = _MARK.search(before)
        marks = {mark.group(1): mark.group(2)} if mark else {}
        out.append((m.group(1), m.group(2), line, marks))
    return out


def commands(body: str) -> list[str]:
    """The commands of a bash block (comments dropped, backslash continuations joined)."""
    joined = body.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def run_page(path: pathlib.Path) -> None:
    # The page runs in a fresh folder that is importable, as a script's folder is, so a block
    # saved as a module (`<!-- save: NAME -->`) can be imported by the next ones.
    sys.path.insert(0, os.getcwd())
    try:
        _run_blocks(path)
    finally:
        sys.path.remove(os.getcwd())


def _run_blocks(path: pathlib.Path) -> None:
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for lang, body, line, marks in blocks(path.read_text()):
        where = f"{path.name}:{line}"
        if "skip" in marks:
            continue
        if "needs" in marks and importlib.util.find_spec(marks["needs"]) is None:
            continue
        if "file" in marks:
            pathlib.Path(marks["file"]).write_text(body)
            continue
        if "save" in marks:
            pathlib.Path(marks["save"]).write_text(body)
        if lang == "python":
            exec(compile(body, where, "exec"), namespace)  # noqa: S102 - the docs' own code
        elif lang == "bash":
            for command in commands(body):
                argv = shlex.split(command)
                assert argv[0] == "jaxlight", f"{where}: bash blocks hold jaxlight commands only"
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    status = main(argv[1:])
                assert status == 0, f"{where}: `{command}` exited {status}:\n{err.getvalue()}"
        else:
            hidden = [c for c in body.splitlines() if re.match(r"\s*(\$\s*)?jaxlight\s", c)]
            assert not hidden or lang == "text", (
                f"{where}: a `{lang}` block holds jaxlight commands {hidden}; put them in a "
                "`bash` block so they are tested, or mark the block <!-- skip: reason -->")


#: What `strategies.Auto`'s arguments set: a page's `Auto(...)` with other values is not `Fit()`.
AUTO_SETTINGS = ("memory_budget", "headroom", "table", "device", "layouts", "max_compiles",
                 "explore", "shortcut", "rules")


def on_default_path(fit: Fit) -> bool:
    """Whether a fit ran on `Fit()`'s path: strategy "auto" with its default settings, every
    device, default precision, a ModelCheckpoint saving."""
    auto, default = fit.auto, jl.strategies.Auto()
    return (auto is not None and fit.config["devices"] is None and fit.config["precision"] is None
            and all(getattr(auto, k) == getattr(default, k) for k in AUTO_SETTINGS)
            and any(isinstance(c, jl.callbacks.ModelCheckpoint) for c in fit.callbacks))


@contextlib.contextmanager
def recording_fits(fitted: dict):
    """Notes in `fitted` ("Class" -> (module, args, kwargs, default)) the module and data of the
    first `Fit.fit` of each class a page makes that trained (the fit itself runs as is; a page
    may show a refused module on purpose); `default` is whether one of the page's fits of that
    class trained on `Fit()`'s path (`on_default_path`)."""
    original = Fit.fit

    def fit(self, module, *args, **kwargs):
        out = original(self, module, *args, **kwargs)
        name = type(module).__qualname__
        first = fitted.get(name, (module, args, kwargs, False))
        fitted[name] = (*first[:3], first[3] or (on_default_path(self) and self.global_step >= 1))
        return out

    Fit.fit = fit
    try:
        yield
    finally:
        Fit.fit = original


def trains(path: pathlib.Path) -> bool:
    """Whether a page's code trains (a `.fit(` in a python block, `jaxlight fit` in a bash one):
    such pages are the whole suite's tier; the pages that only build, parse or print are fast."""
    return any((lang == "python" and ".fit(" in body)
               or (lang == "bash" and re.search(r"\bjaxlight (fit|launch)\b", body))
               for lang, body, _, _ in blocks(path.read_text()))


def model_signature(module) -> tuple:
    """A module's class name and the paths, shapes and dtypes of its state: two pages' copies of
    one model (the quickstart's `Classifier` shown again elsewhere) have the same signature."""
    leaves = []
    for name, value in sorted(vars(module).items()):
        if isinstance(value, nnx.Module):
            for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(value)):
                leaves.append((name, jax.tree_util.keystr(path), getattr(x, "shape", None),
                               str(getattr(x, "dtype", ""))))
    return type(module).__qualname__, tuple(leaves)


#: The models the default `Fit()` has trained in this process, by signature: a model a later page
#: shows again (the quickstart's `Classifier`) is not trained twice.
DEFAULT_FIT_DONE: set[tuple] = set()


def default_fit(key: str, module, args: tuple, kwargs: dict) -> None:
    """`Fit()` (strategy "auto") trains the module a page trained, whatever strategy the page
    chose: two steps, models with RNG streams (Dropout, the strategies page's `Noisy`) included,
    with the default checkpoint (a model whose state orbax could not save would crash `Fit()`)."""
    data = args[0] if args else kwargs.get("train_data")
    val = args[1] if len(args) > 1 else kwargs.get("val_data")  # a plateau monitor reads it
    fit = jl.Fit(max_steps=2, enable_progress_bar=False, logger=False,
                 enable_model_summary=False, num_sanity_val_steps=0)
    try:
        fit.fit(module, data, val, datamodule=kwargs.get("datamodule"))
    except Exception as err:
        raise AssertionError(f"the default Fit() failed on {key}: {err!r}") from err
    assert fit.global_step == 2, key
    assert isinstance(fit.strategy, jl.strategies.Strategy), key


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow) if trains(p) else p
                                  for p in PAGES], ids=[p.name for p in PAGES])
def test_page_runs(path, tmp_path, monkeypatch):
    """The page's blocks run; then the documented default path, `Fit()` with no arguments,
    trains every model the page trained (each distinct model once per process), unless one of
    the page's own fits of it was on that path already."""
    fitted: dict[str, tuple] = {}
    with recording_fits(fitted):
        run_page(path)
    if any(lang == "python" and ".fit(" in body for lang, body, _, _ in blocks(path.read_text())):
        assert fitted, f"{path.name} calls .fit( but no fit trained: the recording missed it"
    (tmp_path / "default_fit").mkdir()
    monkeypatch.chdir(tmp_path / "default_fit")
    for name, (module, args, kwargs, default) in sorted(fitted.items()):
        signature = model_signature(module)
        if signature not in DEFAULT_FIT_DONE:
            DEFAULT_FIT_DONE.add(signature)
            if not default:  # the page trained it on the default path already
                default_fit(f"{path.name}:{name}", module, args, kwargs)


def test_the_guide_links_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    for page in PAGES:
        if page.parent.name == "docs" and page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"


def test_readme_opens_with_the_two_commands_and_the_makefile_runs_the_demo():
    readme = (ROOT / "README.md").read_text()
    lang, body, _, _ = blocks(readme)[0]
    assert [c.split("#")[0].strip() for c in commands(body)] == ["make demo", "make test"]
    assert readme.index("```") < readme.index("\n## "), "the commands come before any section"
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"^demo:.*\n\t(.*)$", makefile, re.M).group(1)
    assert demo.endswith("jaxlight fit digits --strategy dp")
    assert "--xla_force_host_platform_device_count=8" in makefile
    assert "## Benchmarks" in readme


def test_only_fits_on_the_default_path_stand_for_the_default_fit():
    """A page's fit stands for `default_fit` only when it was `Fit()`'s layout."""
    assert on_default_path(jl.Fit())
    assert on_default_path(jl.Fit("auto", max_steps=3, logger=False))
    for other in (jl.Fit("dp"), jl.Fit(devices=2), jl.Fit(precision="bf16-mixed"),
                  jl.Fit(enable_checkpointing=False),
                  jl.Fit(jl.strategies.Auto(max_compiles=1)), jl.Fit(jl.strategies.FSDP())):
        assert not on_default_path(other), other.config
