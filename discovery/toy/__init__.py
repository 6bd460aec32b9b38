"""Toy models in which G&A emerges: a deterministic trainer and the models bundled with gascan.

``train(TrainConfig(...), out_dir)`` trains a transformer, Mamba-2 or hybrid on a synthetic task;
``bundled_model_path()`` is the default model that ``gascan scan`` uses offline, and
``bundled_checkpoints()`` its training checkpoint series (earliest first). Importing this package
stays cheap: the trainer (torch, transformers) loads on first use.
"""
from __future__ import annotations

from typing import Any

# where the bundled models live and how they are named: in discovery.model.bundled, because the model
# loader resolves ``bundled:NAME`` and the model stage must not import the toy stage above it
from discovery.model.bundled import (
    BUNDLED_NAMES,
    BUNDLED_ROOT,
    DEFAULT_BUNDLED,
    bundled_checkpoints,
    bundled_model_path,
)
from discovery.toy.config import ARCHES, TASKS, TrainConfig

__all__ = [
    "ARCHES",
    "BUNDLED_NAMES",
    "BUNDLED_ROOT",
    "DEFAULT_BUNDLED",
    "TASKS",
    "TrainConfig",
    "TrainResult",
    "bundled_checkpoints",
    "bundled_model_path",
    "evaluate",
    "train",
    "trained_task_options",
]


<<<<<<< HEAD
def bundled_model_path(name: str = DEFAULT_BUNDLED) -> Path:
    """Directory of a bundled toy model (a Hugging Face checkpoint); default: the `mc` transformer.

    ``"mc-mamba2"`` is a pure Mamba-2 toy with an SSM aggregate head (labels before the options);
    ``"mc-mamba2-k2"``, the same recipe with width-2 convolutions, has an SSM gather head and query
    heads that read the gold option one step late (``agg_after``).
    ``"mc-hybrid"``, that recipe as a Bamba hybrid with attention at layer 1, has an attention gather
    head feeding a redundant set of SSM aggregate heads.
    ``"mc1-transformer"`` (single-word options) and ``"mc3-transformer"`` (three-word options, the default
    until the G&A model replaced it) are negative fixtures: they solve the task without G&A.
    """
    if name not in BUNDLED_NAMES:
        raise ModelLoadError(f"no bundled toy model {name!r}", f"use one of: {', '.join(BUNDLED_NAMES)}")
    path = BUNDLED_ROOT / name
    if not (path / "config.json").exists():
        raise ModelLoadError(f"bundled toy model {name!r} is missing at {path}",
                             "reinstall gascan (the package data was not installed)")
    return path


def bundled_checkpoints(name: str = DEFAULT_BUNDLED) -> list[Path]:
    """The bundled model's training checkpoints, earliest step first (the final model excluded)."""
    root = bundled_model_path(name) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def trained_task_options(files: list[Path] | tuple[Path, ...]) -> dict[str, dict[str, Any]]:
    """The task and options a toy checkpoint was trained with (``training.json`` beside its weights),
    so that it is scanned on its own prompt format; {} for any other checkpoint."""
    import json

    for path in list(files)[:1]:
        meta = Path(path).parent / "training.json"
        if meta.is_file():
            info = json.loads(meta.read_text())
            task = info.get("task")
            opts = {k: v for k, v in (info.get("task_options") or {}).items() if k not in ("split", "n", "seed")}
            if task == "mc":  # held-out prompts over the words the model was trained on (it cannot know others)
                opts["split"] = "train"
            if task:
                return {task: opts}
    return {}


=======
>>>>>>> issue22-c
def __getattr__(name: str) -> Any:  # lazy: the trainer imports torch
    if name in ("train", "evaluate", "TrainResult"):
        from discovery.toy import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
