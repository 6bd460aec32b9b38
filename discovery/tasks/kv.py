"""``kv``: key-value retrieval, in two styles.

``style=dict`` (default, the G&A paper's synthetic task)::

    Memorize the following dictionary:
    lamp:42
    river:7
    ...

    The value of the key 'river' is        -> " 7"

N pairs with random words as keys and distinct integers 0–99 as values; each ``key:value`` line,
including its newline, is a segment; the candidates are the N values. ``style=named`` is the
shorter form small real models can do (six pairs by default, single-digit values)::

    Jack: 1, David: 2, Leo: 9, Anna: 4, Tom: 0, Emma: 3, Leo:      -> " 9"

whose segments are the ``Name: v,`` pairs (the summary token is the comma). With
``query_space=true`` the prompt ends in ``Leo: `` and the candidates are bare digits ("9"), which
suits SentencePiece tokenizers that split digits from the space. ``style=lines`` is the form that
reads most naturally to every tokenizer, BPE and SentencePiece alike: one ``Name: word`` line per
pair, with common one-token words as values, so the answer is a single ``▁word`` / ``Ġword`` token
rather than a digit after a lone space (Gemma3-270M: 0.42 on 6 pairs against 0.25 for the named
digits, chance 0.17; 0.67 on 3 pairs)::

    Jack: red
    Anna: fish
    Leo: gold
    Anna:                                                   -> " fish"

whose segments are the lines (newline included).
"""
from __future__ import annotations

import random
from typing import ClassVar

from discovery.errors import TaskError
from discovery.tasks.base import Prompt, TextBuilder
from discovery.tasks.definition import Option, Task
from discovery.tasks.words import CATEGORIES, FIRST_NAMES


def _key_words() -> list[str]:
    return sorted({w.lower() for _, (_, words) in CATEGORIES.items() for w in words})


# Common words that are one token, with their leading space, in the Llama, Gemma and GPT-2 vocabularies.
LINE_VALUES = ("red", "blue", "green", "black", "white", "pink", "brown", "gray", "gold", "purple",
               "cat", "dog", "fish", "bird", "horse", "cow", "lion", "bear", "frog", "duck")


def render_dict(keys: list[str], values: list[int], query: int) -> Prompt:
    """The dictionary form; segment k is line ``key:value\\n``."""
    b = TextBuilder()
    b.add("Memorize the following dictionary:\n")
    segments = [b.add(f"{k}:{v}\n") for k, v in zip(keys, values)]
    b.add(f"\nThe value of the key '{keys[query]}' is")
    return Prompt(b.text, segments, None, query, [f" {v}" for v in values], query,
                  {"keys": keys, "values": values})


def render_named(names: list[str], values: list[int], query: int, query_space: bool = False) -> Prompt:
    """The named form; segment k is ``Name: v,``."""
    b = TextBuilder()
    segments = []
    for name, v in zip(names, values):
        segments.append(b.add(f"{name}: {v},"))
        b.add(" ")
    b.add(f"{names[query]}:" + (" " if query_space else ""))
    prefix = "" if query_space else " "
    return Prompt(b.text, segments, None, query, [f"{prefix}{v}" for v in values], query,
                  {"keys": names, "values": values})


def render_lines(names: list[str], values: list[str], query: int) -> Prompt:
    """The lines form; segment k is line ``Name: word\\n``."""
    b = TextBuilder()
    segments = [b.add(f"{name}: {v}\n") for name, v in zip(names, values)]
    b.add(f"{names[query]}:")
    return Prompt(b.text, segments, None, query, [f" {v}" for v in values], query,
                  {"keys": names, "values": values})


class KVTask(Task):
    name = "kv"
    description = "key-value retrieval: 'Memorize the following dictionary' (dict) or 'Jack: 1, ... Leo:' (named)"
    default_scoring = "continuation"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "style": Option("dict", "dict (key:value lines, values 0-99), named (Name: digit pairs) or lines "
                        "(one 'Name: word' line per pair; natural for SentencePiece and BPE tokenizers)", str,
                        choices=("dict", "named", "lines")),
        "pairs": Option(None, "number of key-value pairs (default 8 for dict, 6 for named and lines; "
                        "named allows at most 10, lines 20)", int, low=2, high=100),
        "query_space": Option(False, "named style: end the prompt with 'Leo: ' and score bare digits", bool),
    }

    def __init__(self, options=None, path=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options, path)
        if self.options["pairs"] is None:
            self.options["pairs"] = 8 if self.options["style"] == "dict" else 6

    def prompts(self) -> list[Prompt]:
        o = self.options
        if o["style"] == "named" and o["pairs"] > 10:
            raise TaskError(f"style=named has single-digit values, so at most 10 pairs (got pairs={o['pairs']})",
                            "use --task-option pairs=10 or fewer, or style=dict")
        if o["style"] == "lines" and o["pairs"] > len(LINE_VALUES):
            raise TaskError(f"style=lines has {len(LINE_VALUES)} distinct values, so at most {len(LINE_VALUES)} "
                            f"pairs (got pairs={o['pairs']})", "use fewer pairs, or style=dict")
        rng = random.Random(o["seed"])
        pool = _key_words() if o["style"] == "dict" else list(FIRST_NAMES)
        prompts = []
        for _ in range(o["n"]):
            keys = rng.sample(pool, o["pairs"])
            if o["style"] == "lines":
                words = rng.sample(LINE_VALUES, o["pairs"])
                prompts.append(render_lines(keys, words, rng.randrange(o["pairs"])))
                continue
            values = rng.sample(range(100) if o["style"] == "dict" else range(10), o["pairs"])
            query = rng.randrange(o["pairs"])
            if o["style"] == "dict":
                prompts.append(render_dict(keys, values, query))
            else:
                prompts.append(render_named(keys, values, query, o["query_space"]))
        return self._finish(prompts)
