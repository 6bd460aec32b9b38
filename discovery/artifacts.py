"""The scan directory: its file names, how each stage's tables are read and written, and the joins.

Every stage reads what the stage before wrote, through this module only, so any stage can be rerun
alone. Writes are atomic (:mod:`discovery.io`): a crash never leaves a half-written table.

Files (all optional but ``heads.parquet`` and ``summary.json``):

- ``heads.parquet`` (the sweep: one row per task x head), ``summary.json`` (the model, the options,
  per-task clean scores, and the fields each later stage merges in: ``evidence``, ``top_pairs``,
  ``verdict``, ...);
- ``evidence*.parquet`` (the evidence stage), ``pairs.parquet`` (the pair ranking);
- ``patterns.npz`` (the report's example pattern), ``report.md``, ``report.html``, ``figures/``;
- ``.gascan-scan/STAGE.done.json``: each finished stage's completion marker (the scan's fingerprint key,
  the files the stage wrote with their sizes, its cost), written after the stage's files; a stage is complete
  when its marker agrees with the files. ``summary.json``'s ``stages`` mirrors the markers and ``complete``
  says whether every stage is (:func:`sync_stages`), so a rerun resumes at the first incomplete stage.
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from discovery.errors import GascanError
from discovery.io import write_json, write_parquet

HEADS_FILE = "heads.parquet"
SUMMARY_FILE = "summary.json"
PAIRS_FILE = "pairs.parquet"
PATTERNS_FILE = "patterns.npz"
EVIDENCE_TABLES = ("evidence", "evidence_groups", "evidence_depth", "evidence_reads")
EVIDENCE_JOIN = ("task", "layer", "head", "kind")
REPORT_FILES = ("report.md", "report.html")
STAGE_DIR = ".gascan-scan"
MARKER_SUFFIX = ".done.json"


@dataclass
class Scan:
    """What one scan directory holds."""

    dir: Path
    summary: dict[str, Any]
    heads: pl.DataFrame
    pairs: pl.DataFrame | None = None
    evidence: pl.DataFrame | None = None  # evidence.parquet: roles, scopes, minimal model per head
    evidence_groups: pl.DataFrame | None = None
    evidence_depth: pl.DataFrame | None = None
    evidence_reads: pl.DataFrame | None = None

    @property
    def tasks(self) -> list[str]:
        listed = list((self.summary.get("tasks") or {}).keys())
        seen = [t for t in self.heads["task"].unique(maintain_order=True).to_list() if t not in listed] \
            if "task" in self.heads.columns else []
        return listed + seen

    def clean(self, task: str) -> dict[str, Any]:
        return ((self.summary.get("tasks") or {}).get(task) or {}).get("clean") or {}


def read_summary(out_dir: str | Path) -> dict[str, Any]:
    """``summary.json`` of a scan directory ({} when absent)."""
    path = Path(out_dir) / SUMMARY_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise GascanError(f"cannot read {path} ({err.__class__.__name__})", "rerun `gascan scan` for this model") \
            from None


def read_scan(out_dir: str | Path) -> Scan:
    """Read a scan directory; a missing or unreadable table is a one-line error."""
    out = Path(out_dir)
    table, summary_path = out / HEADS_FILE, out / SUMMARY_FILE
    if not table.is_file() or not summary_path.is_file():
        raise GascanError(f"{out} is not a scan directory (no heads.parquet and summary.json)",
                          "pass the --out directory of `gascan scan`")
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        heads = pl.read_parquet(table)
    except (OSError, ValueError, pl.exceptions.PolarsError) as err:  # corrupt files: name them
        raise GascanError(f"cannot read the scan in {out} ({err.__class__.__name__}: {str(err)[:120]})",
                          "rerun `gascan scan` for this model") from None
    extra: dict[str, pl.DataFrame | None] = {}
    for key in ("pairs", *EVIDENCE_TABLES):
        path = out / (PAIRS_FILE if key == "pairs" else f"{key}.parquet")
        try:
            extra[key] = pl.read_parquet(path) if path.is_file() else None
        except (OSError, pl.exceptions.PolarsError) as err:
            raise GascanError(f"cannot read {path} ({err.__class__.__name__})",
                              f"delete it or rerun the stage that writes {path.name}") from None
    return Scan(out, summary, heads, **extra)


def with_evidence(heads: pl.DataFrame, evidence: pl.DataFrame | None) -> pl.DataFrame:
    """The head table plus the evidence stage's per-head columns it lacks (roles, position-resolved and
    minimal-model effects)."""
    if evidence is None or evidence.height == 0:
        return heads
    keys = [k for k in EVIDENCE_JOIN if k in heads.columns and k in evidence.columns]
    new = [c for c in evidence.columns if c not in heads.columns]
    if not new or len(keys) < 3:
        return heads
    right = evidence.select(keys + new).unique(keys, keep="first")
    return heads.join(right, on=keys, how="left")


REFINED_COLUMNS = ("channel_start", "channel_end")


def restore_refined(inventory: Any, heads: pl.DataFrame) -> None:
    """Give a model's inventory (:class:`~discovery.heads.Inventory`) the refined Mamba-1 channel heads a
    head table names (rows with ``channel_start``), with the same indices, so later stages (evidence,
    pairs, the report's example) can ablate and read them; a table without them clears any others."""
    if not all(c in heads.columns for c in REFINED_COLUMNS):
        rows: list[tuple[int, int, str, int, int]] = []
    else:
        rows = heads.filter(pl.col("channel_start").is_not_null()).select(
            "layer", "head", "kind", *REFINED_COLUMNS).rows()
    try:
        inventory.restore_spans(rows)
    except ValueError as err:
        raise GascanError(f"the head table's refined channel heads do not fit the model: {err}",
                          "rerun the sweep (gascan scan) of this model") from None


def write_scan(out_dir: str | Path, heads: pl.DataFrame, summary: Mapping[str, Any]) -> Path:
    """The sweep's output: ``heads.parquet`` and ``summary.json``, atomically."""
    out = Path(out_dir)
    write_parquet(out / HEADS_FILE, heads)
    write_json(out / SUMMARY_FILE, jsonable(dict(summary)))
    return out


def update_summary(out_dir: str | Path, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Merge a stage's ``fields`` into ``summary.json`` (atomically); returns the new summary."""
    out = Path(out_dir)
    summary = read_summary(out)
    summary.update(jsonable(dict(fields)))
    write_json(out / SUMMARY_FILE, summary)
    return summary


def write_evidence(out_dir: str | Path, tables: Mapping[str, pl.DataFrame], fields: Mapping[str, Any]) -> Path:
    """The evidence stage's output: ``NAME.parquet`` per table and its fields merged into ``summary.json``."""
    out = Path(out_dir)
    for name, table in tables.items():
        write_parquet(out / f"{name}.parquet", table)
    update_summary(out, fields)
    return out


def write_pairs(out_dir: str | Path, table: pl.DataFrame, fields: Mapping[str, Any]) -> Path:
    """The pair ranking's output: ``pairs.parquet`` and its fields merged into ``summary.json``."""
    out = Path(out_dir)
    write_parquet(out / PAIRS_FILE, table)
    update_summary(out, fields)
    return out


def jsonable(value: Any) -> Any:
    """Plain JSON values: NaN and infinities become null (JSON has neither), tuples lists."""
    import math

    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return jsonable(value.item())
    return value


# -- stage markers ---------------------------------------------------------------------------------
def marker_path(out_dir: str | Path, stage: str) -> Path:
    return Path(out_dir) / STAGE_DIR / f"{stage}{MARKER_SUFFIX}"


def write_marker(out_dir: str | Path, stage: str, key: str | None, files: Sequence[str],
                 record: Mapping[str, Any]) -> dict[str, Any]:
    """The completion marker of ``stage``: written (atomically) after the stage's ``files``."""
    out = Path(out_dir)
    info = {"stage": stage, "key": key, "files": {name: (out / name).stat().st_size for name in files},
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "record": jsonable(dict(record))}
    write_json(marker_path(out, stage), info)
    return info


def read_marker(out_dir: str | Path, stage: str, key: str | None = None) -> dict[str, Any] | None:
    """The marker of ``stage`` when the stage is complete: the marker is there, names ``key`` (when given)
    and every file it lists has the size it had; else None."""
    out = Path(out_dir)
    try:
        info = json.loads(marker_path(out, stage).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or (key is not None and info.get("key") != key):
        return None
    for name, size in (info.get("files") or {}).items():
        path = out / name
        if not path.is_file() or path.stat().st_size != size:
            return None
    return info


def drop_markers(out_dir: str | Path, stages: Sequence[str]) -> None:
    """Forget that ``stages`` finished (before they run again, so a stop midway leaves them incomplete)."""
    for stage in stages:
        marker_path(out_dir, stage).unlink(missing_ok=True)


def sync_stages(out_dir: str | Path, stages: Sequence[str], key: str | None = None) -> dict[str, Any]:
    """Mirror the markers into ``summary.json``: ``stages`` (per stage ``complete`` and its cost record) and
    ``complete`` (every stage is); returns the new summary."""
    records: dict[str, Any] = {}
    for stage in stages:
        info = read_marker(out_dir, stage, key)
        records[stage] = {"complete": True, **info["record"]} if info else {"complete": False}
    return update_summary(out_dir, {"stages": records, "complete": all(r["complete"] for r in records.values())})


def missing_stages(summary: Mapping[str, Any], skip: Sequence[str] = ()) -> list[str]:
    """The stages ``summary.json`` lists as incomplete ([] for a scan written before stages were recorded)."""
    stages = summary.get("stages") or {}
    return [name for name, rec in stages.items() if name not in skip and not (rec or {}).get("complete")]


def drop_parts(out_dir: str | Path, n: int) -> None:
    """Remove the sweep's per-task parts (``STAGE_DIR/sweep-taskI``: table and marker) once the sweep committed."""
    for i in range(n):
        (Path(out_dir) / STAGE_DIR / f"sweep-task{i}.parquet").unlink(missing_ok=True)
        marker_path(out_dir, f"sweep-task{i}").unlink(missing_ok=True)


SCAN_FILES = (HEADS_FILE, SUMMARY_FILE, PAIRS_FILE, PATTERNS_FILE, *REPORT_FILES,
              *(f"{name}.parquet" for name in EVIDENCE_TABLES))


def clear_scan(out_dir: str | Path) -> None:
    """Remove what a scan wrote in ``out_dir`` (its known files, ``figures/`` and the markers; nothing else)."""
    out = Path(out_dir)
    for name in SCAN_FILES:
        (out / name).unlink(missing_ok=True)
    for folder in (out / "figures", out / STAGE_DIR):
        if folder.is_dir():
            shutil.rmtree(folder)


def stage_rows(summary: Mapping[str, Any]) -> list[tuple[str, float | None, float | None, float | None]]:
    """The cost table: (stage, wall s, forward-equivalents, peak MiB) per stage, the sweep's parts indented
    after it (peak: CUDA when the scan ran there, else the process's resident high-water mark)."""
    def row(name: str, rec: Mapping[str, Any]) -> tuple[str, float | None, float | None, float | None]:
        peak = rec.get("peak_cuda_mib") if rec.get("peak_cuda_mib") is not None else rec.get("peak_rss_mib")
        return name, rec.get("wall_s"), rec.get("forward_equivalents"), peak

    rows = []
    for name, rec in (summary.get("stages") or {}).items():
        rows.append(row(name, rec or {}))
        for part, sub in ((rec or {}).get("parts") or {}).items():
            rows.append(row(f"  {part}", sub or {}))
    return rows
