"""Every argument, method and property jaxlight shares with Lightning has a conformance case or a
pinned departure (`_coverage.py` lists them from both sides' signatures), so a new shared
argument cannot land without one; and porting.md's coverage table is the one `table.py` writes."""

from __future__ import annotations

from tests.conformance import _coverage, table


def test_every_shared_argument_has_a_case_or_a_departure():
    rows = _coverage.coverage_rows()
    missing = [r["unit"] + f"  (Lightning: {r['lightning']})" for r in rows if not r["tests"]]
    assert not missing, (
        f"{len(missing)} of the {len(rows)} names jaxlight shares with Lightning have no "
        "conformance case: add one (a lightning_side script beside tests/conformance/"
        "test_<group>.py) or a pinned @departure, and name the unit in its @covers(...):\n  "
        + "\n  ".join(missing))


def test_covers_names_only_shared_units():
    units = set(_coverage.shared_units())
    stale = {u: [t["test"] for t in tests] for u, tests in _coverage.covering_tests().items()
             if u not in units}
    assert not stale, (
        f"@covers names that are not shared with Lightning (misspelt, or no longer in both "
        f"signatures; _coverage.py's spelling is Fit(arg), Fit.method(arg), Owner.property): "
        f"{stale}")


def test_porting_coverage_table_is_current():
    page = table.PORTING.read_text()
    assert table.rewrite(page, table.render_coverage(_coverage.coverage_rows()),
                         table.COVERAGE) == page, (
        "docs/porting.md's argument coverage table is stale: run "
        "`python tests/conformance/table.py`")
