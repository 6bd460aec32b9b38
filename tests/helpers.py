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
