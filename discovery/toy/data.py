"""Prompts from the task generators, tokenized into fixed tensors for training and evaluation.

The trainer never writes questions itself: it asks ``discovery.tasks.build_task`` for the
``train`` and ``test`` splits (disjoint words) and only tokenizes what comes back.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from discovery.errors import GascanError, TaskError


def has_word_splits(task: str) -> bool:
    """Whether ``task`` draws train and test prompts from disjoint word lists (a ``split`` option)."""
    from discovery.tasks import get_task_class

    return "split" in get_task_class(task).all_options()


def check_task_options(task: str, options: dict[str, Any]) -> dict[str, Any]:
    """Resolve ``options`` against ``task``'s documented options (one-line error if unknown/bad)."""
    from discovery.tasks import get_task_class

    return get_task_class(task).resolve_options(options)


def task_prompts(task: str, split: str, seed: int, n: int, options: dict[str, Any]) -> list[Any]:
    """``n`` prompts of ``task``'s ``split`` from the shared task generators.

    Tasks without word splits (``kv``) get only the seed; the caller gives the test split its own.
    """
    from discovery.tasks import build_task

    spec = {**options, "seed": seed, "n": n}
    if has_word_splits(task):
        spec["split"] = split
    prompts = list(build_task(task, spec).prompts())
    if not prompts:
        raise TaskError(f"task {task!r} produced no {split} prompts with options {options}",
                        "check the --task-option values")
    return prompts


def gold_index(prompt: Any) -> int:
    """The index of the correct candidate (``gold`` may be an index or the candidate string)."""
    gold = prompt.gold
    if isinstance(gold, int):
        return gold
    try:
        return list(prompt.candidates).index(gold)
    except ValueError:
        raise TaskError(f"gold answer {gold!r} is not among the candidates {list(prompt.candidates)}",
                        "fix the task generator") from None


def corpus_texts(prompts: Sequence[Any]) -> list[str]:
    """Prompt text plus its gold answer, one document per prompt (the tokenizer's training corpus)."""
    return [p.text + p.candidates[gold_index(p)] for p in prompts]


@dataclass
class Encoded:
    """A split as tensors: right-padded ids, the answer position and the answer token ids."""

    input_ids: torch.Tensor  # [n, max_len] int64, right-padded with pad id
    lengths: torch.Tensor  # [n] int64: tokens per prompt (the answer is predicted at lengths - 1)
    candidates: torch.Tensor  # [n, n_candidates] int64: first token of each candidate
    gold: torch.Tensor  # [n] int64: index into candidates
    pad_id: int

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows ``index``, trimmed to their longest prompt: (ids, last position, candidates, gold)."""
        lengths = self.lengths[index]  # [b]
        ids = self.input_ids[index, : int(lengths.max())]  # [b, len]
        return ids, lengths - 1, self.candidates[index], self.gold[index]

    def gold_tokens(self) -> torch.Tensor:
        """[n] the token id of each prompt's correct answer."""
        return self.candidates.gather(1, self.gold[:, None])[:, 0]


def encode(prompts: Sequence[Any], tokenizer) -> Encoded:
    """Tokenize prompts (with the tokenizer's own special tokens, as any consumer would)."""
    if not prompts:
        raise GascanError("no prompts to encode", "ask the task for at least one prompt")
    n_cand = {len(p.candidates) for p in prompts}
    if len(n_cand) != 1:
        raise TaskError(f"prompts have different numbers of candidates {sorted(n_cand)}",
                        "use one task setting per run")
    rows = tokenizer([p.text for p in prompts])["input_ids"]
    first: dict[str, int] = {}
    cand_rows = []
    for p in prompts:
        row = []
        for c in p.candidates:
            if c not in first:
                first[c] = tokenizer(c, add_special_tokens=False)["input_ids"][0]
            row.append(first[c])
        cand_rows.append(row)
    max_len = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), max_len), pad, dtype=torch.long)  # [n, max_len]
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return Encoded(
        input_ids=ids,
        lengths=torch.tensor([len(r) for r in rows], dtype=torch.long),
        candidates=torch.tensor(cand_rows, dtype=torch.long),
        gold=torch.tensor([gold_index(p) for p in prompts], dtype=torch.long),
        pad_id=pad,
    )


@dataclass
class Facts:
    """Knowledge facts (" apple is fruit.") as token ids, with the positions whose next token is scored."""

    ids: list[torch.Tensor]  # per fact [len] int64
    labels: list[torch.Tensor]  # per fact [len] int64: the next token where it is a category token, else -100

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, n_rows: int, per_row: int, pad_id: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """``n_rows`` sequences of ``per_row`` random facts each: (ids [rows, len], labels [rows, len])."""
        pick = torch.randint(len(self.ids), (n_rows, per_row), generator=gen)  # [rows, per_row]
        rows = [torch.cat([self.ids[i] for i in r.tolist()]) for r in pick]
        labs = [torch.cat([self.labels[i] for i in r.tolist()]) for r in pick]
        return (pad_sequence(rows, batch_first=True, padding_value=pad_id),  # right padding
                pad_sequence(labs, batch_first=True, padding_value=-100))


def category_facts(tokenizer, options: dict[str, Any]) -> Facts:
    """One fact per training word of the ``mc`` category generator, in the question's own wording:
    " apple is fruit." with ``question_form=keyword``, " apple is a fruit." with sentences. Only the
    category's tokens are targets, so the loss is about what the word is, nothing else."""
    from discovery.tasks.words import CATEGORIES, category_words

    keyword = options.get("question_form", "sentence") == "keyword"
    ids, labels = [], []
    for name, words in sorted(category_words("train").items()):
        phrase = name if keyword else CATEGORIES[name][0]
        for word in words:
            head = tokenizer(f" {word} is", add_special_tokens=False)["input_ids"]
            tail = tokenizer(f" {phrase}", add_special_tokens=False)["input_ids"]
            row = torch.tensor(head + tail + tokenizer(".", add_special_tokens=False)["input_ids"])  # [len]
            lab = torch.full_like(row, -100)
            lab[len(head) - 1: len(head) + len(tail) - 1] = torch.tensor(tail)  # predict each category token
            ids.append(row)
            labels.append(lab)
    return Facts(ids, labels)
