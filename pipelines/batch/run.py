"""The batch driver: plan, run the shards on an executor (sweeps, then one finish per checkpoint),
commit each as it arrives, merge the tables, write ``batch_summary.json`` and the series.

Outputs under ``DIR``: ``<checkpoint>/`` with the files ``gascan scan`` writes (heads.parquet,
evidence and pairs tables, summary.json with the verdict, report) once the checkpoint is finished;
``heads.parquet`` (all checkpoints, with ``checkpoint_name`` and ``step``); ``batch_summary.json``;
for a series, ``series.parquet`` and ``series.png`` (key metrics against training step).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import polars as pl

from discovery.artifacts import jsonable
from pipelines.batch.forecast import Forecast, finish_seconds
from pipelines.batch.series import series_rows, write_series
from pipelines.batch.shards import (
    ROW_KEYS,
    Shard,
    batch_lock,
    clean_temp_files,
    commit_shard,
    finish_shard_for,
    plan_shards,
    read_marker,
    shard_paths,
)
from pipelines.batch.spec import BatchSpec, Checkpoint, gascan_version
from pipelines.batch.work import ShardFn, scan_shard
from pipelines.options import AFTER_SWEEP_SETTINGS, TABLE_VERSION
from pipelines.progress import Progress

REPORT_FILES = ("report.md", "report.html", "figures")
BATCH_STAGE = "batch shards"  # the batch bar's stage name


@dataclass
class BatchResult:
    """What a batch run did: shard counts, failures (with reasons) and the summary it wrote."""

    out: Path
    total: int
    ran: int
    skipped: int
    failures: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def complete(self) -> bool:
        return not self.failures


def run_batch(spec: BatchSpec, out: str | os.PathLike, executor=None, *, shard_fn: ShardFn = scan_shard,
              finish: bool = True, progress: bool = True, console=None, reports: bool = True) -> BatchResult:
    """Plan, skip what is complete, run the rest on ``executor`` (default serial), merge, summarise.

    Two phases through the same executor: every sweep shard, then (``finish``) one finish shard per
    checkpoint whose sweep shards are all complete: :func:`pipelines.pipeline.finish` on the merged
    tables, so the checkpoint's directory holds what ``gascan scan`` writes. ``reports``: keep each
    finished checkpoint's report (the tables and the verdict are written either way).
    """
    from pipelines.batch.executors import SerialExecutor

    executor = executor or SerialExecutor()
    out_dir = Path(out)
    started = time.time()
    with batch_lock(out_dir):
        failures: list[dict[str, Any]] = []
        shards = plan_shards(spec, out_dir, errors=failures)
        clean_temp_files(out_dir, shards)
        by_checkpoint = _by_checkpoint(shards)
        markers = {s.key: read_marker(out_dir, s) for s in shards}
        queue = [s for s in shards if markers[s.key] is None]
        total = len(shards) + (len(by_checkpoint) if finish else 0)
        skipped = len(shards) - len(queue)
        outstanding = {name: sum(1 for s in queue if s.checkpoint.name == name) for name in by_checkpoint}
        forecast = _forecast(shards, markers, by_checkpoint if finish else {})

        def follow_up(name: str) -> None:
            """Queue a checkpoint's finish shard once its sweep shards are all complete."""
            nonlocal skipped
            planned = _finish_shard(out_dir, spec, by_checkpoint[name]) if finish else None
            if planned is None:  # a sweep shard failed (or finish is off): no finish for this checkpoint
                forecast.dropped(name)
                return
            shard, seconds, sweep_seconds = planned
            if read_marker(out_dir, shard) is None:
                queue.append(shard)
                forecast.queued_finish(shard, seconds, sweep_seconds)
            else:
                forecast.dropped(name)
                skipped += 1
                tick(True)

        ran = 0
        skip_files = () if reports else REPORT_FILES
        with _progress_bar(progress, console, total, skipped, executor, forecast) as (tick, stages):
            for name, count in outstanding.items():
                if count == 0:
                    follow_up(name)
            # the executor reads ``queue`` as it goes: a finish shard appended here runs on the same workers
            with contextlib.closing(executor.run(queue, shard_fn, spec.load, progress=stages)) as outcomes:
                for outcome in outcomes:
                    shard = outcome.shard
                    if outcome.ok:
                        commit_shard(out_dir, outcome, skip_files=skip_files)
                        ran += 1
                    else:
                        failures.append({"shard": shard.label, "key": shard.key, "checkpoint": shard.checkpoint.name,
                                         "task": shard.task, "layers": list(shard.layers) if shard.layers else None,
                                         "attempts": outcome.attempts, "crashed": outcome.crashed,
                                         "reason": outcome.error})
                    forecast.finished(shard, outcome.result.seconds if outcome.ok else None, time.monotonic())
                    if shard.stage == "sweep":
                        outstanding[shard.checkpoint.name] -= 1
                        if outstanding[shard.checkpoint.name] == 0:
                            follow_up(shard.checkpoint.name)  # before the tick: its line counts the finish
                    tick(outcome.ok)
        summary = merge_batch(spec, out_dir, shards, failures=failures, executor=executor.describe(),
                              ran=ran, skipped=skipped, started=started, total=total)
    return BatchResult(out_dir, total, ran, skipped, failures, summary)


