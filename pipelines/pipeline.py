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

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from discovery.artifacts import (
    HEADS_FILE,
    PAIRS_FILE,
    REPORT_FILES,
    read_scan,
    read_summary,
    update_summary,
    write_evidence,
    write_pairs,
    write_scan,
)
from discovery.measure.cost import Cost, Meter
from discovery.measure.engines import EngineCache
from discovery.model.loading import LoadedModel
from discovery.rank.verdict import Verdict, decide
from pipelines import resume
from pipelines.options import ScanOptions
from pipelines.sweep import model_scan, scan_task

STAGES = ("sweep", "evidence", "pairs", "verdict", "report")
Progress = Callable[[str, int, int], None]


@dataclass
class ScanResult:
    """What a scan wrote: its directory, the head table, the summary, the verdict and the report; ``ran``:
    the stages this call computed (a resumed scan skips the complete ones)."""

    out: Path
    heads: pl.DataFrame
    summary: dict[str, Any]
    verdict: Verdict
    report: Path | None
    ran: list[str] = field(default_factory=list)


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
        report: bool = True, force: bool = False) -> ScanResult:
    """Every stage of a scan of ``lm`` into ``out``; a rerun on the same directory resumes at the first
    incomplete stage (:mod:`pipelines.resume`); a directory holding another scan is refused unless ``force``."""
    out = Path(out)
    fp = resume.fingerprint(lm, options)
    start = resume.start_stage(out, fp, STAGES, force=force)
    if start is None:  # complete: nothing to compute
        scan = read_scan(out)
        verdict = Verdict.from_dict(scan.summary["verdict"])
        html = out / "report.html" if (out / "report.html").is_file() else None
        return ScanResult(out, scan.heads, scan.summary, verdict, html)
    run_id = resume.new_run_id()
    resume.begin(out, fp, STAGES, start)
    engines = EngineCache()  # the stages of this run share each task's clean pass
    if start == "sweep":
        _sweep_stage(lm, options, out, fp, run_id, progress, engines)
    result = finish(lm, out, start=max(start, "evidence", key=STAGES.index), progress=progress, report=report,
                    run_id=run_id, engines=engines)
    if start == "sweep":
        result.ran.insert(0, "sweep")
    return result


def _sweep_stage(lm: LoadedModel, options: ScanOptions, out: Path, fp: Mapping[str, Any], run_id: str,
                 progress: Progress | None, engines: EngineCache | None = None) -> None:
    """The sweep, task by task: a task whose part (table and marker) a stopped run left is not rescanned."""
    from discovery.artifacts import STAGE_DIR, drop_parts, read_marker, write_marker
    from discovery.io import write_parquet

    key = fp["key"]
    frames, tasks, restored, n_restored = [], {}, Cost(), 0
    with _stage("sweep") as meter:
        for i, task in enumerate(options.tasks):
            part, table = f"sweep-task{i}", f"{STAGE_DIR}/sweep-task{i}.parquet"
            info = read_marker(out, part, key)
            if info is not None and info["record"].get("task") == task:
                frames.append(pl.read_parquet(out / table))
                tasks[task] = info["record"]["summary"]
                restored += _cost(tasks[task]["cost"])
                n_restored += 1
                continue
            frame, tasks[task] = scan_task(lm, task, options, progress=progress, engines=engines)
            frames.append(frame)
            write_parquet(out / table, frame)
            write_marker(out, part, key, [table], {"task": task, "summary": tasks[task]})
            resume.test_interrupt(part)
        heads, summary = model_scan(lm, options, frames, tasks)
        unfinished = {s: {"complete": False} for s in STAGES}
        write_scan(out, heads, {**summary, "fingerprint": dict(fp), "stages": unfinished, "complete": False})
    cost = meter.cost + restored
    unit = _unit_flops(summary)
    resume.commit(out, "sweep", STAGES, key, [HEADS_FILE], cost, unit, run_id, parts=_sweep_parts(tasks, unit),
                  tasks_resumed=n_restored)
    drop_parts(out, len(options.tasks))  # heads.parquet holds them now


def _cost(record: Mapping[str, Any]) -> Cost:
    return Cost(**{k: v for k, v in record.items() if k in Cost.__dataclass_fields__})


@contextmanager
def _stage(name: str) -> Iterator[Meter]:
    """Measure one stage (and, in tests, stop at its start: :func:`resume.test_interrupt`)."""
    resume.test_interrupt(name, "start")
    with Meter() as meter:
        yield meter


