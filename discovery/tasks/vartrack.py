"""``vartrack``: variable tracking through chains of assignments (RULER-style).

::

    Memorize the variable assignments below.
    VAR QPE = 64085
    VAR MKT = 31377
    VAR XYZ = VAR QPE
    VAR BOB = VAR MKT
    ...
    Question: Which variable holds the value 64085?
    Answer:                                   -> " XYZ"

``chains`` chains, each a value bound to one name then passed along ``hops`` further names, are
interleaved at random (order kept within each chain). Every assignment line, including its
newline, is a segment. The candidates are one name per chain (``target``: the last name of each
chain, the first, or a random one), so exactly one candidate holds the asked value; the gold
segment is the line that binds the gold name. ``meta["bound"]`` lists every name holding the
value.
"""
from __future__ import annotations

import random
import string
from typing import ClassVar

from discovery.tasks.base import Prompt, TextBuilder
from discovery.tasks.definition import Option, Task


def _names(rng: random.Random, k: int, length: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(length))
        if name not in out and name != "VAR":
            out.append(name)
    return out


def render_vartrack(chains: list[list[str]], values: list[str], order: list[int], query: int,
                    target: str, rng: random.Random) -> Prompt:
    """``order`` lists chain indices, one per assignment, in the order the lines appear."""
    b = TextBuilder()
    b.add("Memorize the variable assignments below.\n")
    segments: list[tuple[int, int]] = []
    where: dict[str, int] = {}
    progress = [0] * len(chains)
    for c in order:
        j = progress[c]
        progress[c] += 1
        rhs = values[c] if j == 0 else f"VAR {chains[c][j - 1]}"
        where[chains[c][j]] = len(segments)
        segments.append(b.add(f"VAR {chains[c][j]} = {rhs}\n"))
    b.add(f"Question: Which variable holds the value {values[query]}?\nAnswer:")
    if target == "last":
        picks = [ch[-1] for ch in chains]
    elif target == "first":
        picks = [ch[0] for ch in chains]
    else:
        picks = [rng.choice(ch) for ch in chains]
    return Prompt(b.text, segments, None, query, [f" {p}" for p in picks], where[picks[query]],
                  {"values": values, "chains": chains, "bound": list(chains[query])})


class VarTrackTask(Task):
    name = "vartrack"
    description = "variable tracking: chains 'VAR X = 12345 ... VAR Y = VAR X'; which name holds the value?"
    default_scoring = "continuation"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "chains": Option(3, "number of chains (one candidate each)", int, low=2, high=20),
        "hops": Option(2, "re-assignments per chain after the value is bound", int, low=0, high=20),
        "target": Option("last", "which name of each chain is a candidate: last, first or random", str,
                         choices=("last", "first", "random")),
        "name_length": Option(3, "letters per variable name", int, low=2, high=8),
        "digits": Option(5, "digits of a value", int, low=1, high=12),
    }

    def prompts(self) -> list[Prompt]:
        o = self.options
        rng = random.Random(o["seed"])
        lo, hi = 10 ** (o["digits"] - 1), 10 ** o["digits"] - 1
        if hi - lo + 1 < o["chains"]:
            lo = 0
        prompts = []
        for _ in range(o["n"]):
            names = _names(rng, o["chains"] * (o["hops"] + 1), o["name_length"])
            chains = [names[c * (o["hops"] + 1): (c + 1) * (o["hops"] + 1)] for c in range(o["chains"])]
            values = [str(v).zfill(o["digits"]) for v in rng.sample(range(lo, hi + 1), o["chains"])]
            order = [c for c in range(o["chains"]) for _ in range(o["hops"] + 1)]
            rng.shuffle(order)
            query = rng.randrange(o["chains"])
            prompts.append(render_vartrack(chains, values, order, query, o["target"], rng))
        return self._finish(prompts)
