"""docs/porting.md's conformance table is the one table.py writes from the committed results."""

from __future__ import annotations

import json

from tests.conformance import table


def test_porting_table_matches_results():
    results = json.loads(table.RESULTS.read_text())
    page = table.PORTING.read_text()
    assert table.rewrite(page, table.render(results)) == page, (
        "docs/porting.md's conformance table is stale: run `make conformance` (or "
        "python tests/conformance/table.py after the suite wrote results.json)")
    groups = {c["group"] for c in results["cases"]}
    assert groups <= set(table.GROUPS), groups - set(table.GROUPS)