def _unit_flops(summary: Mapping[str, Any]) -> float | None:
    """FLOPs of one clean forward over every prompt of the scan (the tasks' ``forward_flops``)."""
    total = sum(float(t.get("forward_flops") or 0) for t in (summary.get("tasks") or {}).values())
    return total or None


def _sweep_parts(tasks: Mapping[str, Mapping[str, Any]], unit: float | None) -> dict[str, Any]:
    """The sweep's parts (clean forward, patterns, ablation sweeps, attribution), summed over tasks."""
    parts: dict[str, Cost] = {}
    for info in tasks.values():
        for name, rec in (info.get("parts") or {}).items():
            cost = _cost(rec)
            parts[name] = parts[name] + cost if name in parts else cost
    return {name: cost.record(unit) for name, cost in parts.items()}


def finish(lm: LoadedModel | None, out: str | Path, *, start: str = "evidence", progress: Progress | None = None,
           report: bool = True, run_id: str | None = None, engines: EngineCache | None = None) -> ScanResult:
    """The stages after the sweep, from ``start`` on, on a directory that holds the sweep's
    ``heads.parquet`` and ``summary.json``: evidence, pairs (both skipped when the sweep measured no
    effects), verdict, report. ``lm`` may be None when ``start`` is "verdict" or "report" (the report then
    uses the saved example pattern). Each stage commits its files, marker and cost (:func:`resume.commit`).
    ``engines``: the run's engines (the sweep's clean passes); evidence and pairs share one either way."""
    from discovery.evidence import scan_evidence
    from discovery.rank.pairs import scan_pairs

    if start not in STAGES[1:]:
        raise ValueError(f"start must be one of {STAGES[1:]}, not {start!r}")
    todo = STAGES[STAGES.index(start):]
    out = Path(out)
    run_id = run_id or resume.new_run_id()
    summary = read_summary(out)
    key = (summary.get("fingerprint") or {}).get("key")
    tracked = "stages" in summary  # a scan from before stages were recorded stays as it was
    if tracked:
        resume.begin(out, {"key": key}, STAGES, start)
    scan = read_scan(out)
    unit = _unit_flops(scan.summary)
    scored = (scan.summary.get("options") or {}).get("ablation", "exact") != "none" and scan.heads.height > 0
    from pipelines.validate import budget as parse_budget

    budget = parse_budget((scan.summary.get("options") or {}).get("budget", "auto"))

    def commit(stage: str, files: Sequence[str], cost: Cost, **extra: Any) -> None:
        if tracked:
            resume.commit(out, stage, STAGES, key, files, cost, unit, run_id, **extra)
        ran.append(stage)

    ran: list[str] = []
    engines = engines if engines is not None else EngineCache()
    if "evidence" in todo:
        with _stage("evidence") as meter:
            if scored:
                tables, fields = scan_evidence(lm, scan.heads, scan.summary, progress=progress, budget=budget,
                                               engines=engines)
                write_evidence(out, tables, fields)
        commit("evidence", [f"{name}.parquet" for name in tables] if scored else [], meter.cost, skipped=not scored)
        scan = read_scan(out)
    if "pairs" in todo:
        with _stage("pairs") as meter:
            if scored:
                pairs, fields = scan_pairs(lm, scan.heads, scan.summary, evidence=scan.evidence, budget=budget,
                                           progress=progress, engines=engines)
                write_pairs(out, pairs, fields)
        commit("pairs", [PAIRS_FILE] if scored else [], meter.cost, skipped=not scored)
    if "verdict" in todo:
        with _stage("verdict") as meter:
            verdict = conclude(out)
        commit("verdict", [], meter.cost)
    else:
        verdict = decide(scan.summary, _pair_rows(scan))
    html = None
    if report:
        from discovery.report import write_report

        with _stage("report") as meter:
            html = write_report(out, lm)
        commit("report", list(REPORT_FILES), meter.cost)
    scan = read_scan(out)
    return ScanResult(out, scan.heads, scan.summary, verdict, html, ran)


def conclude(out: str | Path) -> Verdict:
    """The verdict stage: decide from the scan's tables and record it in ``summary.json``."""
    scan = read_scan(out)
    verdict = decide(scan.summary, _pair_rows(scan))
    update_summary(out, {"verdict": verdict.as_dict()})
    return verdict


def _pair_rows(scan) -> list[dict[str, Any]]:
    return scan.pairs.to_dicts() if scan.pairs is not None else []
