"""What an ablation run returns: per-ablation, per-prompt scores at the query (from the whole vocabulary or the
candidates' unembedding rows only) and progress callbacks (split from :mod:`discovery.measure.ablation`, which
re-exports them)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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


def readout_logits(adapter: Any, hidden: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Logits from residual states ``[row, d_model]`` through the model's final norm and unembedding (Gemma's
    final soft-capping included): ``[row, vocab]``, or ``[row, token]`` for the unembedding rows ``tokens`` only."""
    with torch.no_grad():
        x = adapter.final_norm()(hidden[:, None, :])[:, 0]  # [row, d_model]
        unembed = adapter.unembed()
        if tokens is None:
            logits = unembed(x[:, None])[:, 0]
        else:
            bias = getattr(unembed, "bias", None)
            logits = torch.nn.functional.linear(x, unembed.weight[tokens], None if bias is None else bias[tokens])
    cap = getattr(adapter.config, "final_logit_softcapping", None)
    if cap:  # Gemma 2/3 squash the final logits
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


class CandidateReadout:
    """Scores from the unembedding rows of the batch's candidate first tokens only: accuracy and logit
    difference need nothing else, and a whole-vocabulary readout costs, on Gemma3-270M (262k tokens), as much
    as 1.5 layers. ``gold_logprob`` is NaN (not scored). For tests that read only those two (random controls)."""

    def __init__(self, adapter: Any, batch: AnnotatedBatch) -> None:
        self.adapter = adapter
        self.batch = batch
        # [token] the distinct candidate tokens; [prompt, cand] each candidate's place among them
        self.tokens, self.local = torch.unique(batch.cand_first_token, return_inverse=True)

    def cand_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[ablation, prompt, cand]`` logits of the candidates from query states ``[ablation, prompt, d_model]``."""
        n, p = hidden.shape[:2]
        logits = readout_logits(self.adapter, hidden.reshape(n * p, -1), self.tokens)  # [row, token]
        return logits.gather(1, self.local.repeat(n, 1)).view(n, p, -1)

    def scores(self, hidden: torch.Tensor) -> Scores:
        """:class:`Scores` ``[ablation, prompt]`` from query states ``[ablation, prompt, d_model]``."""
        from discovery.tasks.scoring import candidate_scores

        cand = self.cand_logits(hidden)
        parts = [candidate_scores(cand[a], self.batch) for a in range(cand.shape[0])]
        return Scores(*(torch.stack([q[m].float() for q in parts]) for m in METRICS))


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
