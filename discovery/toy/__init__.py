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
]


def __getattr__(name: str) -> Any:  # lazy: the trainer imports torch
    if name in ("train", "evaluate", "TrainResult"):
        from discovery.toy import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
