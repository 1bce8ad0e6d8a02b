"""Writes docs/porting.md's conformance table from tests/conformance/results.json.

    python tests/conformance/table.py [--results tests/conformance/results.json]

The table sits between the `<!-- conformance:start -->` and `<!-- conformance:end -->` markers
(as benchmarks/run_all.py writes the README's benchmark table): one row per claim, with the
port-table rows it backs, its cases and their outcome. `make conformance` runs it after the
suite; tests/conformance/test_table.py checks that the page matches the committed results.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PORTING = ROOT / "docs" / "porting.md"
RESULTS = HERE / "results.json"
START, END = "<!-- conformance:start -->", "<!-- conformance:end -->"

#: Which rows of porting.md's port table each group backs.
GROUPS = {
    "hooks": "`Callback.on_*` hooks, module hooks, `LightningDataModule`, `trainer.fit/validate/"
             "test/predict`, resume",
    "optim": "`accumulate_grad_batches`, `gradient_clip_val`, `configure_optimizers()` dict",
    "validation": "`L.Trainer(...)`'s loop arguments",
    "metrics": "`self.log`, `self.log_dict`, `trainer.validate/test` results",
    "early_stopping": "`EarlyStopping`",
    "checkpoint": "`ModelCheckpoint`",
    "resume": "`trainer.fit(..., ckpt_path=)`",
    "departures": "[Deliberate departures](#deliberate-departures)",
    "cli": "`LightningCLI` (its `config.yaml`, `--trainer.*`, `--optimizer`, `class_path`)",
    "tuner": "`Tuner.lr_find`, `Tuner.scale_batch_size`, `LearningRateFinder`, "
             "`BatchSizeFinder`",
}
MARK = {"passed": "passed", "departure": "departure (pinned)", "known failure": "KNOWN FAILURE",
        "failed": "FAILED", "skipped": "skipped", "passed (xfail)": "passed (xfail)"}


def _short(case_id: str) -> str:
    """`name[param]` -> `param` (a parametrized case is named by its parameter)."""
    return case_id[case_id.index("[") + 1:-1] if case_id.endswith("]") else case_id


def render(results: dict) -> str:
    cases = results["cases"]
    counts: dict[str, int] = {}
    for c in cases:
        counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
    versions = sorted({(v["lightning"], v["torch"]) for v in results["versions"].values()})
    lines = [
        f"{len(cases)} cases against Lightning "
        + ", ".join(f"{lv} (torch {tv})" for lv, tv in versions) + ": "
        + ", ".join(f"{n} {MARK.get(k, k)}" for k, n in sorted(counts.items())) + ".",
        "",
        "| group | claim | cases | outcome |",
        "|---|---|---|---|",
    ]
    rows: dict[tuple, list] = {}
    for c in cases:
        rows.setdefault((c["group"], c["claim"]), []).append(c)
    order = sorted(rows, key=lambda k: (list(GROUPS).index(k[0]) if k[0] in GROUPS else 99, k[1]))
    for group, text in order:
        members = rows[group, text]
        outcomes: dict[str, list] = {}
        for m in members:
            outcomes.setdefault(m["outcome"], []).append(_short(m["case"]))
        if len(outcomes) == 1:
            outcome = MARK.get(next(iter(outcomes)), next(iter(outcomes)))
        else:
            outcome = "; ".join(f"{MARK.get(k, k)}: {', '.join(v)}"
                                for k, v in sorted(outcomes.items()))
        reasons = sorted({m["reason"] for m in members if m.get("reason")})
        if reasons:
            outcome += " (" + "; ".join(r.replace("|", "/") for r in reasons) + ")"
        ids = ", ".join(f"`{_short(m['case'])}`" for m in members)
        lines.append(f"| {group} | {text.replace('|', '/')} | {ids} | {outcome} |")
    lines += ["", "Each group backs these rows of the port table above: "
              + "; ".join(f"**{g}**: {rows_}" for g, rows_ in GROUPS.items()) + "."]
    return "\n".join(lines)


def rewrite(page: str, table: str) -> str:
    if START not in page or END not in page:
        raise SystemExit(f"{PORTING} lacks the {START} / {END} markers")
    return page[:page.index(START)] + f"{START}\n{table}\n{END}" + \
        page[page.index(END) + len(END):]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    table = render(json.loads(pathlib.Path(args.results).read_text()))
    PORTING.write_text(rewrite(PORTING.read_text(), table))
    print(table.splitlines()[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
