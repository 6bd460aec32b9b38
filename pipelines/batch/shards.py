"""The shard plan and its storage: keys, the checkpoint hash cache, completion markers, the lock.

A shard is one unit of work: a sweep shard is one checkpoint's heads in one layer range for one task;
a finish shard is one checkpoint's stages after the sweep (evidence, pairs, verdict, report), planned
once all its sweep shards are complete. Every shard has a key, the sha256 of everything its output
depends on (checkpoint content hash, resolved task configuration, scan options, layer range, gascan
version; a finish shard: its sweep shards' keys and the after-sweep settings). A finished shard's output is written atomically,
then its completion marker (``<stem>.done.json``); a rerun skips every shard whose marker and output
agree, so an unchanged checkpoint is not rescanned and a changed one is.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import polars as pl

from discovery.artifacts import jsonable
from discovery.errors import GascanError
from discovery.model import PICKLE_SUFFIXES
from pipelines.batch.spec import BatchSpec, Checkpoint, _safe_name, gascan_version, local_path
from pipelines.options import AFTER_SWEEP_SETTINGS, TABLE_VERSION, LoadOptions, ScanOptions

STATE_DIR = ".gascan-batch"
SHARD_DIR = "shards"
MARKER_SUFFIX = ".done.json"
ROW_KEYS = ("task", "kind", "layer", "head")
# execution settings: they change how a shard runs, not what it computes, so they stay out of its key
NOT_IN_KEY = ("max_memory_mb", "device")


@dataclass
class Shard:
    """One unit of work: a checkpoint's heads in ``layers`` (start, stop) for one task.

    ``scan`` holds the :class:`~pipelines.options.ScanOptions` as a dict, so a worker can receive a
    shard without importing torch (the scan imports it when it runs). A ``finish`` shard (``stage``)
    runs the pipeline's stages after the sweep on a checkpoint's merged sweep tables (``inputs``:
    the head table as parquet bytes and the checkpoint summary) and returns the scan directory's files.
    """

    checkpoint: Checkpoint
    checkpoint_hash: str
    task: str
    scan: dict[str, Any]
    layers: tuple[int, int] | None
    n_layers: int | None
    key: str
    load: LoadOptions = field(default_factory=LoadOptions)
    stage: str = "sweep"  # or "finish"
    inputs: dict[str, Any] | None = None  # finish: {"heads": parquet bytes, "summary": dict}

    @property
    def stem(self) -> str:
        if self.stage == "finish":
            return f"finish.{self.key[:16]}"
        span = "all" if self.layers is None else f"L{self.layers[0]:03d}-{self.layers[1]:03d}"
        return f"{_safe_name(self.task)}.{span}.{self.key[:16]}"

    @property
    def label(self) -> str:
        if self.stage == "finish":
            return f"{self.checkpoint.name} evidence, pairs, verdict, report"
        span = "all layers" if self.layers is None else f"layers {self.layers[0]}-{self.layers[1] - 1}"
        return f"{self.checkpoint.name} {self.task} {span}"

    def scan_options(self) -> ScanOptions:
        return ScanOptions(**self.scan)

    def layer_list(self) -> list[int] | None:
        return None if self.layers is None else list(range(*self.layers))


@dataclass
class ShardResult:
    """What a shard computed: its head rows, the task summary and facts about the model."""

    frame: pl.DataFrame
    summary: dict[str, Any]
    model_info: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)  # a finish shard: the scan directory's files
    seconds: float = 0.0
    pid: int = 0
    host: str = ""


@dataclass
class ShardOutcome:
    """A shard's end: a result, or an error (``crashed``: the worker process died)."""

    shard: Shard
    result: ShardResult | None = None
    error: str | None = None
    attempts: int = 1
    crashed: bool = False

    @property
    def ok(self) -> bool:
        return self.result is not None


def weight_files(spec: str) -> list[Path]:
    """The files whose bytes make a checkpoint's content hash (as ``LoadedModel.checkpoint_hash``)."""
    path = local_path(spec)
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.safetensors"))
    return files or sorted(p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)


