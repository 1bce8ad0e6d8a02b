"""Records every conformance case's outcome; writes them when JAXLIGHT_CONFORMANCE_RESULTS is
set (see `_cases.py`)."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from tests.conformance._cases import FIXTURES, fixture

_OUTCOMES: dict[str, dict] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    meta = getattr(getattr(item, "function", None), "conformance", None)
    if meta is None or (report.when != "call" and not report.failed and not report.skipped):
        return
    group = item.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    case_id = item.name.removeprefix("test_")
    key = f"{group}/{case_id}"
    if report.when == "call" or key not in _OUTCOMES:
        if hasattr(report, "wasxfail"):
            outcome = "known failure" if report.skipped else "passed (xfail)"
        elif report.passed:
            outcome = "departure" if meta["departure"] else "passed"
        else:
            outcome = "failed" if report.failed else "skipped"
        _OUTCOMES[key] = {"group": group, "case": case_id, **meta, "outcome": outcome,
                              "reason": getattr(report, "wasxfail", None)}


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("JAXLIGHT_CONFORMANCE_RESULTS")
    if not path or not _OUTCOMES:
        return
    # A group without a Lightning fixture of its own (no_oracle; tuner_arguments reads
    # arguments2's) has no versions to report.
    groups = sorted({o["group"] for o in _OUTCOMES.values()
                     if (FIXTURES / f"{o['group']}.json").exists()})
    versions = {g: {k: fixture(g).get(k) for k in ("torch", "lightning")} for g in groups}
    out = {"versions": versions,
           "cases": sorted(_OUTCOMES.values(), key=lambda o: (o["group"], o["case"]))}
    pathlib.Path(path).write_text(json.dumps(out, indent=1) + "\n")
