"""Every report says one consistent thing: checked on every committed report and on fresh scans of every
bundled toy through the one pipeline.

- the verdict stored in summary.json is what :func:`discovery.rank.verdict.decide` says of the tables now
  (nothing renders a decision of its own), and the report shows its sentence;
- each head the verdict calls G&A belongs to a pair whose ``verified`` holds;
- ``verified`` ⇔ the one rule (≥ 19 controls, p ≤ 0.05, joint effect's interval below the control's 5th
  percentile), in pairs.parquet and in summary.json's top pairs;
- every percentage in report.md carries the sign of the number it qualifies;
- report.md holds no HTML entities;
- every stage finished (no "Incomplete scan" banner: a directory copied without its ``.gascan-scan``
  markers, then re-rendered, once committed Gemma3-270M's report with one).
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path

import polars as pl
import pytest

from discovery.artifacts import missing_stages, read_scan
from discovery.rank.verdict import ALPHA, MIN_CONTROLS, Verdict, decide, pair_status

REPORTS = Path(__file__).resolve().parent.parent / "reports"
COMMITTED = sorted(p.parent for p in REPORTS.glob("*/summary.json") if (p.parent / "heads.parquet").is_file())
HEAD = re.compile(r"\bL\d+[HS]\d+\b")
# a number, optionally its interval, then a percentage in parentheses: "+4.89 [+2.1, +6.0] (+48% of clean)"
PERCENT = re.compile(r"([+-]?\d+(?:\.\d+)?)(?: \[[^\]]*\])? \(([+-]?\d+(?:\.\d+)?)%")


def consistency_problems(directory: Path) -> list[str]:
    """What is inconsistent in one scan directory (empty when nothing is)."""
    problems: list[str] = []
    scan = read_scan(directory)
    stored = scan.summary.get("verdict")
    if not stored:
        return [f"{directory.name}: summary.json has no verdict"]
    missing = missing_stages(scan.summary)
    if missing:
        problems.append(f"{directory.name}: summary.json records unfinished stages {missing}")
    rows = scan.pairs.to_dicts() if scan.pairs is not None else []
    verdict = Verdict.from_dict(stored)
    if decide(scan.summary, rows).as_dict() != verdict.as_dict():
        problems.append(f"{directory.name}: the stored verdict is not what decide() says of the tables")
    for row in rows + list(scan.summary.get("top_pairs") or []):
        if row.get("control_n") is None and row.get("joint_effect") is None:
            continue  # ranked, not tested
        rule = (row.get("control_n") or 0) >= MIN_CONTROLS and row.get("control_p") is not None \
            and row["control_p"] <= ALPHA and row.get("joint_effect_hi") is not None \
            and row.get("control_q05") is not None and row["joint_effect_hi"] < row["control_q05"]
        if bool(row.get("verified")) != rule or (pair_status(row) == "verified") != rule:
            problems.append(f"{directory.name}: a pair's verified={row.get('verified')} breaks the rule")
        if row.get("verified") is None and (row.get("control_n") or 0) >= MIN_CONTROLS:
            problems.append(f"{directory.name}: a pair with enough controls is called not testable")
    for task in verdict.tasks:
        verified_heads = {h.name for p in task.verified_pairs for h in (p.gather, p.aggregate)}
        # the claim: what comes before the lists of heads named as not G&A (refined channels, decoys)
        claim = re.split(r"Refined channels|Decoys", task.sentence)[0]
        if task.outcome == "verified":
            named = set(HEAD.findall(claim))
            if not named or not named <= verified_heads:
                problems.append(f"{directory.name}: verdict names {sorted(named - verified_heads)} outside a verified pair")
        elif "verified" in claim.lower() and "not verified" not in claim.lower():
            problems.append(f"{directory.name}: outcome {task.outcome} but the sentence says verified")
        if task.outcome != "verified" and task.verified_pairs:
            problems.append(f"{directory.name}: verified pairs under outcome {task.outcome}")
    md_path, html_path = directory / "report.md", directory / "report.html"
    if md_path.is_file():
        md = md_path.read_text(encoding="utf-8")
        if "Incomplete scan" in md:
            problems.append(f"{directory.name}: report.md calls the scan incomplete")
        for entity in ("&gt;", "&lt;", "&amp;"):
            if entity in md:
                problems.append(f"{directory.name}: report.md contains {entity}")
        for number, percent in PERCENT.findall(md):
            n, p = float(number), float(percent)
            if n * p < 0:
                problems.append(f"{directory.name}: {number} with {percent}% in report.md")
    if html_path.is_file():
        page = html_path.read_text(encoding="utf-8")
        for task in verdict.tasks:
            if html.escape(task.sentence, quote=True) not in page:
                problems.append(f"{directory.name}: report.html does not show the verdict sentence of {task.task}")
    return problems


def test_the_checker_finds_planted_inconsistencies(tmp_path):
    """The checks can fail: a verified flag without 19 controls, a percentage of the wrong sign, an entity."""
    import shutil

    source = next(d for d in COMMITTED if (d / "pairs.parquet").is_file())
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    pairs = pl.read_parquet(bad / "pairs.parquet")
    tested = pairs["control_n"].is_not_null()
    pairs = pairs.with_columns(pl.when(tested).then(pl.lit(9)).otherwise(pl.col("control_n")).alias("control_n"),
                               pl.when(tested).then(pl.lit(True)).otherwise(pl.col("verified")).alias("verified"))
    pairs.write_parquet(bad / "pairs.parquet")
    (bad / "report.md").write_text("drop +4.89 [+2.10, +6.00] (-48% of clean) and 0.97-&gt;0.72\n")
    problems = consistency_problems(bad)
    assert any("breaks the rule" in p for p in problems)
    assert any("-48%" in p for p in problems)
    assert any("&gt;" in p for p in problems)
    assert any("not what decide()" in p for p in problems)


@pytest.mark.parametrize("directory", COMMITTED, ids=[d.name for d in COMMITTED])
def test_committed_reports_are_consistent(directory):
    assert consistency_problems(directory) == []


BUNDLED = ("mc-transformer", "mc-mamba2", "mc-mamba2-k2", "mc-hybrid", "mc1-transformer", "mc3-transformer", "mc-mamba1")


@pytest.mark.slow
@pytest.mark.parametrize("name", BUNDLED)
def test_fresh_scans_of_every_bundled_toy_are_consistent(name, tmp_path):
    from discovery.model.loading import load_model
    from pipelines import pipeline
    from pipelines.options import ScanOptions

    lm = load_model(f"bundled:{name}")
    options = ScanOptions(task_options=pipeline.task_options(lm.files, ["mc"], {}), prompts=16, bootstrap=200)
    result = pipeline.run(lm, options, tmp_path / name)
    assert consistency_problems(tmp_path / name) == []
    assert result.verdict.tasks[0].outcome in ("verified", "ga_like", "none")
    stored = json.loads((tmp_path / name / "summary.json").read_text())["verdict"]
    assert stored == json.loads(json.dumps(result.verdict.as_dict()))
    # the default evidence budget reaches the verdict of unbounded evidence on the same sweep (issue 23)
    from tests.helpers import verdict_differences
    from tests.test_budget import unbounded_copy

    unbounded = pipeline.finish(lm, unbounded_copy(tmp_path / name, tmp_path / f"{name}-none"), report=False)
    assert verdict_differences(result.verdict, unbounded.verdict) == []
