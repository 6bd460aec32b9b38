"""``gascan batch``: many checkpoints x tasks as resumable shards, merged into one set of tables.

A batch is a spec (a TOML/YAML file or a directory of checkpoints) turned into *shards*, one per
(checkpoint, task, layer range). Every shard has a key: the sha256 of the checkpoint's content hash,
the resolved task configuration, the scan options, the layer range and the gascan version. The
driver writes a finished shard's rows atomically (``<stem>.parquet``) and then its completion marker
(``<stem>.done.json``, row count, key and timing); a rerun skips every shard whose marker and table
agree, so an unchanged checkpoint is not rescanned and a changed one is. Shards run on an executor
(:mod:`pipelines.executors`: in-process or Ray actors) through one shared shard function, so both
give identical tables. The merge reads exactly one file per planned shard with a lazy
``pl.scan_parquet``; layer ranges are disjoint, so a duplicate row cannot arise.

Outputs under ``DIR``: ``<checkpoint>/heads.parquet`` + ``summary.json`` (as ``gascan scan`` writes
them) and a report where the report module exists; ``heads.parquet`` (all checkpoints, with
``checkpoint_name`` and ``step``); ``batch_summary.json``; for a series, ``series.parquet`` and
``series.png`` (key metrics against training step).
"""
from __future__ import annotations

import contextlib
import difflib
import glob
import hashlib
import json
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from discovery.errors import GascanError

if TYPE_CHECKING:
    from pipelines.sweep import ScanOptions

STATE_DIR = ".gascan-batch"
SHARD_DIR = "shards"
MARKER_SUFFIX = ".done.json"
ROW_KEYS = ("task", "kind", "layer", "head")
SCAN_KEYS = ("ablation", "prompts", "seed", "max_memory_mb", "bootstrap", "chunk_prompts", "layers_per_shard")
LOAD_KEYS = ("dtype", "device", "allow_pickle", "trust_remote_code", "mamba1_group_width")
SCAN_TYPES: dict[str, tuple[type, ...]] = {
    "ablation": (str,), "prompts": (int,), "seed": (int,), "max_memory_mb": (int, float), "bootstrap": (int,),
    "chunk_prompts": (int,), "layers_per_shard": (int,)}
SPEC_KEYS = ("name", "models", "tasks", "task_options", "scan", "load")
MODEL_KEYS = ("path", "series", "name", "step")
# execution settings: they change how a shard runs, not what it computes, so they stay out of its key
NOT_IN_KEY = ("max_memory_mb", "device")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SERIES_METRICS = ("acc", "logit_diff", "max_agg_select", "max_gather_score", "top_d_ld_all")


