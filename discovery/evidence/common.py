"""Small helpers the evidence modules share: numbers, head lists, chance and clean scores."""
from __future__ import annotations

import math
from typing import Any

import polars as pl
import torch

from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine
from discovery.tasks.base import AnnotatedBatch


def _heads_of(frame: pl.DataFrame) -> list[HeadId]:
    return [HeadId(int(r[0]), int(r[1]), str(r[2])) for r in frame.select("layer", "head", "kind").rows()]


def _num(value: Any) -> float | None:
    """A finite float or None (NaN, null and missing become None)."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _chance(batch: AnnotatedBatch) -> float:
    """Accuracy of a uniform guess among each prompt's candidates, averaged over prompts."""
    if batch.cand_mask is not None:
        counts = batch.cand_mask.sum(1).clamp(min=1).float()
    else:
        counts = torch.full((len(batch),), float(batch.cand_first_token.shape[1]))
    return float((1.0 / counts).mean())


def _clean(engine: AblationEngine) -> dict[str, float]:
    return {"acc": float(engine.clean.acc.mean()), "logit_diff": float(engine.clean.logit_diff.mean()),
            "gold_logprob": float(engine.clean.gold_logprob.mean()), "chance": _chance(engine.batch)}
