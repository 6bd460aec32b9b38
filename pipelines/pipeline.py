"""The one pipeline: the order of a scan's stages, owned here and nowhere else.

    sweep ──► evidence ──► pairs ──► verdict ──► report

``run`` does every stage for a loaded model; ``finish`` does the stages after the sweep on a scan
directory that already holds the sweep's tables. ``gascan scan`` calls ``run``; every ``gascan
batch`` checkpoint runs the sweep as layer-range shards and then ``finish`` (on a worker, with the
model loaded there); Python users call either. Each stage reads what the stage before wrote through
:mod:`discovery.artifacts`, so a batch checkpoint's directory holds the same files, with the same
verdict, as ``gascan scan`` of that checkpoint.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from discovery.artifacts import read_scan, update_summary, write_evidence, write_pairs, write_scan
from discovery.model.loading import LoadedModel
from discovery.rank.verdict import Verdict, decide
from pipelines.options import ScanOptions
from pipelines.sweep import scan_model

STAGES = ("sweep", "evidence", "pairs", "verdict", "report")
Progress = Callable[[str, int, int], None]


@dataclass
class ScanResult:
    """What a scan wrote: its directory, the head table, the summary, the verdict and the report."""

    out: Path
    heads: pl.DataFrame
    summary: dict[str, Any]
    verdict: Verdict
    report: Path | None


def task_options(files: Sequence[Path], tasks: Sequence[str], given: Mapping[str, Any],
                 from_file: Callable[[str], Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Each task's options: what a toy checkpoint was trained with, then an options file's table for
    the task, then options given on the command line (later wins)."""
    from discovery.tasks import split_spec
    from discovery.toy import trained_task_options

    defaults = trained_task_options(list(files))
    out: dict[str, dict[str, Any]] = {}
    for task in tasks:
        name = split_spec(task)[0]
        opts = dict(defaults.get(name, {}))
        if from_file is not None:
            opts.update(from_file(name))
        opts.update(given)
        out[task] = opts
    return out


def run(lm: LoadedModel, options: ScanOptions, out: str | Path, *, progress: Progress | None = None,
        report: bool = True) -> ScanResult:
    """Every stage of a scan of ``lm`` into ``out``."""
    heads, summary = scan_model(lm, options, progress=progress)
    write_scan(out, heads, summary)
    return finish(lm, out, progress=progress, report=report)


def finish(lm: LoadedModel | None, out: str | Path, *, start: str = "evidence", progress: Progress | None = None,
           report: bool = True) -> ScanResult:
    """The stages after the sweep, from ``start`` on, on a directory that holds the sweep's
    ``heads.parquet`` and ``summary.json``: evidence, pairs (both skipped when the sweep measured no
    effects), verdict, report. ``lm`` may be None when ``start`` is "verdict" or "report" (the report then
    uses the saved example pattern)."""
    from discovery.evidence import scan_evidence
    from discovery.rank.pairs import scan_pairs

    if start not in STAGES[1:]:
        raise ValueError(f"start must be one of {STAGES[1:]}, not {start!r}")
    todo = STAGES[STAGES.index(start):]
    out = Path(out)
    scan = read_scan(out)
    scored = (scan.summary.get("options") or {}).get("ablation", "exact") != "none" and scan.heads.height > 0
    if scored and "evidence" in todo:
        tables, fields = scan_evidence(lm, scan.heads, scan.summary, progress=progress)
        write_evidence(out, tables, fields)
        scan = read_scan(out)
    if scored and "pairs" in todo:
        if progress:
            progress("pairs (ranking, joint ablation)", 0, 1)
        pairs, fields = scan_pairs(lm, scan.heads, scan.summary, evidence=scan.evidence)
        write_pairs(out, pairs, fields)
        if progress:
            progress("pairs (ranking, joint ablation)", 1, 1)
    verdict = conclude(out) if "verdict" in todo else decide(scan.summary, _pair_rows(scan))
    html = None
    if report:
        from discovery.report import write_report

        html = write_report(out, lm)
    scan = read_scan(out)
    return ScanResult(out, scan.heads, scan.summary, verdict, html)


def conclude(out: str | Path) -> Verdict:
    """The verdict stage: decide from the scan's tables and record it in ``summary.json``."""
    scan = read_scan(out)
    verdict = decide(scan.summary, _pair_rows(scan))
    update_summary(out, {"verdict": verdict.as_dict()})
    return verdict


def _pair_rows(scan) -> list[dict[str, Any]]:
    return scan.pairs.to_dicts() if scan.pairs is not None else []