def gascan_version() -> str:
    """The installed gascan version (part of every shard key: a new version rescans)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gascan")
    except PackageNotFoundError:
        return "unknown"


# --------------------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class Checkpoint:
    """One model to scan: a unique output ``name``, the model ``spec`` (path or ``tiny:ARCH``), its step."""

    name: str
    spec: str
    step: int | None = None


@dataclass(frozen=True)
class LoadOptions:
    """How workers load every checkpoint (see :func:`discovery.loading.load_model`)."""

    dtype: str = "float32"
    device: str = "cpu"
    allow_pickle: bool = False
    trust_remote_code: bool = False
    mamba1_group_width: int | None = None


@dataclass
class BatchSpec:
    """Checkpoints, tasks and scan options of one batch."""

    checkpoints: list[Checkpoint]
    tasks: list[str] = field(default_factory=lambda: ["mc"])
    task_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    ablation: str = "exact"
    prompts: int = 64
    seed: int = 0
    max_memory_mb: float | None = None
    bootstrap: int = 1000
    chunk_prompts: int = 16
    layers_per_shard: int | None = None
    load: LoadOptions = field(default_factory=LoadOptions)
    name: str = "batch"
    source: str | None = None
    base_dir: str = "."

    def __post_init__(self) -> None:
        if not self.checkpoints:
            raise GascanError("the batch names no checkpoints", "list model directories under `models` in the spec")
        if not self.tasks:
            raise GascanError("the batch names no tasks", "set tasks = [\"mc\"] (or more) in the spec")
        if self.layers_per_shard is not None and self.layers_per_shard < 1:
            raise GascanError(f"layers_per_shard = {self.layers_per_shard} is not positive",
                              "use 1 or more, or leave it out for one shard per checkpoint and task")
        self.scan_options([self.tasks[0]])  # validates ablation and prompts

    def scan_options(self, tasks: list[str], task_options: dict[str, dict[str, Any]] | None = None) -> ScanOptions:
        from pipelines.sweep import ScanOptions

        return ScanOptions(tasks=list(tasks), task_options=dict(task_options or {}), ablation=self.ablation,
                           prompts=self.prompts, seed=self.seed, max_memory_mb=self.max_memory_mb,
                           bootstrap=self.bootstrap, chunk_prompts=self.chunk_prompts)


def _unknown(keys: Sequence[str], known: Sequence[str], where: str) -> None:
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            raise GascanError(f"unknown key {key!r} in {where}", hint)


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "model"


def _step_of(directory: Path) -> int | None:
    """A checkpoint's training step: ``training.json`` ``step``, else ``step-N`` in its name."""
    meta = directory / "training.json"
    if meta.is_file():
        with contextlib.suppress(OSError, ValueError):
            step = json.loads(meta.read_text()).get("step")
            if isinstance(step, int):
                return step
    match = re.search(r"(?:step|ckpt|checkpoint|iter)[-_]?(\d+)$", directory.name)
    return int(match.group(1)) if match else None


def _is_checkpoint(path: Path) -> bool:
    return (path.is_dir() and (path / "config.json").is_file()) or (path.is_file() and path.suffix == ".gguf")


def discover_series(directory: str | os.PathLike) -> list[Checkpoint]:
    """The checkpoints of a directory: itself (if it holds config.json), every subdirectory with a
    config.json, and ``checkpoints/*`` (the trainer's ``step-N`` series); sorted by step, final last."""
    root = Path(directory)
    if not root.is_dir():
        raise GascanError(f"{root} is not a directory", "pass a directory of checkpoints or a TOML/YAML spec")
    found = [root] if _is_checkpoint(root) else []
    for parent in (root, root / "checkpoints"):
        if parent.is_dir():
            found += sorted(p for p in parent.iterdir() if p.is_dir() and _is_checkpoint(p))
    if not found:
        raise GascanError(f"no checkpoints in {root} (no subdirectory holds a config.json)",
                          "pass a directory of Hugging Face checkpoints, or a spec file listing models")
    items = [(p, _step_of(p)) for p in found]
    # the root is the final model: after its own checkpoints when it has no step of its own
    items.sort(key=lambda item: (item[1] is None, item[1] if item[1] is not None else 0, item[0] == root))
    return _named([(str(p), p, step) for p, step in items])


def _named(entries: list[tuple[str, Path | None, int | None]], names: list[str | None] | None = None
           ) -> list[Checkpoint]:
    """Give each checkpoint a unique, filesystem-safe output name (parent prefixed on a clash)."""
    names = names or [None] * len(entries)
    base = []
    for (spec, path, _), name in zip(entries, names):
        base.append(_safe_name(name) if name else _safe_name(path.stem if path and path.is_file() else
                                                             (path.name if path else spec)))
    out: list[Checkpoint] = []
    used: set[str] = set()
    for i, ((spec, path, step), name) in enumerate(zip(entries, base)):
        if base.count(name) > 1 and path is not None and not names[i]:
            name = _safe_name(f"{path.parent.name}-{name}")
        unique, n = name, 2
        while unique in used:
            unique, n = f"{name}-{n}", n + 1
        used.add(unique)
        out.append(Checkpoint(unique, spec, step))
    return out


