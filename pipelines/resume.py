"""Resuming a scan: its fingerprint, where a rerun on the same directory starts, and each stage's commit.

A scan records its **fingerprint** in ``summary.json`` before its first stage: the scan options (without
execution settings), the checkpoint's content hash, the dtype, the head inventory, the content of task
files and the gascan version; its ``key`` is their sha256. Each stage commits by writing its files
(atomically), then its completion marker holding that key and its cost (:func:`commit`), then
``summary.json``'s ``stages``. A rerun of the same scan on the same directory starts at the first stage
without a valid marker (:func:`start_stage`); a directory that holds a scan of other options or another
checkpoint is refused up front, unless ``force`` starts over. A scan that differs only in settings the stages
after the sweep read (:data:`~pipelines.options.AFTER_SWEEP_SETTINGS`: the evidence budget) keeps its sweep and
reruns from the evidence tests: the directory adopts the new fingerprint (:func:`adopt`).

``GASCAN_TEST_INTERRUPT=STAGE:SIGNAL`` (tests only) makes the process send itself SIGINT or SIGKILL once
STAGE has written its files and before its marker, the worst moment to stop; ``STAGE:SIGNAL:start`` at the
stage's start (:func:`test_interrupt`).
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from discovery.artifacts import (
    clear_scan,
    drop_markers,
    jsonable,
    marker_path,
    read_marker,
    read_summary,
    sync_stages,
    write_marker,
)
from discovery.errors import OutputError
from discovery.io import write_json
from discovery.measure.cost import Cost
from pipelines.options import AFTER_SWEEP_SETTINGS, TABLE_VERSION, ScanOptions

TEST_HOOK = "GASCAN_TEST_INTERRUPT"
EXECUTION_SETTINGS = ("max_memory_mb",)  # change how a scan runs, not what it computes
FIX = "pass --force to start over, or choose another --out"


def new_run_id() -> str:
    """An id for one invocation; each stage's record names the run that computed it."""
    return uuid.uuid4().hex[:12]


def fingerprint(lm, options: ScanOptions) -> dict[str, Any]:
    """What a scan's results depend on, and ``key``, its sha256."""
    from pipelines.batch.shards import task_file_hash
    from pipelines.batch.spec import gascan_version

    scan = {k: v for k, v in options.as_dict().items() if k not in EXECUTION_SETTINGS}
    dtype = str(next(lm.model.parameters()).dtype).removeprefix("torch.")
    body = {"options": jsonable(scan), "checkpoint": lm.checkpoint_hash(), "dtype": dtype,
            "heads": lm.inventory.n_heads(), "n_layers": lm.inventory.n_layers,
            "task_files": {t: task_file_hash(t) for t in options.tasks},
            "table_version": TABLE_VERSION, "gascan": gascan_version()}
    return _keyed(body)


def _keyed(body: Mapping[str, Any]) -> dict[str, Any]:
    """A fingerprint: ``body`` and ``key``, the sha256 of the rest."""
    body = {k: v for k, v in body.items() if k != "key"}
    return {**body, "key": hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()}


def sweep_part(fp: Mapping[str, Any]) -> dict[str, Any]:
    """What the sweep's results depend on: the fingerprint without its key and the after-sweep settings."""
    options = {k: v for k, v in (fp.get("options") or {}).items() if k not in AFTER_SWEEP_SETTINGS}
    return {**{k: v for k, v in fp.items() if k != "key"}, "options": options}


def with_settings(fp: Mapping[str, Any], **settings: Any) -> dict[str, Any]:
    """``fp`` with after-sweep ``settings`` changed (``budget="120"``), keyed again."""
    unknown = set(settings) - set(AFTER_SWEEP_SETTINGS)
    if unknown:
        raise ValueError(f"{sorted(unknown)} are not after-sweep settings {AFTER_SWEEP_SETTINGS}")
    return _keyed({**fp, "options": {**(fp.get("options") or {}), **settings}})


