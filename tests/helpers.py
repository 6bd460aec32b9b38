"""Small shared builders for tests: hand-made MMLU-style prompts for tiny models."""
from __future__ import annotations

import random

from discovery.tasks.base import Prompt

WORDS = ["cat", "apple", "river", "chair", "stone", "blue sky", "old red car", "pear"]


def mc_prompts(n: int, n_choices: int = 4, seed: int = 0) -> list[Prompt]:
    """MMLU-format prompts of varying length (so left padding is exercised)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = "Question: which one?" + " really" * (i % 3) + "\n"
        segments = []
        for j in range(n_choices):
            start = len(text)
            text += f"{'ABCDEFGHIJ'[j]}. {rng.choice(WORDS)}\n"
            segments.append((start, len(text)))
        text += "Answer:"
        out.append(Prompt(text=text, segments=segments, labels=[(s, s + 1) for s, _ in segments],
                          gold=i % n_choices, candidates=[f" {'ABCDEFGHIJ'[j]}" for j in range(n_choices)]))
    return out


def verdict_differences(budgeted, unbounded) -> list[str]:
    """How a budgeted scan's verdict differs from the unbounded one's (empty: the same verdict): per task the
    outcome, the gather and aggregate heads, the best verified pair; the budget's decoys must be decoys of
    the unbounded scan too (it may test fewer heads, never call a head a decoy the full test clears)."""
    out = []
    for b, u in zip(budgeted.tasks, unbounded.tasks):
        if b.outcome != u.outcome:
            out.append(f"{b.task}: outcome {b.outcome} vs {u.outcome}")
        if set(b.gather_heads) != set(u.gather_heads) or set(b.aggregate_heads) != set(u.aggregate_heads):
            out.append(f"{b.task}: roles {b.gather_heads}/{b.aggregate_heads} vs {u.gather_heads}/{u.aggregate_heads}")
        best = [(p.gather.name, p.aggregate.name) for p in b.verified_pairs[:1]]
        other = [(p.gather.name, p.aggregate.name) for p in u.verified_pairs[:1]]
        if b.outcome == "verified" and best != other:
            out.append(f"{b.task}: best verified pair {best} vs {other}")
        if not set(b.decoys) <= set(u.decoys):
            out.append(f"{b.task}: decoys {b.decoys} not all in {u.decoys}")
    return out
