"""Which of Lightning's public names jaxlight shares, and which conformance case covers each.

The names come from the two sides' own signatures, not from a list: `fixtures/signatures.json`
(written by `lightning_side/signatures.py` from Lightning's classes) intersected with what
`inspect` finds on jaxlight's. A shared name is a *unit*:

- `Fit(max_epochs)`: an `__init__` argument both classes take;
- `Fit.fit`, `Fit.fit(ckpt_path)`: a method both define, and each argument both signatures name;
- `Fit.global_step`: a property (or attribute) both define;
- `DeviceStatsMonitor`: a class shared by name with no shared argument or member of its own.

Lightning's classes are paired with jaxlight's by name (`callbacks.X`, `loggers.X` with
`jaxlight.callbacks.X`), and the four with other names by `PAIRS`. A member that a paired base
class also has is a unit of the base only (a callback's overrides of `Callback`'s hooks are
`Callback`'s; `BackboneFinetuning.freeze` is `BaseFinetuning.freeze`).

Each unit is covered by the conformance tests that name it in `@covers(...)`
(`tests/conformance/_cases.py`): a case (it shows jaxlight does as Lightning) or a pinned
departure (`@departure`: it asserts the measured difference and names porting.md's section).
`tests/conformance/test_coverage.py` fails on a unit that no test covers, and `table.py`
writes porting.md's coverage table from `coverage_rows()`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pathlib
import re

HERE = pathlib.Path(__file__).resolve().parent
SIGNATURES = HERE / "fixtures" / "signatures.json"

#: Lightning class -> jaxlight's name for it, where the names differ.
PAIRS = {"Trainer": "Fit", "LightningModule": "TrainModule", "LightningDataModule": "DataModule",
         "Tuner": "Tuner"}


def _jaxlight_class(name: str):
    import jaxlight as jl
    from jaxlight import callbacks

    if name in jl.__all__:
        return getattr(jl, name)
    return getattr(callbacks, name) if name in callbacks.__all__ else None


def arguments(fn) -> dict | None:
    """Argument -> repr of its default (None when it has none); self, *args, **kwargs left out.
    (lightning_side/signatures.py reads Lightning's signatures with it too.)"""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    return {p.name: None if p.default is p.empty else re.sub(r" at 0x\w+", "", repr(p.default))
            for p in sig.parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _has(cls, name: str) -> bool:
    """`cls` defines `name` as a public attribute (a method, a property, a class attribute), or
    sets it in `__init__` (an instance attribute such as a callback's `stopped_epoch`)."""
    if hasattr(cls, name):
        return True
    try:
        source = inspect.getsource(cls.__init__)
    except (TypeError, OSError):
        return False
    return f"self.{name} =" in source or f"self.{name}:" in source


def shared_units() -> dict[str, dict]:
    """Unit -> {"lightning": Lightning's spelling, "owner": jaxlight's class name,
    "lightning_default"/"jaxlight_default": reprs of an argument's defaults (None: required)}."""
    signatures = json.loads(SIGNATURES.read_text())["cases"]
    paired = {}
    for lname in signatures:
        owner = PAIRS.get(lname, lname.split(".", 1)[-1] if "." in lname else None)
        if owner and _jaxlight_class(owner) is not None:
            paired[lname] = owner
    units: dict[str, dict] = {}
    for lname, entry in sorted(signatures.items()):
        if lname not in paired:
            continue
        short, owner = lname.split(".", 1)[-1], paired[lname]
        cls = _jaxlight_class(owner)
        inherited = {m for base in entry["bases"] if base in paired
                     for m in signatures[base]["members"]}
        found = []
        init = arguments(cls.__init__) or {}
        if lname != "Tuner":  # Tuner(trainer) / Tuner(fit): the same argument, two names
            for arg, default in (entry["init"] or {}).items():
                if arg in init:
                    found.append((f"{owner}({arg})", f"{short}({arg})", default, init[arg]))
        for member, largs in sorted(entry["members"].items()):
            if member.startswith("_") or member in inherited or not _has(cls, member):
                continue
            found.append((f"{owner}.{member}", f"{short}.{member}", None, None))
            value = inspect.getattr_static(cls, member, None)
            if largs == "property" or not callable(getattr(cls, member, None)) or \
                    isinstance(value, property):
                continue
            jargs = arguments(getattr(cls, member)) or {}
            for arg, default in (largs or {}).items():
                if arg in jargs:
                    found.append((f"{owner}.{member}({arg})", f"{short}.{member}({arg})",
                                  default, jargs[arg]))
        if not found:
            found.append((owner, short, None, None))
        for unit, lspell, ldefault, jdefault in found:
            units[unit] = {"lightning": lspell, "owner": owner,
                           "lightning_default": ldefault, "jaxlight_default": jdefault}
    return units


def test_modules() -> list:
    """Every `tests/conformance/test_*.py` module, imported."""
    return [importlib.import_module(f"tests.conformance.{p.stem}")
            for p in sorted(HERE.glob("test_*.py"))]


def covering_tests() -> dict[str, list[dict]]:
    """Unit -> the tests that name it in `@covers`: {"test": "group/test_name", "departure":
    porting.md's section or None}."""
    out: dict[str, list[dict]] = {}
    for module in test_modules():
        group = module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
        for name, fn in sorted(vars(module).items()):
            units = getattr(fn, "covers", None)
            if not name.startswith("test_") or units is None:
                continue
            meta = getattr(fn, "conformance", None) or {}
            for unit in units:
                out.setdefault(unit, []).append({
                    "test": f"{group}/{name.removeprefix('test_')}",
                    "departure": meta.get("departure")})
    return out


def coverage_rows() -> list[dict]:
    """One row per shared unit: its names, and the covering tests (empty when uncovered)."""
    cover = covering_tests()
    return [{"unit": unit, **info, "tests": cover.get(unit, [])}
            for unit, info in shared_units().items()]