def difference(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> str | None:
    """The first field where two fingerprints differ, in words (None when they agree)."""
    for name in sorted(set(old) | set(new)):
        if name == "key":
            continue
        a, b = old.get(name), new.get(name)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found = difference(a, b, f"{prefix}{name}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{name} {json.dumps(a, default=str)[:60]}, now {json.dumps(b, default=str)[:60]}"
    return None


def _refuse(out: Path, what: str) -> OutputError:
    return OutputError(f"--out {out} holds {what}", FIX)


def start_stage(out: str | Path, fp: Mapping[str, Any], stages: Sequence[str], *, force: bool = False) -> str | None:
    """The first stage a scan with fingerprint ``fp`` must run in ``out`` (None: every stage is complete).

    A new or emptied directory starts at the first stage; a directory that holds this scan resumes; one
    holding another scan (other options, another checkpoint, or no fingerprint) is refused, unless ``force``
    clears it (gascan's own files only)."""
    out = Path(out)
    if force:
        clear_scan(out)
        return stages[0]
    summary = read_summary(out)
    if not summary:
        return stages[0]
    old = summary.get("fingerprint")
    if not isinstance(old, Mapping):
        raise _refuse(out, "a scan without a resume record (written by an older gascan or by gascan batch)")
    if old.get("key") != fp["key"]:
        if sweep_part(old) != sweep_part(fp):
            raise _refuse(out, f"a scan with other settings ({difference(old, fp) or 'another fingerprint'})")
        # only what the stages after the sweep read changed: a finished sweep is kept
        return stages[1] if read_marker(out, stages[0], old["key"]) is not None else stages[0]
    for stage in stages:
        if read_marker(out, stage, fp["key"]) is None:
            return stage
    return None


def precheck(out: str | Path, *, force: bool, tasks: Sequence[str], ablation: str, prompts: int, seed: int,
             given: Mapping[str, Any]) -> None:
    """Before the model loads: refuse a directory whose scan was asked with other command-line options
    (the full fingerprint, checkpoint included, is checked once the model is loaded)."""
    if force:
        return
    summary = read_summary(out)
    if not summary:
        return
    old = summary.get("fingerprint")
    if not isinstance(old, Mapping):
        raise _refuse(Path(out), "a scan without a resume record (written by an older gascan or by gascan batch)")
    opts = old.get("options") or {}
    asked = {"tasks": list(tasks), "ablation": ablation, "prompts": prompts, "seed": seed}
    for name, value in asked.items():
        if opts.get(name) != value:
            raise _refuse(Path(out), f"a scan with {name} {json.dumps(opts.get(name))}, not {json.dumps(value)}")
    for task in tasks:
        held = (opts.get("task_options") or {}).get(task) or {}
        for name, value in given.items():
            if name not in held or str(held[name]) != str(value):
                raise _refuse(Path(out), f"a scan with {task} option {name}={held.get(name)!r}, not {value!r}")


def begin(out: str | Path, fp: Mapping[str, Any], stages: Sequence[str], start: str) -> None:
    """Before ``start`` runs: forget the markers from ``start`` on, and record the fingerprint (starting
    afresh, in a new ``summary.json``; later, where only after-sweep settings changed, by :func:`adopt`)."""
    from discovery.artifacts import update_summary

    drop_markers(out, stages[stages.index(start):])
    if start == stages[0]:
        update_summary(out, {"fingerprint": fp})
    elif "options" in fp:
        adopt(out, fp, stages[:stages.index(start)])
    sync_stages(out, stages, fp.get("key"))


def adopt(out: str | Path, fp: Mapping[str, Any], kept: Sequence[str]) -> None:
    """Make the scan in ``out`` the scan ``fp`` describes, which differs from it at most in after-sweep
    settings: ``summary.json``'s fingerprint and options take ``fp``'s, and the completion markers of the
    ``kept`` stages (those the change does not touch) name the new key. A no-op when the key is unchanged."""
    from discovery.artifacts import update_summary

    summary = read_summary(out)
    old = summary.get("fingerprint") or {}
    if old.get("key") == fp["key"]:
        return
    if sweep_part(old) != sweep_part(fp):
        raise _refuse(Path(out), f"a scan with other settings ({difference(old, fp) or 'another fingerprint'})")
    if any(stage != "sweep" for stage in kept):
        raise ValueError(f"after-sweep settings change every stage after the sweep; cannot keep {list(kept)}")
    for stage in kept:
        info = read_marker(out, stage, old.get("key"))
        if info is not None:
            write_json(marker_path(out, stage), {**info, "key": fp["key"]})
    options = {**(summary.get("options") or {}), **{k: fp["options"][k] for k in AFTER_SWEEP_SETTINGS
                                                    if k in fp["options"]}}
    update_summary(out, {"fingerprint": dict(fp), "options": options})


def test_interrupt(stage: str, when: str = "end") -> None:
    """Tests only: stop this process as ``GASCAN_TEST_INTERRUPT=STAGE:INT|KILL[:start]`` asks, at ``stage``'s
    end (its files written, its marker not) or start."""
    wanted = os.environ.get(TEST_HOOK, "")
    name, _, rest = wanted.partition(":")
    sig, _, at = rest.partition(":")
    if wanted and name == stage and (at or "end") == when:
        os.kill(os.getpid(), signal.SIGKILL if sig.upper() in ("KILL", "SIGKILL") else signal.SIGINT)


def commit(out: str | Path, stage: str, stages: Sequence[str], key: str | None, files: Sequence[str], cost: Cost,
           unit_flops: float | None, run: str, **extra: Any) -> dict[str, Any]:
    """Finish ``stage``: its completion marker (after its ``files``), then ``summary.json``'s ``stages``."""
    test_interrupt(stage)
    record = {**cost.record(unit_flops), "run": run, **extra}
    write_marker(out, stage, key, files, record)
    return sync_stages(out, stages, key)