def _expand_model(entry: Any, base: Path) -> tuple[list[tuple[str, Path | None, int | None]], list[str | None]]:
    """One ``models`` entry (a string, or a table with path/series/name/step) to checkpoints."""
    if isinstance(entry, str):
        entry = {"path": entry}
    if not isinstance(entry, dict):
        raise GascanError(f"models entry {entry!r} is neither a string nor a table",
                          'write models = ["path", ...] or [[models]] tables with path = "..."')
    _unknown(list(entry), MODEL_KEYS, "a models entry")
    if ("path" in entry) == ("series" in entry):
        raise GascanError(f"models entry {entry} needs exactly one of `path` and `series`",
                          'use path = "DIR, GLOB or tiny:ARCH" or series = "DIR" (a training run)')
    if "series" in entry:
        series = discover_series(_resolve(str(entry["series"]), base))
        prefix = entry.get("name")
        entries = [(c.spec, Path(c.spec), c.step) for c in series]
        return entries, [f"{prefix}-{c.name}" if prefix else None for c in series]
    text = str(entry["path"])
    step = entry.get("step")
    if step is not None and not isinstance(step, int):
        raise GascanError(f"step {step!r} of {text} is not an integer", "write step = 1200")
    if text.startswith("tiny:"):
        return [(text, None, step)], [entry.get("name") or _safe_name(text.replace(":", "-"))]
    if any(ch in text for ch in "*?["):
        matches = [Path(p) for p in sorted(glob.glob(str(_resolve(text, base))))]
        hits = [p for p in matches if _is_checkpoint(p)]
        if not hits:
            raise GascanError(f"the glob {text!r} matches no checkpoint",
                              "check the pattern (each match must hold a config.json or be a .gguf file)")
        return [(str(p), p, step if step is not None else _step_of(p)) for p in hits], [None] * len(hits)
    path = _resolve(text, base)
    if _is_checkpoint(path):
        return [(str(path), path, step if step is not None else _step_of(path))], [entry.get("name")]
    if path.is_dir():  # a directory of checkpoints
        series = discover_series(path)
        return [(c.spec, Path(c.spec), c.step) for c in series], [None] * len(series)
    if path.exists():
        raise GascanError(f"{text} is not a checkpoint", "pass a model directory (with config.json) or a .gguf file")
    raise GascanError(f"model path {text!r} does not exist", f"paths are relative to {base}; fix the path")


def _resolve(text: str, base: Path) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() else base / path


