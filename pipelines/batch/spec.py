"""A batch spec: which checkpoints, which tasks, which scan and load options, how to shard.

A spec is a TOML/YAML file (``models``, ``tasks``, ``[scan]``, ``[load]``, ``[task_options.NAME]``) or a
directory of checkpoints. ``[scan]`` takes exactly the fields of :class:`~pipelines.options.ScanOptions`
(plus ``layers_per_shard``) and ``[load]`` those of :class:`~pipelines.options.LoadOptions`, so a batch
and ``gascan scan`` share one declaration of every option.
"""
from __future__ import annotations

import contextlib
import difflib
import glob
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from discovery.errors import GascanError
from discovery.model.spec import is_named, spec_path
from pipelines.options import LoadOptions, ScanOptions

SCAN_KEYS = (*ScanOptions.setting_names(), "layers_per_shard")
LOAD_KEYS = LoadOptions.names()
SCAN_TYPES: dict[str, tuple[type, ...]] = {
    "ablation": (str,), "prompts": (int,), "seed": (int,), "max_memory_mb": (int, float), "bootstrap": (int,),
    "chunk_prompts": (int,), "layers_per_shard": (int,)}
SPEC_KEYS = ("name", "models", "tasks", "task_options", "scan", "load")
MODEL_KEYS = ("path", "series", "name", "step")


def gascan_version() -> str:
    """The installed gascan version (part of every shard key: a new version rescans)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gascan")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class Checkpoint:
    """One model to scan: a unique output ``name``, the model ``spec`` (a path, ``tiny:ARCH``, or a packaged or
    bundled name, as gascan scan takes them: :func:`local_path` finds its files), its step."""

    name: str
    spec: str
    step: int | None = None



@dataclass
class BatchSpec:
    """Checkpoints, the scan options (the same :class:`ScanOptions` as ``gascan scan``'s) and how to shard."""

    checkpoints: list[Checkpoint]
    scan: ScanOptions = field(default_factory=ScanOptions)
    layers_per_shard: int | None = None
    load: LoadOptions = field(default_factory=LoadOptions)
    name: str = "batch"
    source: str | None = None
    base_dir: str = "."

    def __post_init__(self) -> None:
        if not self.checkpoints:
            raise GascanError("the batch names no checkpoints", "list model directories under `models` in the spec")
        if not self.scan.tasks:
            raise GascanError("the batch names no tasks", "set tasks = [\"mc\"] (or more) in the spec")
        if self.layers_per_shard is not None and self.layers_per_shard < 1:
            raise GascanError(f"layers_per_shard = {self.layers_per_shard} is not positive",
                              "use 1 or more, or leave it out for one shard per checkpoint and task")
        if self.layers_per_shard is not None and self.scan.ablation == "screened":
            raise GascanError("ablation = screened with layers_per_shard: each layer-range shard would send its own "
                              "top heads to the exact sweep, not the model's top heads as gascan scan does",
                              "leave out layers_per_shard (one shard per checkpoint and task) or use ablation = exact")

    @property
    def tasks(self) -> list[str]:
        return self.scan.tasks

    def task_options(self, task: str, defaults: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """One task's options for one checkpoint: its training defaults, then the spec's."""
        name = task.split(":", 1)[0]
        opts = dict(defaults.get(name, {}))
        opts.update(self.scan.task_options.get(name, {}))
        if task != name:
            opts.update(self.scan.task_options.get(task, {}))
        return opts


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


def local_path(spec: str) -> Path:
    """Where a checkpoint spec's files are: a path as given, a packaged (``smollm2``) or bundled
    (``bundled:NAME``) name where gascan scan finds it (a one-line error when its package is missing)."""
    return (spec_path(spec) or Path(spec)) if is_named(spec) else Path(spec)


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
                          'use path = "DIR, GLOB, tiny:ARCH, bundled:NAME or smollm2" or series = "DIR" (a training run)')
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
    if is_named(text):  # named as gascan scan names them (its files must exist)
        return [(text, local_path(text), step)], [entry.get("name") or _safe_name(text.replace(":", "-"))]
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
    settings = {k: v for k, v in scan.items() if k != "layers_per_shard"}
    options = ScanOptions(tasks=tasks, task_options={k: dict(v) for k, v in task_options.items()}, **settings)
    return BatchSpec(checkpoints=_named(entries, names), scan=options, layers_per_shard=scan.get("layers_per_shard"),
                     load=LoadOptions(**load), name=str(data.get("name") or (Path(source).stem if source else "batch")),
                     source=source, base_dir=str(base_path))


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


def override(spec: BatchSpec, **changes: Any) -> BatchSpec:
    """A copy of ``spec`` with the given (non-None) settings replaced and revalidated: any
    :class:`ScanOptions` field, ``layers_per_shard``, or any :class:`LoadOptions` field."""
    changes = {k: v for k, v in changes.items() if v is not None}
    scan_fields = {f.name for f in fields(ScanOptions)}
    load_fields = set(LoadOptions.names())
    unknown = set(changes) - scan_fields - load_fields - {"layers_per_shard"}
    if unknown:
        raise GascanError(f"cannot override {', '.join(sorted(unknown))}", "override scan or load options only")
    scan = replace(spec.scan, **{k: v for k, v in changes.items() if k in scan_fields})
    load = replace(spec.load, **{k: v for k, v in changes.items() if k in load_fields})
    return replace(spec, scan=scan, load=load, layers_per_shard=changes.get("layers_per_shard", spec.layers_per_shard))