def _by_checkpoint(shards: Sequence[Shard]) -> dict[str, list[Shard]]:
    out: dict[str, list[Shard]] = {}
    for shard in shards:
        out.setdefault(shard.checkpoint.name, []).append(shard)
    return out


def _forecast(shards: Sequence[Shard], markers: Mapping[str, dict[str, Any] | None],
              finishing: Mapping[str, Any]) -> Forecast:
    """The batch bar's forecast: the shards to run (no completion marker), the earlier runs' sweep seconds (their
    markers), a finish per checkpoint."""
    forecast = Forecast(time.monotonic())
    for shard in shards:
        marker = markers.get(shard.key)
        if marker is None:
            forecast.expect(shard)
        else:
            forecast.measured_before(shard, marker.get("seconds"))
    for name in finishing:
        forecast.expect_finish(name)
    return forecast


def _finish_shard(out: Path, spec: BatchSpec, own: list[Shard]) -> tuple[Shard, float | None, float] | None:
    """The finish shard of a checkpoint, once every one of its sweep shards is complete, with its predicted
    seconds (:func:`~pipelines.batch.forecast.finish_seconds`) and the sweep shards' measured seconds."""
    frames, markers = _checkpoint_frames(out, own)
    if not own or len(markers) != len(own):
        return None
    heads = pl.concat(frames, how="diagonal_relaxed").collect()
    buffer = io.BytesIO()
    heads.write_parquet(buffer)
    summary = _checkpoint_summary(own[0].checkpoint, own, markers, heads, spec)
    layers = {task: heads.filter(pl.col("task") == task)["layer"].to_list() for task in summary["tasks"]} \
        if "task" in heads.columns else {}
    predicted = finish_seconds(summary, layers, spec.scan.budget)
    sweep_seconds = sum(float(m.get("seconds") or 0.0) for m in markers)
    return finish_shard_for(own, buffer.getvalue(), jsonable(summary)), predicted, sweep_seconds


@contextlib.contextmanager
def _progress_bar(enabled: bool, console, total: int, skipped: int, executor=None, forecast: Forecast | None = None
                  ) -> Iterator[tuple[Callable[..., None], Progress]]:
    """Progress of the whole batch (:mod:`pipelines.progress`: rich bars in a terminal, plain log lines
    otherwise): ``tick``, which counts shards done (skipped ones count as done), failed, already done, and
    the executor's worker deaths and resubmissions when it counts them (Ray); and the reporter itself, for
    the stages of shards that run in this process (``CHECKPOINT: stage``; in a terminal a stage's bar goes
    when it is done). The batch bar's time left is the ``forecast``'s (shards weighted by predicted seconds)."""
    from pipelines.progress import reporter

    failed = [0]
    done = [skipped]

    def status() -> str:
        stats = getattr(executor, "stats", None) or {}
        text = f"{failed[0]} failed  {skipped} already done"
        if "worker_deaths" in stats:
            text += f"  {stats['worker_deaths']} worker deaths  {stats.get('resubmitted', 0)} resubmitted"
        return text

    eta_for = {BATCH_STAGE: lambda: forecast.eta(time.monotonic())} if forecast is not None else None
    with reporter(console, enabled=enabled, status=status, drop_finished=True, eta_for=eta_for) as progress:
        progress(BATCH_STAGE, done[0], total)

        def tick(ok: bool, count: int = 1) -> None:
            if not ok:
                failed[0] += count
            done[0] += count
            progress(BATCH_STAGE, done[0], total)

        yield tick, progress


def _checkpoint_frames(out: Path, shards: list[Shard]) -> tuple[list[pl.LazyFrame], list[dict[str, Any]]]:
    frames, markers = [], []
    for shard in shards:
        info = read_marker(out, shard)
        if info is not None:
            frames.append(pl.scan_parquet(shard_paths(out, shard)[0]))
            markers.append(info)
    return frames, markers


def _checkpoint_summary(checkpoint: Checkpoint, shards: list[Shard], markers: list[dict[str, Any]],
                        heads: pl.DataFrame, spec: BatchSpec) -> dict[str, Any]:
    """The per-checkpoint ``summary.json`` in ``gascan scan``'s layout, built from shard markers."""
    from pipelines.sweep import top_effects

    tasks: dict[str, Any] = {}
    for info in markers:
        task = info["task"]
        if task not in tasks:
            tasks[task] = dict(info["task_summary"])
            tasks[task]["seconds"] = 0.0
            tasks[task]["shards"] = 0
        tasks[task]["seconds"] = round(tasks[task]["seconds"] + float(info["task_summary"].get("seconds") or 0), 2)
        tasks[task]["shards"] += 1
    model = markers[0]["model_info"] if markers else {}
    options = replace(spec.scan, task_options={s.task: s.scan["task_options"].get(s.task, {}) for s in shards})
    missing = [s.label for s in shards if s.key not in {m["key"] for m in markers}]
    return {
        "model": model.get("model", checkpoint.name), "spec": model.get("spec", checkpoint.spec),
        "checkpoint": shards[0].checkpoint_hash if shards else None, "step": checkpoint.step,
        "architecture": model.get("architecture"), "n_layers": model.get("n_layers"),
        "n_heads": model.get("n_heads"), "options": options.as_dict(), "tasks": tasks,
        "top_effects": top_effects(heads) if heads.height else [], "table_version": TABLE_VERSION,
        "complete": not missing, "missing_shards": missing, "batch": spec.name,
        "shard_keys": sorted(m["key"] for m in markers),
    }


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _up_to_date(directory: Path, summary: dict[str, Any]) -> bool:
    """Whether ``directory`` already holds the sweep tables of exactly these shards."""
    old = _read_json(directory / "summary.json")
    return old.get("shard_keys") == summary["shard_keys"] and (directory / "heads.parquet").is_file()


