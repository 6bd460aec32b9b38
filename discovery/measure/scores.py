"""What an ablation run returns: per-ablation, per-prompt scores at the query, progress callbacks, and the
mediated share of an ablation's cost (split from :mod:`discovery.measure.ablation`, which re-exports them)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from discovery.tasks.base import AnnotatedBatch

METRICS = ("acc", "logit_diff", "gold_logprob")


@dataclass
class Scores:
    """Per-ablation, per-prompt scores: each tensor is ``[ablation, prompt]``."""

    acc: torch.Tensor
    logit_diff: torch.Tensor
    gold_logprob: torch.Tensor

    def __getitem__(self, metric: str) -> torch.Tensor:
        return getattr(self, metric)

    @staticmethod
    def cat(parts: Sequence[Scores], dim: int = 0) -> Scores:
        return Scores(*(torch.cat([getattr(p, m) for p in parts], dim=dim) for m in METRICS))


def query_scores(query_logits: torch.Tensor, batch: AnnotatedBatch) -> Scores:
    """Scores of ``query_logits`` ``[ablation, prompt, vocab]`` against the batch's candidates."""
    from discovery.tasks.scoring import next_token_scores

    parts = [next_token_scores(query_logits[a], batch) for a in range(query_logits.shape[0])]
    return Scores(*(torch.stack([p[m].float() for p in parts]) for m in METRICS))


Progress = Callable[[str, int, int], None]  # (stage, done, total): what a command's progress bar takes


def stage_ticker(progress: Progress | None, stage: str, total: int) -> Callable[[int], None]:
    """A callback for :meth:`AblationEngine.run` (``progress=``) that advances ``stage`` by the rows it finished."""
    done = [0]
    if progress:
        progress(stage, 0, total)

    def tick(n: int) -> None:
        done[0] += n
        if progress:
            progress(stage, done[0], total)

    return tick



def mediated_share(cost: float, held: float, min_cost: float = 0.0) -> float | None:
    """The share of an ablation's cost (``cost`` < 0, logit-difference units) that holding heads at their
    clean outputs gives back (``held``: the effect with them held): ``1 - held / cost``. None when the
    ablation costs less than ``min_cost``, where the share would be noise."""
    if not cost < -abs(min_cost):  # also None for a NaN cost
        return None
    return 1.0 - held / cost
