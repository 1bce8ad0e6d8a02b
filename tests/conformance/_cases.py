"""The conformance suite's bookkeeping: fixtures, case claims, departures, the results file.

Every test in `tests/conformance/test_<group>.py` is one case: `@claim("...")` says in words
what it shows (a sentence of porting.md's conformance table); `@departure("...", section=...)`
marks a case that pins a deliberate difference from Lightning and names the docs/porting.md
section that explains it. `@covers("Fit(max_epochs)", ...)` names the shared arguments and
methods a test exercises against Lightning (`_coverage.py` lists them from both sides'
signatures; `test_coverage.py` fails on one no test covers). The conftest beside this file
records each case's outcome; with `JAXLIGHT_CONFORMANCE_RESULTS=path` set, it writes them all
to that JSON file
(`make conformance` writes `tests/conformance/results.json`, from which
`tests/conformance/table.py` writes porting.md's table).
"""

from __future__ import annotations

import difflib
import functools
import json
import pathlib
import re

import pytest

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"


@functools.cache
def fixture(group: str) -> dict:
    """fixtures/<group>.json, written by lightning_side/<group>.py under Lightning."""
    return json.loads((FIXTURES / f"{group}.json").read_text())


def case(group: str, case_id: str) -> dict:
    """What Lightning showed for one case of a group."""
    return fixture(group)["cases"][case_id]


def claim(text: str):
    """Marks a test as a conformance case: `text` is what it shows jaxlight does as Lightning."""
    def mark(fn):
        fn.conformance = {"claim": text, "departure": None}
        return fn

    return mark


def departure(text: str, section: str):
    """Marks a test that pins a deliberate departure: `text` says what differs, `section` is
    the docs/porting.md heading that explains it (the test fails if the page lacks it)."""
    heading = section.lstrip("#").strip()

    def mark(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            porting = (HERE.parent.parent / "docs" / "porting.md").read_text()
            assert re.search(rf"^#+ {re.escape(heading)}$", porting, re.M), (
                f"the departure names docs/porting.md section {heading!r}, which the page lacks")
            return fn(*args, **kwargs)

        run.conformance = {"claim": text, "departure": heading}
        return run

    return mark


def covers(*units: str):
    """Names the shared units (`_coverage.py`'s spelling: `Fit(max_epochs)`, `Fit.fit(ckpt_path)`,
    `EarlyStopping(patience)`, `Callback.on_fit_start`) this test compares with Lightning."""
    def mark(fn):
        fn.covers = (*getattr(fn, "covers", ()), *units)
        return fn

    return mark


def assert_sequence(got: list, expected: list, what: str = "calls") -> None:
    """Equal sequences, or a failure showing the diff (- Lightning, + jaxlight)."""
    if list(got) != list(expected):
        diff = "\n".join(difflib.unified_diff([str(x) for x in expected], [str(x) for x in got],
                                              "lightning", "jaxlight", lineterm="", n=2))
        raise AssertionError(f"{what} differ from Lightning's:\n{diff}")


def known_difference(reason: str):
    """A difference from Lightning not fixed yet: a strict xfail, so the case flips to a failure
    (and must lose this mark) the day jaxlight matches Lightning. `reason` names the difference."""
    return pytest.mark.xfail(strict=True, reason=reason)


def cases_of(names, known: dict[str, str]):
    """Parametrize values: each name, with `known_difference(known[name])` where listed."""
    unknown = set(known) - set(names)
    assert not unknown, f"known differences name no case: {sorted(unknown)}"
    return [pytest.param(n, marks=known_difference(known[n])) if n in known else n
            for n in names]
