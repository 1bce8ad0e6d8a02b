"""Writes docs/porting.md's conformance table from tests/conformance/results.json.

    python tests/conformance/table.py [--results tests/conformance/results.json]

The table sits between the `<!-- conformance:start -->` and `<!-- conformance:end -->` markers
(as benchmarks/run_all.py writes the README's benchmark table): one row per claim, with the
port-table rows it backs, its cases and their outcome. `make conformance` runs it after the
suite; tests/conformance/test_table.py checks that the page matches the committed results.

It also writes the argument coverage table between `<!-- coverage:start -->` and
`<!-- coverage:end -->`: every name jaxlight shares with Lightning (`_coverage.py`, from both
sides' signatures) and the cases or pinned departures that cover it (their `@covers`);
tests/conformance/test_coverage.py checks that the page matches and that none is uncovered.
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
COVERAGE = ("<!-- coverage:start -->", "<!-- coverage:end -->")

#: Which rows of porting.md's port table each group backs.
GROUPS = {
    "hooks": "`Callback.on_*` hooks, module hooks, `LightningDataModule`, `trainer.fit/validate/"
             "test/predict`, resume",
    "optim": "`accumulate_grad_batches`, `gradient_clip_val`, `configure_optimizers()` dict",
    "validation": "`L.Trainer(...)`'s loop arguments",
    "metrics": "`self.log`, `self.log_dict`, `trainer.validate/test` results",
    "early_stopping": "`EarlyStopping`",
    "checkpoint": "`ModelCheckpoint`",
    "checkpointing_default": "`Trainer(enable_checkpointing)`: the default checkpoint",
    "resume": "`trainer.fit(..., ckpt_path=)`",
    "departures": "[Deliberate departures](#deliberate-departures)",
    "cli": "`LightningCLI` (its `config.yaml`, `--trainer.*`, `--optimizer`, `class_path`)",
    "tuner": "`Tuner.lr_find`, `Tuner.scale_batch_size`, `LearningRateFinder`, "
             "`BatchSizeFinder`",
    "arguments": "the shared arguments no other group runs: hook arguments, `self.log` / "
                 "`log_dict`'s, `ckpt_path` in evaluation, `CSVLogger`, the `Trainer`'s "
                 "switches ([argument coverage](#argument-coverage))",
    "arguments2": "the callbacks' remaining arguments: fine-tuning, `check_finite`, "
                  "`SpikeDetection`, weight averages, `Timer`, the tuner's",
    "tuner_arguments": "`Tuner.lr_find` / `scale_batch_size`, `BatchSizeFinder`, "
                       "`LearningRateFinder`: their remaining arguments",
    "arguments3": "display, monitoring and `TensorBoardLogger` arguments",
    "signatures": "every shared argument's default ([argument coverage](#argument-coverage))",
    "no_oracle": "[names the oracle environment cannot run](#names-the-oracle-environment-"
                 "cannot-run) (`MLFlowLogger`, `WandbLogger`, `RichProgressBar`)",
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


#: The departure section of the names whose Lightning class cannot run in the oracle's
#: environment (its backend is not installed): their tests check jaxlight against Lightning's
#: documented behaviour, and the table says so.
NO_ORACLE = "Names the oracle environment cannot run"


def _mark(test: dict) -> str:
    if test["departure"] == NO_ORACLE:
        return " (no oracle)"
    return " (departure)" if test["departure"] else ""


def render_coverage(rows: list[dict]) -> str:
    """The coverage table: one row per shared unit, with its covering tests (a departure marked)."""
    def kind(row):
        if not row["tests"]:
            return "uncovered"
        if any(t["departure"] is None for t in row["tests"]):
            return "case"
        if all(t["departure"] == NO_ORACLE for t in row["tests"]):
            return "no oracle"
        return "departure"

    counts = {k: sum(kind(r) == k for r in rows)
              for k in ("case", "departure", "no oracle", "uncovered")}
    lines = [
        f"{len(rows)} names jaxlight shares with Lightning (arguments, methods and their "
        f"arguments, properties): {counts['case']} covered by a case, {counts['departure']} by "
        f"a pinned departure only, {counts['no oracle']} checked without the oracle (its "
        f"backend is not in the oracle's environment), {counts['uncovered']} uncovered.",
        "",
        "| jaxlight | Lightning | covered by |",
        "|---|---|---|",
    ]
    for r in rows:
        tests = ", ".join(f"`{t['test']}`" + _mark(t) for t in r["tests"]) or "**none**"
        lines.append(f"| `{r['unit']}` | `{r['lightning']}` | {tests} |")
    return "\n".join(lines)


def rewrite(page: str, table: str, markers: tuple[str, str] = (START, END)) -> str:
    start, end = markers
    if start not in page or end not in page:
        raise SystemExit(f"{PORTING} lacks the {start} / {end} markers")
    return page[:page.index(start)] + f"{start}\n{table}\n{end}" + \
        page[page.index(end) + len(end):]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args(argv)
    table = render(json.loads(pathlib.Path(args.results).read_text()))
    sys.path.insert(0, str(ROOT))
    from tests.conformance import _coverage

    coverage = render_coverage(_coverage.coverage_rows())
    PORTING.write_text(rewrite(rewrite(PORTING.read_text(), table), coverage, COVERAGE))
    print(table.splitlines()[0])
    print(coverage.splitlines()[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