def _read_spec_file(path: Path) -> dict[str, Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise GascanError(f"{path} is YAML but PyYAML is not installed",
                              "pip install pyyaml, or write the spec as TOML") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            first = " ".join(str(err).split())[:200]
            raise GascanError(f"{path} is not valid YAML ({first})", "fix the YAML syntax") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise GascanError(f"{path} is not valid TOML ({err})", "fix the TOML syntax") from None
    if not isinstance(data, dict):
        raise GascanError(f"{path} holds no table of settings", "write models = [...] and tasks = [...] at top level")
    return data


def spec_from_dict(data: dict[str, Any], base: str | os.PathLike = ".", source: str | None = None) -> BatchSpec:
    """Build a :class:`BatchSpec` from a parsed spec file; relative paths are taken from ``base``."""
    base_path = Path(base)
    where = source or "the spec"
    _unknown(list(data), SPEC_KEYS, where)
    models = data.get("models")
    if not models:
        raise GascanError(f"{where} lists no models", 'add models = ["path/to/checkpoint", "runs/*/checkpoints/*"]')
    if isinstance(models, (str, dict)):
        models = [models]
    entries: list[tuple[str, Path | None, int | None]] = []
    names: list[str | None] = []
    for entry in models:
        more, more_names = _expand_model(entry, base_path)
        entries += more
        names += more_names
    tasks = data.get("tasks", ["mc"])
    if isinstance(tasks, str):
        tasks = [tasks]
    if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
        raise GascanError(f"tasks = {tasks!r} is not a list of task specs", 'write tasks = ["mc", "kv"]')
    tasks = [resolve_task(t, base_path) for t in tasks]
    scan = data.get("scan", {}) or {}
    load = data.get("load", {}) or {}
    task_options = data.get("task_options", {}) or {}
    for table, keys, label in ((scan, SCAN_KEYS, "[scan]"), (load, LOAD_KEYS, "[load]")):
        if not isinstance(table, dict):
            raise GascanError(f"{label} in {where} is not a table", f"write {label} with key = value lines")
        _unknown(list(table), keys, f"{label} of {where}")
    for key, value in scan.items():
        wanted = SCAN_TYPES[key]
        if value is not None and (not isinstance(value, wanted) or isinstance(value, bool)):
            raise GascanError(f"[scan] {key} = {value!r} in {where} has the wrong type",
                              f"give {key} as {' or '.join(t.__name__ for t in wanted)}")
    if not isinstance(task_options, dict) or not all(isinstance(v, dict) for v in task_options.values()):
        raise GascanError(f"[task_options] in {where} is not a table of tables", "write [task_options.mc] n_choices = 4")
    return BatchSpec(checkpoints=_named(entries, names), tasks=tasks,
                     task_options={k: dict(v) for k, v in task_options.items()},
                     load=LoadOptions(**load), name=str(data.get("name") or (Path(source).stem if source else "batch")),
                     source=source, base_dir=str(base_path), **scan)


def resolve_task(task: str, base: Path) -> str:
    """``mc:data.csv`` with the file resolved against the spec's directory."""
    from discovery.tasks import get_task_class, split_spec

    name, path = split_spec(task)
    get_task_class(name)  # unknown task: one line with did-you-mean, before any work
    if path is None:
        return task
    return f"{name}:{_resolve(path, base)}"


def load_spec(source: str | os.PathLike) -> BatchSpec:
    """A TOML/YAML spec file, or a directory of checkpoints (scanned with default options)."""
    path = Path(source)
    if path.is_dir():
        return BatchSpec(checkpoints=discover_series(path), name=_safe_name(path.name), source=str(path),
                         base_dir=str(path))
    if not path.is_file():
        raise GascanError(f"batch spec {str(source)!r} does not exist",
                          "pass a TOML/YAML spec file or a directory of checkpoints")
    return spec_from_dict(_read_spec_file(path), base=path.parent, source=str(path))


# -------------------------------------------------------------------------------- shard plan


@dataclass
class Shard:
    """One unit of work: a checkpoint's heads in ``layers`` (start, stop) for one task.

    ``scan`` holds the :class:`~pipelines.scan.ScanOptions` as a dict, so a worker can receive a
    shard without importing torch (the scan imports it when it runs).
    """

    checkpoint: Checkpoint
    checkpoint_hash: str
    task: str
    scan: dict[str, Any]
    layers: tuple[int, int] | None
    n_layers: int | None
    key: str
    load: LoadOptions = field(default_factory=LoadOptions)

    @property
    def stem(self) -> str:
        span = "all" if self.layers is None else f"L{self.layers[0]:03d}-{self.layers[1]:03d}"
        return f"{_safe_name(self.task)}.{span}.{self.key[:16]}"

    @property
    def label(self) -> str:
        span = "all layers" if self.layers is None else f"layers {self.layers[0]}-{self.layers[1] - 1}"
        return f"{self.checkpoint.name} {self.task} {span}"

    def scan_options(self) -> ScanOptions:
        from pipelines.sweep import ScanOptions

        return ScanOptions(**self.scan)

    def layer_list(self) -> list[int] | None:
        return None if self.layers is None else list(range(*self.layers))


def weight_files(spec: str) -> list[Path]:
    """The files whose bytes make a checkpoint's content hash (as ``LoadedModel.checkpoint_hash``)."""
    path = Path(spec)
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
        path = Path(checkpoint.spec)
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


def _task_file_hash(task: str) -> str | None:
    from discovery.tasks import split_spec

    _, path = split_spec(task)
    if path is None or not Path(path).is_file():
        return None
    return _hash_files([Path(path)])


def _model_task_defaults(checkpoint: Checkpoint) -> dict[str, dict[str, Any]]:
    """The task options a toy checkpoint was trained with (its training.json), as ``gascan scan`` uses."""
    from types import SimpleNamespace

    from pipelines.commands.scan import model_task_defaults

    if checkpoint.spec.startswith("tiny:"):
        return {}
    return model_task_defaults(SimpleNamespace(files=weight_files(checkpoint.spec)))


def shard_key(checkpoint_hash: str, task: str, options: ScanOptions, layers: tuple[int, int] | None,
              n_layers: int | None, load: LoadOptions, version: str) -> str:
    """sha256 of everything a shard's rows depend on (execution settings excluded, see NOT_IN_KEY)."""
    from pipelines.sweep import TABLE_VERSION

    scan = {k: v for k, v in options.as_dict().items() if k not in ("tasks", "task_options", *NOT_IN_KEY)}
    payload = {
        "checkpoint": checkpoint_hash, "task": task, "task_options": options.options_for(task),
        "task_file": _task_file_hash(task), "scan": scan, "layers": layers, "n_layers": n_layers,
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
                name = task.split(":", 1)[0]
                opts = dict(defaults.get(name, {}))
                opts.update(spec.task_options.get(name, {}))
                if task != name:
                    opts.update(spec.task_options.get(task, {}))
                options = spec.scan_options([task], {task: opts})
                for layers in ranges:
                    key = shard_key(digest, task, options, layers, n_layers if layers else None, spec.load, version)
                    shards.append(Shard(checkpoint, digest, task, options.as_dict(), layers,
                                        n_layers if layers else None, key, spec.load))
    finally:
        info.save()
    return shards


# ----------------------------------------------------------------------------- shard running


@dataclass
class ShardResult:
    """What a shard computed: its head rows, the task summary and facts about the model."""

    frame: pl.DataFrame
    summary: dict[str, Any]
    model_info: dict[str, Any]
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


class ModelCache:
    """Loaded models by checkpoint (a worker loads each model once and serves all its shards);
    holds ``size`` models, least recently used evicted (1 by default: a big model fills a GPU)."""

    def __init__(self, load: LoadOptions, size: int = 1, threads: int | None = None) -> None:
        self.load = load
        self.size = size
        self.threads = threads  # torch threads, set before the first model work (a Ray actor: its CPUs)
        self.models: dict[tuple[str, str], Any] = {}
        self.loads = 0

    def get(self, checkpoint: Checkpoint):
        import torch

        from discovery.model.loading import load_model

        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        key = (checkpoint.spec, checkpoint.name)
        if key in self.models:
            self.models[key] = self.models.pop(key)  # most recent last
            return self.models[key]
        while len(self.models) >= self.size:
            self.models.pop(next(iter(self.models)))
            _free_memory()
        load = self.load
        lm = load_model(checkpoint.spec, dtype=load.dtype, device=load.device, allow_pickle=load.allow_pickle,
                        trust_remote_code=load.trust_remote_code, mamba1_group_width=load.mamba1_group_width)
        self.loads += 1
        self.models[key] = lm
        return lm


def _free_memory() -> None:
    import gc

    gc.collect()
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def scan_shard(shard: Shard, cache: ModelCache) -> ShardResult:
    """The default shard function: scan one task on one layer range of a (cached) model."""
    from pipelines.sweep import scan_task

    lm = cache.get(shard.checkpoint)
    if lm.checkpoint_hash() != shard.checkpoint_hash:
        raise GascanError(f"checkpoint {shard.checkpoint.spec} changed after the batch was planned",
                          "rerun the batch (the changed checkpoint is rescanned)")
    if shard.n_layers is not None and lm.inventory.n_layers != shard.n_layers:
        raise GascanError(f"{shard.checkpoint.spec} has {lm.inventory.n_layers} layers, its config "
                          f"{shard.n_layers}", "drop layers_per_shard for this model")
    frame, summary = scan_task(lm, shard.task, shard.scan_options(), layers=shard.layer_list())
    info = {"model": lm.name, "spec": lm.spec, "architecture": lm.inventory.architecture,
            "n_layers": lm.inventory.n_layers, "n_heads": lm.inventory.n_heads()}
    return ShardResult(frame, summary, info)


ShardFn = Callable[[Shard, ModelCache], ShardResult]


def execute_shard(shard_fn: ShardFn, shard: Shard, cache: ModelCache) -> ShardOutcome:
    """Run one shard where it is (driver or worker); an exception fails this shard, not the batch."""
    started = time.perf_counter()
    try:
        result = shard_fn(shard, cache)
        check_rows(shard, result.frame)
    except Exception as err:  # noqa: BLE001 - any error in user data or a model fails only this shard
        message = " ".join(f"{type(err).__name__}: {err}".split())[:500]
        return ShardOutcome(shard, error=message)
    result.seconds = round(time.perf_counter() - started, 3)
    result.pid = os.getpid()
    result.host = socket.gethostname()
    return ShardOutcome(shard, result=result)


def check_rows(shard: Shard, frame: pl.DataFrame) -> None:
    """A shard's rows: its task only, its layers only, one row per head."""
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


# ------------------------------------------------------------------------------ shard storage


def shard_paths(out: Path, shard: Shard) -> tuple[Path, Path]:
    folder = out / shard.checkpoint.name / SHARD_DIR
    return folder / f"{shard.stem}.parquet", folder / f"{shard.stem}{MARKER_SUFFIX}"


def read_marker(out: Path, shard: Shard) -> dict[str, Any] | None:
    """The shard's completion marker if the shard is complete (marker and table agree), else None."""
    table, marker = shard_paths(out, shard)
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


def commit_shard(out: Path, outcome: ShardOutcome) -> dict[str, Any]:
    """Write a finished shard: the table (temp file + rename), then its completion marker."""
    from discovery.io import write_json, write_parquet

    shard, result = outcome.shard, outcome.result
    assert result is not None
    table, marker = shard_paths(out, shard)
    write_parquet(table, result.frame)
    info = {
        "key": shard.key, "rows": result.frame.height, "checkpoint": shard.checkpoint.name,
        "spec": shard.checkpoint.spec, "step": shard.checkpoint.step, "checkpoint_hash": shard.checkpoint_hash,
        "task": shard.task, "layers": list(shard.layers) if shard.layers else None, "seconds": result.seconds,
        "attempts": outcome.attempts, "pid": result.pid, "host": result.host,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "gascan_version": gascan_version(),
        "task_summary": result.summary, "model_info": result.model_info,
    }
    write_json(marker, _json_safe(info))
    return info


def _json_safe(value: Any) -> Any:
    """NaN/inf become null (JSON has no NaN; null means 'not scored')."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


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


# ---------------------------------------------------------------------------------- the batch


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
              progress: bool = True, console=None, reports: bool = True) -> BatchResult:
    """Plan, skip what is complete, run the rest on ``executor`` (default serial), merge, summarise.

    ``reports``: write each complete checkpoint's report (where :mod:`discovery.report` exists).
    """
    from pipelines.executors import SerialExecutor

    executor = executor or SerialExecutor()
    out_dir = Path(out)
    started = time.time()
    with batch_lock(out_dir):
        failures: list[dict[str, Any]] = []
        shards = plan_shards(spec, out_dir, errors=failures)
        clean_temp_files(out_dir, shards)
        todo = [s for s in shards if read_marker(out_dir, s) is None]
        skipped = len(shards) - len(todo)
        ran = 0
        with _progress_bar(progress, console, len(shards), skipped) as tick, \
                contextlib.closing(executor.run(todo, shard_fn, spec.load)) as outcomes:
            for outcome in outcomes:
                if outcome.ok:
                    commit_shard(out_dir, outcome)
                    ran += 1
                else:
                    failures.append({"shard": outcome.shard.label, "key": outcome.shard.key,
                                     "checkpoint": outcome.shard.checkpoint.name, "task": outcome.shard.task,
                                     "layers": list(outcome.shard.layers) if outcome.shard.layers else None,
                                     "attempts": outcome.attempts, "crashed": outcome.crashed,
                                     "reason": outcome.error})
                tick(outcome.ok)
        summary = merge_batch(spec, out_dir, shards, failures=failures, executor=executor.describe(),
                              ran=ran, skipped=skipped, started=started, reports=reports)
    return BatchResult(out_dir, len(shards), ran, skipped, failures, summary)


@contextlib.contextmanager
def _progress_bar(enabled: bool, console, total: int, skipped: int) -> Iterator[Callable[[bool], None]]:
    """One bar for the whole batch: shards done (skipped ones count as done), failed, ETA."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bar = Progress(TextColumn("[bold]batch"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("shards  {task.fields[failed]} failed  {task.fields[skipped]} already done"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                   console=console or Console(stderr=True), disable=not enabled, transient=False)
    failed = [0]
    with bar:
        task = bar.add_task("batch", total=total, completed=skipped, failed=0, skipped=skipped)

        def tick(ok: bool) -> None:
            if not ok:
                failed[0] += 1
            bar.update(task, advance=1, failed=failed[0])

        yield tick


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
    from pipelines.sweep import TABLE_VERSION, top_effects

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
    options = spec.scan_options(spec.tasks, {s.task: s.scan["task_options"].get(s.task, {}) for s in shards})
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


def _up_to_date(directory: Path, summary: dict[str, Any], want_report: bool) -> bool:
    """Whether ``directory`` already holds the outputs of exactly these shards."""
    try:
        old = json.loads((directory / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    if want_report and not (directory / "report.html").is_file():
        return False
    return old.get("shard_keys") == summary["shard_keys"] and (directory / "heads.parquet").is_file()


def merge_batch(spec: BatchSpec, out: Path, shards: list[Shard], *, failures: list[dict[str, Any]],
                executor: dict[str, Any], ran: int, skipped: int, started: float,
                reports: bool = True) -> dict[str, Any]:
    """Per-checkpoint tables and summaries, the merged table, the series and ``batch_summary.json``."""
    from discovery.artifacts import write_scan
    from discovery.io import write_json, write_parquet

    by_checkpoint: dict[str, list[Shard]] = {}
    for shard in shards:
        by_checkpoint.setdefault(shard.checkpoint.name, []).append(shard)
    merged: list[pl.LazyFrame] = []
    checkpoints, series_rows, notes = [], [], []
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
            want_report = reports and entry["complete"]
            if not _up_to_date(out / checkpoint.name, summary, want_report):  # unchanged: not rewritten
                write_scan(out / checkpoint.name, heads, summary)
                if want_report:
                    note = _write_report(out / checkpoint.name)
                    if note:
                        notes.append(f"{checkpoint.name}: {note}")
            series_rows += _series_rows(checkpoint, heads, summary)
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
    if len(spec.checkpoints) > 1 and series_rows:
        series = write_series(out, pl.DataFrame(series_rows, infer_schema_length=None))
    summary = {
        "name": spec.name, "source": spec.source, "gascan_version": gascan_version(), "executor": executor,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_seconds": round(time.time() - started, 2),
        "shards": {"total": len(shards), "ran": ran, "skipped": skipped, "failed": len(failures),
                   "done": sum(c["shards_done"] for c in checkpoints)},
        "tasks": spec.tasks, "options": spec.scan_options(spec.tasks).as_dict() | {
            "layers_per_shard": spec.layers_per_shard}, "load": asdict(spec.load),
        "failures": failures, "checkpoints": checkpoints, "heads_rows": rows, "series": series, "notes": notes,
    }
    write_json(out / "batch_summary.json", _json_safe(summary))
    return summary


def _write_report(directory: Path) -> str | None:
    """The per-checkpoint report, where the report module exists; a failure is a note, not a lost batch."""
    try:
        from discovery.report import write_report
    except ImportError:
        return None
    try:
        write_report(directory)
    except Exception as err:  # noqa: BLE001 - a report bug must not discard finished scans
        return f"report failed ({type(err).__name__}: {err})"
    return None


def _series_rows(checkpoint: Checkpoint, heads: pl.DataFrame, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Key G&A metrics of one checkpoint, per task: clean accuracy, strongest pattern scores, largest effect."""
    rows = []
    for task, info in summary["tasks"].items():
        part = heads.filter(pl.col("task") == task)
        clean = info.get("clean") or {}
        row: dict[str, Any] = {"checkpoint_name": checkpoint.name, "step": checkpoint.step, "task": task,
                               "acc": clean.get("acc"), "logit_diff": clean.get("logit_diff")}
        for column, name in (("agg_select", "max_agg_select"), ("gather_score", "max_gather_score")):
            row[name] = part[column].max() if column in part.columns and part[column].null_count() < part.height \
                else None
            row[f"{name}_head"] = _top_head(part, column, descending=True)
        if "d_ld_all" in part.columns and part["d_ld_all"].null_count() < part.height:
            best = part.filter(pl.col("d_ld_all").is_not_null()).sort(pl.col("d_ld_all").abs(), descending=True)
            row["top_d_ld_all"] = best["d_ld_all"][0]
            row["top_d_ld_all_head"] = _head_name(best.row(0, named=True))
        else:
            row["top_d_ld_all"] = None
            row["top_d_ld_all_head"] = None
        rows.append(row)
    return rows


def _head_name(row: dict[str, Any]) -> str:
    return f"L{row['layer']}{'H' if row['kind'] == 'attn' else 'S'}{row['head']}"


def _top_head(part: pl.DataFrame, column: str, descending: bool) -> str | None:
    if column not in part.columns or part[column].null_count() == part.height:
        return None
    best = part.filter(pl.col(column).is_not_null()).sort(column, descending=descending)
    return _head_name(best.row(0, named=True))


def write_series(out: Path, table: pl.DataFrame) -> dict[str, Any]:
    """``series.parquet`` and ``series.png``: key metrics against training step (checkpoint order if none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from discovery.io import atomic_write, write_parquet

    write_parquet(out / "series.parquet", table)
    names = list(dict.fromkeys(table["checkpoint_name"].to_list()))
    steps = table["step"].to_list()
    by_step = all(s is not None for s in steps)
    labels = {"acc": "clean accuracy", "logit_diff": "clean logit diff", "max_agg_select": "max agg_select",
              "max_gather_score": "max gather_score", "top_d_ld_all": "largest |Δ logit diff| (signed)"}
    metrics = [m for m in SERIES_METRICS if m in table.columns and table[m].null_count() < table.height]
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(3.6 * max(len(metrics), 1), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for task in dict.fromkeys(table["task"].to_list()):
            part = table.filter(pl.col("task") == task)
            xs = part["step"].to_list() if by_step else [names.index(n) for n in part["checkpoint_name"]]
            ax.plot(xs, part[metric].to_list(), marker="o", label=task)
        ax.set_title(labels[metric], fontsize=9)
        ax.set_xlabel("training step" if by_step else "checkpoint")
        if not by_step:
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    atomic_write(out / "series.png", lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return {"table": str(out / "series.parquet"), "figure": str(out / "series.png"), "metrics": metrics,
            "x": "step" if by_step else "checkpoint"}


def override(spec: BatchSpec, **changes: Any) -> BatchSpec:
    """A copy of ``spec`` with the given (non-None) fields replaced and revalidated."""
    known = {f.name for f in fields(BatchSpec)}
    return replace(spec, **{k: v for k, v in changes.items() if v is not None and k in known})