def _hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


class CheckpointInfo:
    """Content hash and layer count of checkpoints, cached in ``DIR/.gascan-batch/checkpoints.json``
    by each weight file's (name, size, mtime): a checkpoint is re-read only when a file changed."""

    def __init__(self, out: Path | None, load: LoadOptions) -> None:
        self.path = out / STATE_DIR / "checkpoints.json" if out is not None else None
        self.load = load
        self.cache: dict[str, Any] = {}
        if self.path is not None and self.path.is_file():
            with contextlib.suppress(OSError, ValueError):
                self.cache = json.loads(self.path.read_text())
        self.dirty = False

    def _stats(self, files: list[Path]) -> list[list[Any]]:
        out = []
        for p in files:
            st = p.stat()
            out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
        return out

    def get(self, checkpoint: Checkpoint, need_layers: bool) -> tuple[str, int | None]:
        if checkpoint.spec.startswith("tiny:"):
            return self._tiny(checkpoint.spec, need_layers)
        path = local_path(checkpoint.spec)
        if not path.exists():
            raise GascanError(f"checkpoint {checkpoint.spec} disappeared", "restore it or remove it from the spec")
        files = weight_files(checkpoint.spec)
        if not files:
            raise GascanError(f"{checkpoint.spec} has no weight files (*.safetensors)",
                              "copy the weights next to config.json")
        stats = self._stats(files)
        entry = self.cache.get(str(path.resolve()))
        if not entry or entry.get("files") != stats:
            entry = {"files": stats, "hash": _hash_files(files), "n_layers": None}
            self.cache[str(path.resolve())] = entry
            self.dirty = True
        if need_layers and entry.get("n_layers") is None:
            entry["n_layers"] = _config_layers(path)
            self.dirty = True
        return entry["hash"], entry.get("n_layers")

    def _tiny(self, spec: str, need_layers: bool) -> tuple[str, int | None]:
        from discovery.model.loading import load_model

        lm = load_model(spec, dtype=self.load.dtype)
        return lm.checkpoint_hash(), lm.inventory.n_layers

    def save(self) -> None:
        if self.dirty and self.path is not None:
            from discovery.io import write_json

            write_json(self.path, self.cache)
            self.dirty = False


def _config_layers(path: Path) -> int:
    """Decoder layers from the checkpoint's config (no weights loaded)."""
    from transformers import AutoConfig

    try:
        if path.is_file():
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        else:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers raises many types here
        raise GascanError(f"cannot read the config of {path} ({err.__class__.__name__})",
                          "fix the checkpoint, or drop layers_per_shard") from None
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        raise GascanError(f"the config of {path} gives no layer count", "drop layers_per_shard for this batch")
    return layers


def task_file_hash(task: str) -> str | None:
    from discovery.tasks import split_spec

    _, path = split_spec(task)
    if path is None or not Path(path).is_file():
        return None
    return _hash_files([Path(path)])


def _model_task_defaults(checkpoint: Checkpoint) -> dict[str, dict[str, Any]]:
    """The task options a toy checkpoint was trained with (its training.json), as ``gascan scan`` uses."""
    from discovery.toy import trained_task_options

    if checkpoint.spec.startswith("tiny:"):
        return {}
    return trained_task_options(weight_files(checkpoint.spec))