def _finished(directory: Path, summary: dict[str, Any]) -> bool:
    """Whether the finish stage wrote ``directory`` from exactly these sweep shards and after-sweep settings."""
    old = _read_json(directory / "summary.json")
    return (old.get("shard_keys") == summary["shard_keys"] and "verdict" in old
            and _after_sweep(old) == _after_sweep(summary))


def _after_sweep(summary: dict[str, Any]) -> dict[str, Any]:
    """The settings only the finish stage reads (the evidence budget), as a summary records them."""
    return {k: (summary.get("options") or {}).get(k) for k in AFTER_SWEEP_SETTINGS}


def merge_batch(spec: BatchSpec, out: Path, shards: list[Shard], *, failures: list[dict[str, Any]],
                executor: dict[str, Any], ran: int, skipped: int, started: float, total: int | None = None
                ) -> dict[str, Any]:
    """The merged table, the series and ``batch_summary.json``; a checkpoint that did not reach its
    finish stage (a shard failed, or finish was off) gets its sweep tables as heads.parquet/summary.json.
    Shard counts (``total``, ``done``) include the finish shards."""
    from discovery.artifacts import write_scan
    from discovery.io import write_json, write_parquet

    by_checkpoint = _by_checkpoint(shards)
    merged: list[pl.LazyFrame] = []
    checkpoints, rows_of_series = [], []
    for checkpoint in spec.checkpoints:
        own = by_checkpoint.get(checkpoint.name, [])
        frames, markers = _checkpoint_frames(out, own)
        entry: dict[str, Any] = {"name": checkpoint.name, "spec": checkpoint.spec, "step": checkpoint.step,
                                 "checkpoint": own[0].checkpoint_hash if own else None,
                                 "shards_total": len(own), "shards_done": len(markers)}
        entry["complete"] = bool(own) and len(markers) == len(own)
        if frames:
            heads = pl.concat(frames, how="diagonal_relaxed").collect()
            summary = _checkpoint_summary(checkpoint, own, markers, heads, spec)
            entry["out"] = str(out / checkpoint.name)
            entry["rows"] = heads.height
            entry["finished"] = _finished(out / checkpoint.name, summary)
            if not entry["finished"] and not _up_to_date(out / checkpoint.name, summary):  # unchanged: not rewritten
                write_scan(out / checkpoint.name, heads, summary)
            verdict = _read_json(out / checkpoint.name / "summary.json").get("verdict") or {}
            entry["verdict"] = verdict.get("headline")
            rows_of_series += series_rows(checkpoint, heads, summary)
            merged += [f.with_columns(pl.lit(checkpoint.name).alias("checkpoint_name"),
                                      pl.lit(checkpoint.step, dtype=pl.Int64).alias("step")) for f in frames]
        checkpoints.append(entry)
    rows = 0
    if merged:
        table = pl.concat(merged, how="diagonal_relaxed").collect()
        extra = ["checkpoint_name", "step"]
        table = table.select([c for c in table.columns if c not in extra] + extra)
        keys = ["checkpoint_name", *ROW_KEYS]
        if table.select(pl.struct(keys).is_duplicated().any()).item():  # impossible by construction
            raise RuntimeError("merged head table has duplicate rows; the shard plan overlaps")
        write_parquet(out / "heads.parquet", table)
        rows = table.height
    series = None
    if len(spec.checkpoints) > 1 and rows_of_series:
        series = write_series(out, pl.DataFrame(rows_of_series, infer_schema_length=None))
    summary = {
        "name": spec.name, "source": spec.source, "gascan_version": gascan_version(), "executor": executor,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_seconds": round(time.time() - started, 2),
        "shards": {"total": len(shards) if total is None else total, "ran": ran, "skipped": skipped,
                   "failed": len(failures),
                   "done": sum(c["shards_done"] + bool(c.get("finished")) for c in checkpoints)},
        "tasks": spec.tasks, "options": spec.scan.as_dict() | {
            "layers_per_shard": spec.layers_per_shard}, "load": asdict(spec.load),
        "failures": failures, "checkpoints": checkpoints, "heads_rows": rows, "series": series,
    }
    write_json(out / "batch_summary.json", jsonable(summary))
    return summary
