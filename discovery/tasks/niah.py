"""``niah``: a passkey needle at a chosen depth in a haystack of filler text.

::

    There is a pass key hidden in the text below. Find it and remember it.
    The grass is green. The sky is blue. ... The pass key is 71432. Remember it. 71432 is the pass
    key. ... The river flows to the sea.
    What is the pass key? The pass key is          -> " 71432"

The single segment is the needle sentence; ``meta["answer_spans"]`` holds the character spans of
the passkey inside the needle (the tokens a retrieval head copies). Candidates are the true
passkey and ``distractors`` other passkeys of the same length. ``length`` is the haystack's
approximate length in tokens, estimated at 4 characters per token (check a model's real count
with ``gascan tasks show niah --model M``; ``annotate(max_length=...)`` rejects overlong prompts).
"""
from __future__ import annotations

import random
from typing import ClassVar

from discovery.tasks.base import Prompt, TextBuilder
from discovery.tasks.definition import Option, Task
from discovery.tasks.words import FILLER_SENTENCES

CHARS_PER_TOKEN = 4


def render_niah(passkey: str, others: list[str], gold: int, length: int, depth: float,
                rng: random.Random) -> Prompt:
    """Haystack of about ``length`` tokens with the needle after ``depth`` of its sentences."""
    sentences: list[str] = []
    order = list(FILLER_SENTENCES)
    while sum(len(s) + 1 for s in sentences) < length * CHARS_PER_TOKEN:
        if not sentences or len(sentences) % len(order) == 0:
            rng.shuffle(order)
        sentences.append(order[len(sentences) % len(order)])
    cut = round(depth * len(sentences))
    b = TextBuilder()
    b.add("There is a pass key hidden in the text below. Find it and remember it.\n")
    if sentences[:cut]:
        b.add(" ".join(sentences[:cut]) + " ")
    start = len(b)
    b.add("The pass key is ")
    first = b.add(passkey)
    b.add(". Remember it. ")
    second = b.add(passkey)
    needle = (start, b.add(" is the pass key.")[1])
    if sentences[cut:]:
        b.add(" " + " ".join(sentences[cut:]))
    b.add("\nWhat is the pass key? The pass key is")
    candidates = list(others)
    candidates.insert(gold, passkey)
    return Prompt(b.text, [needle], None, gold, [f" {c}" for c in candidates], 0,
                  {"passkey": passkey, "depth": depth, "answer_spans": [first, second]})


class NIAHTask(Task):
    name = "niah"
    description = "needle in a haystack: a passkey at a chosen depth in filler text"
    default_scoring = "continuation"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "length": Option(500, "approximate haystack length in tokens (4 characters per token)", int,
                         low=0, high=1_000_000),
        "depth": Option(0.5, "where the needle sits, as a fraction of the haystack (0 = start, 1 = end)",
                        float, low=0.0, high=1.0),
        "distractors": Option(3, "wrong passkeys among the candidates", int, low=1, high=20),
        "digits": Option(5, "digits of a passkey", int, low=1, high=12),
    }

    def prompts(self) -> list[Prompt]:
        o = self.options
        rng = random.Random(o["seed"])
        lo, hi = 10 ** (o["digits"] - 1), 10 ** o["digits"] - 1
        if hi - lo + 1 < o["distractors"] + 1:
            lo = 0
        prompts = []
        for _ in range(o["n"]):
            keys = [str(k).zfill(o["digits"]) for k in rng.sample(range(lo, hi + 1), o["distractors"] + 1)]
            gold = rng.randrange(len(keys))
            prompts.append(render_niah(keys[0], keys[1:], gold, o["length"], o["depth"], rng))
        return self._finish(prompts)
