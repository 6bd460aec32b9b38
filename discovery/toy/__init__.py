"""Toy models in which G&A emerges: a deterministic trainer and the models bundled with gascan.

``train(TrainConfig(...), out_dir)`` trains a transformer, Mamba-2 or hybrid on a synthetic task;
``bundled_model_path()`` is the default model that ``gascan scan`` uses offline, and
``bundled_checkpoints()`` its training checkpoint series (earliest first). Importing this package
stays cheap: the trainer (torch, transformers) loads on first use.
"""
from __future__ import annotations

from pathlib import Path
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


def __getattr__(name: str) -> Any:  # lazy: the trainer imports torch
    if name in ("train", "evaluate", "TrainResult"):
        from discovery.toy import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
