"""The toy models bundled inside the package (``bundled:NAME`` model specs): where they live and their names.

Trained by :mod:`discovery.toy`, which re-exports these; they live here because the model loader resolves
``bundled:NAME`` and the model stage must not import the toy stage.
"""
from __future__ import annotations

from pathlib import Path

from discovery.errors import ModelLoadError

BUNDLED_ROOT = Path(__file__).resolve().parent.parent / "data" / "toy"
DEFAULT_BUNDLED = "mc-transformer"
BUNDLED_NAMES: tuple[str, ...] = ("mc-transformer", "mc-mamba2", "mc-mamba2-k2", "mc-hybrid", "mc-mamba1",
                                  "mc1-transformer", "mc3-transformer")


def bundled_model_path(name: str = DEFAULT_BUNDLED) -> Path:
    """Directory of a bundled toy model (a Hugging Face checkpoint); default: the `mc` transformer.

    ``"mc-mamba2"`` is a pure Mamba-2 toy with an SSM aggregate head (labels before the options);
    ``"mc-mamba2-k2"``, the same recipe with width-2 convolutions, has an SSM gather head and query
    heads that read the gold option one step late (``agg_after``).
    ``"mc-mamba1"``, the same recipe as a Mamba-1 (``MambaForCausalLM``), has a known channel-level answer
    (``truth_channels.json``) for the channel refinement.
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
