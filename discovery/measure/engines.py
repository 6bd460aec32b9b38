"""The engines one process has built, by task, so a scan's stages share one clean pass.

A scan's sweep, evidence and pair stages measure the same batch of prompts; each building its own
:class:`~discovery.measure.ablation.AblationEngine` paid a clean forward over every prompt again (1
forward-equivalent a stage: on Gemma3-270M, 2 of the 91 fe its evidence and pairs spent). The caller owns the
cache (no module state) and passes it down; an engine is reused only for the same model object, the same
head inventory and an identical batch, and starts each stage as a fresh one would
(:meth:`~discovery.measure.ablation.AblationEngine.fresh_stage`): a stage run in another process (``gascan
report --rerun``, a batch worker) plans the same tests and gets the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch


def _same_batch(a: AnnotatedBatch, b: AnnotatedBatch) -> bool:
    """Identical prompts as tokens, padding, positions, candidates and gold answers (every tensor field, what
    the engine's passes and scores read), and the same scoring."""
    if (a.scoring, a.padding_side, a.cand_tokens) != (b.scoring, b.padding_side, b.cand_tokens):
        return False
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        tensors = isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)
        if tensors and (x is None or y is None or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu())):
            return False
    return True


@dataclass
class _Entry:
    engine: AblationEngine
    lm: LoadedModel
    batch: AnnotatedBatch
    heads: tuple[HeadId, ...]
    max_memory_mb: float | None


@dataclass
class EngineCache:
    """Untruncated engines by task; :meth:`engine` returns the cached one when it fits, else builds one."""

    _entries: dict[str, _Entry] = field(default_factory=dict)
    built: int = 0  # engines (clean passes) this cache built
    reused: int = 0  # times a stage got a cached engine instead

    def engine(self, task: str, lm: LoadedModel, batch: AnnotatedBatch, *,
               max_memory_mb: float | None = None) -> AblationEngine:
        """The engine for ``task`` on ``batch``: cached when model, inventory, batch and memory bound match."""
        heads = tuple(lm.inventory.heads())
        entry = self._entries.get(task)
        if (entry is not None and entry.lm is lm and entry.heads == heads and entry.max_memory_mb == max_memory_mb
                and _same_batch(entry.batch, batch)):
            self.reused += 1
            entry.engine.fresh_stage()
            return entry.engine
        engine = AblationEngine(lm, batch, max_memory_mb=max_memory_mb)
        self._entries[task] = _Entry(engine, lm, batch, heads, max_memory_mb)
        self.built += 1
        return engine