def shard_key(checkpoint_hash: str, task: str, options: ScanOptions, layers: tuple[int, int] | None,
              n_layers: int | None, load: LoadOptions, version: str) -> str:
    """sha256 of everything a shard's rows depend on (execution settings excluded, see NOT_IN_KEY; so are the
    after-sweep settings, which key the finish shard instead: a new budget reruns only the finish)."""
    scan = {k: v for k, v in options.as_dict().items()
            if k not in ("tasks", "task_options", *NOT_IN_KEY, *AFTER_SWEEP_SETTINGS)}
    payload = {
        "checkpoint": checkpoint_hash, "task": task, "task_options": options.options_for(task),
        "task_file": task_file_hash(task), "scan": scan, "layers": layers, "n_layers": n_layers,
        "load": {k: v for k, v in asdict(load).items() if k not in NOT_IN_KEY},
        "gascan": version, "table_version": TABLE_VERSION,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def plan_shards(spec: BatchSpec, out: str | os.PathLike | None = None, version: str | None = None,
                errors: list[dict[str, Any]] | None = None) -> list[Shard]:
    """Every shard of the batch, grouped by checkpoint (so a worker's model cache is reused).

    A checkpoint that cannot be planned (weights missing, unreadable config) raises, or, when an
    ``errors`` list is given, is recorded there and skipped so the other checkpoints still run.
    """
    version = version or gascan_version()
    info = CheckpointInfo(Path(out) if out is not None else None, spec.load)
    shards: list[Shard] = []
    try:
        for checkpoint in spec.checkpoints:
            try:
                digest, n_layers = info.get(checkpoint, spec.layers_per_shard is not None)
            except GascanError as err:
                if errors is None:
                    raise
                errors.append({"shard": f"{checkpoint.name} (all shards)", "key": None, "checkpoint": checkpoint.name,
                               "task": None, "layers": None, "attempts": 0, "crashed": False, "reason": str(err)})
                continue
            defaults = _model_task_defaults(checkpoint)
            if spec.layers_per_shard is None or n_layers is None:
                ranges: list[tuple[int, int] | None] = [None]
            else:
                step = spec.layers_per_shard
                ranges = [(start, min(start + step, n_layers)) for start in range(0, n_layers, step)]
            for task in spec.tasks:
                options = replace(spec.scan, tasks=[task], task_options={task: spec.task_options(task, defaults)})
                for layers in ranges:
                    key = shard_key(digest, task, options, layers, n_layers if layers else None, spec.load, version)
                    shards.append(Shard(checkpoint, digest, task, options.as_dict(), layers,
                                        n_layers if layers else None, key, spec.load))
    finally:
        info.save()
    return shards


def finish_key(sweep_keys: Sequence[str], version: str, scan: Mapping[str, Any]) -> str:
    """The key of a checkpoint's finish shard: every sweep shard it reads, the after-sweep settings of its
    ``scan`` options (the evidence budget) and the gascan version."""
    settings = {k: scan.get(k) for k in AFTER_SWEEP_SETTINGS}
    payload = {"stage": "finish", "sweeps": sorted(sweep_keys), "settings": settings, "gascan": version,
               "table_version": TABLE_VERSION}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def finish_shard_for(checkpoint_shards: Sequence[Shard], heads_parquet: bytes, summary: dict[str, Any],
                     version: str | None = None) -> Shard:
    """The finish shard of one checkpoint whose sweep shards are all complete."""
    first = checkpoint_shards[0]
    key = finish_key([s.key for s in checkpoint_shards], version or gascan_version(), first.scan)
    return Shard(first.checkpoint, first.checkpoint_hash, "*", first.scan, None, None, key, first.load,
                 stage="finish", inputs={"heads": heads_parquet, "summary": summary})


def check_rows(shard: Shard, frame: pl.DataFrame) -> None:
    """A sweep shard's rows: its task only, its layers only, one row per head."""
    if shard.stage == "finish":
        return
    missing = [c for c in ROW_KEYS if c not in frame.columns]
    if missing:
        raise ValueError(f"shard table lacks columns {missing}")
    if frame.height and set(frame["task"].unique().to_list()) != {shard.task}:
        raise ValueError(f"shard table holds rows of other tasks than {shard.task}")
    if shard.layers is not None and frame.height:
        lo, hi = frame["layer"].min(), frame["layer"].max()
        if lo < shard.layers[0] or hi >= shard.layers[1]:
            raise ValueError(f"shard table has layers {lo}-{hi} outside {shard.layers[0]}-{shard.layers[1] - 1}")
    if frame.select(pl.struct(list(ROW_KEYS)).is_duplicated().any()).item():
        raise ValueError("shard table has duplicate heads")


def shard_paths(out: Path, shard: Shard) -> tuple[Path, Path]:
    folder = out / shard.checkpoint.name / SHARD_DIR
    return folder / f"{shard.stem}.parquet", folder / f"{shard.stem}{MARKER_SUFFIX}"


def read_marker(out: Path, shard: Shard) -> dict[str, Any] | None:
    """The shard's completion marker if the shard is complete (marker and table agree), else None."""
    table, marker = shard_paths(out, shard)
    if shard.stage == "finish":
        return _finish_marker(out, shard, marker)
    if not marker.is_file() or not table.is_file():
        return None
    try:
        info = json.loads(marker.read_text())
        rows = pl.scan_parquet(table).select(pl.len()).collect().item()
    except (OSError, ValueError, pl.exceptions.PolarsError):
        return None
    if info.get("key") != shard.key or info.get("rows") != rows:
        return None
    return info


def _finish_marker(out: Path, shard: Shard, marker: Path) -> dict[str, Any] | None:
    """A finish shard is complete when its marker has its key and every file it lists is there."""
    try:
        info = json.loads(marker.read_text()) if marker.is_file() else None
    except (OSError, ValueError):
        return None
    if not info or info.get("key") != shard.key:
        return None
    folder = out / shard.checkpoint.name
    if not all((folder / name).is_file() for name in info.get("files", [])):
        return None
    return info


def commit_shard(out: Path, outcome: ShardOutcome, *, skip_files: Sequence[str] = ()) -> dict[str, Any]:
    """Write a finished shard: its table or files (temp file + rename each), then its completion marker.

    A finish shard's files go into the checkpoint's directory (``skip_files``: names left out, e.g. the
    report when the batch writes none)."""
    from discovery.io import write_bytes, write_json, write_parquet

    shard, result = outcome.shard, outcome.result
    if result is None:
        raise ValueError(f"shard {shard.label} has no result to commit")
    table, marker = shard_paths(out, shard)
    if shard.stage == "finish":
        kept = {name: data for name, data in result.files.items()
                if not any(name == s or name.startswith(f"{s}/") for s in skip_files)}
        for name, data in kept.items():
            write_bytes(out / shard.checkpoint.name / name, data)
        info = {"key": shard.key, "stage": "finish", "files": sorted(kept), "checkpoint": shard.checkpoint.name,
                "seconds": result.seconds, "attempts": outcome.attempts, "pid": result.pid, "host": result.host,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gascan_version": gascan_version()}
        write_json(marker, jsonable(info))
        return info
    write_parquet(table, result.frame)
    info = {
        "key": shard.key, "rows": result.frame.height, "checkpoint": shard.checkpoint.name,
        "spec": shard.checkpoint.spec, "step": shard.checkpoint.step, "checkpoint_hash": shard.checkpoint_hash,
        "task": shard.task, "layers": list(shard.layers) if shard.layers else None, "seconds": result.seconds,
        "attempts": outcome.attempts, "pid": result.pid, "host": result.host,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gascan_version": gascan_version(),
        "task_summary": result.summary, "model_info": result.model_info,
    }
    write_json(marker, jsonable(info))
    return info


def clean_temp_files(out: Path, shards: Sequence[Shard]) -> int:
    """Remove half-written temporary files a killed driver left in the shard folders."""
    removed = 0
    for folder in {out / s.checkpoint.name / SHARD_DIR for s in shards}:
        if folder.is_dir():
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
                removed += 1
    return removed


@contextlib.contextmanager
def batch_lock(out: Path) -> Iterator[None]:
    """One batch at a time per output directory (two drivers would race on the same shards)."""
    state = out / STATE_DIR
    state.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with open(state / "lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise GascanError(f"another gascan batch is writing to {out}",
                              "wait for it to finish or choose another --out") from None
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
