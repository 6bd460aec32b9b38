"""``jsonl:PATH``: the user's own prompts with character-span annotations.

One JSON object per line::

    {"text": "...Answer:", "segments": [[s, e], ...], "candidates": [" A", " B"], "gold": 1,
     "gold_segment": 1, "labels": [[s, e], ...], "meta": {...}}

``segments`` and ``labels`` are ``[start, end)`` character spans into ``text``; ``gold_segment``
(default ``gold``) and ``labels`` (one per segment) are optional. The prompt text must end at the
query character: the query position is its last token. Malformed rows are an error naming their
line numbers (or, with ``on_bad_row=skip``, skipped, counted and reported).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from discovery.errors import TaskError
from discovery.tasks.base import Prompt, check_prompt
from discovery.tasks.definition import Option, Task

REQUIRED = ("text", "segments", "candidates", "gold")


class BadRow(Exception):
    """What is wrong with one row (collected, then reported with its line number)."""


def _spans(value: Any, what: str) -> list[tuple[int, int]]:
    if not isinstance(value, list) or not all(
        isinstance(s, (list, tuple)) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                             for x in s)
        for s in value
    ):
        raise BadRow(f"{what} must be a list of [start, end] integer pairs")
    return [(int(s), int(e)) for s, e in value]


def row_to_prompt(rec: dict, row: int, source: str) -> Prompt:
    """Validate one row and build its prompt; raises BadRow naming the problem."""
    missing = [k for k in REQUIRED if k not in rec or rec[k] is None]
    if missing:
        raise BadRow(f"missing {', '.join(repr(m) for m in missing)}")
    if not isinstance(rec["text"], str):
        raise BadRow("text is not a string")
    cands = rec["candidates"]
    if not isinstance(cands, list) or not all(isinstance(c, str) for c in cands):
        raise BadRow("candidates must be a list of strings")
    gold = rec["gold"]
    if not isinstance(gold, int) or isinstance(gold, bool):
        raise BadRow("gold must be an integer index into candidates")
    if not 0 <= gold < len(cands):
        raise BadRow(f"gold {gold} is out of range for {len(cands)} candidates (0–{len(cands) - 1})"
                     if cands else "candidates is empty")
    gseg = rec.get("gold_segment")
    if gseg is not None and (not isinstance(gseg, int) or isinstance(gseg, bool)):
        raise BadRow("gold_segment must be an integer index into segments")
    segments = _spans(rec["segments"], "segments")
    if not segments:
        raise BadRow("no segments")
    labels = _spans(rec["labels"], "labels") if rec.get("labels") is not None else None
    meta = dict(rec.get("meta") or {}) if isinstance(rec.get("meta"), (dict, type(None))) else {}
    meta.update(row=row, source=source)
    p = Prompt(rec["text"], segments, labels, gold, list(cands), gseg, meta)
    if gseg is None and gold >= len(segments):
        p.gold_segment = None
        raise BadRow(f"gold {gold} has no matching segment; give gold_segment")
    problem = check_prompt(p)
    if problem:
        raise BadRow(problem)
    return p


class JSONLTask(Task):
    name = "jsonl"
    description = "custom prompts from jsonl:PATH with character-span annotations (text, segments, candidates, gold)"
    accepts_file = True
    default_scoring = "next_token"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "on_bad_row": Option("error", "malformed rows: error (default) or skip them (counted and reported)",
                             str, choices=("error", "skip")),
    }

    def __init__(self, options=None, path=None) -> None:  # type: ignore[no-untyped-def]
        if path is None:
            raise TaskError("task 'jsonl' needs a file", "name it as jsonl:PATH (one JSON object per line)")
        super().__init__(options, path)

    def prompts(self) -> list[Prompt]:
        path = str(self.path)
        p = Path(path)
        if not p.is_file():
            raise TaskError(f"jsonl file {path!r} does not exist", "give the path of a .jsonl file")
        lines = [(i, t) for i, t in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1) if t.strip()]
        if not lines:
            raise TaskError(f"jsonl file {path!r} is empty (no rows)", "give a file with at least one row")
        prompts: list[Prompt] = []
        bad: list[tuple[int, str]] = []
        for row, text in lines:
            try:
                rec = json.loads(text)
                if not isinstance(rec, dict):
                    raise BadRow("not a JSON object")
                prompts.append(row_to_prompt(rec, row, path))
            except json.JSONDecodeError as err:
                bad.append((row, f"not valid JSON ({err.msg})"))
            except BadRow as err:
                bad.append((row, str(err)))
        if bad and self.options["on_bad_row"] == "error":
            shown = "; ".join(f"row {r}: {why}" for r, why in bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise TaskError(
                f"jsonl file {path!r} has {len(bad)} malformed row(s) of {len(lines)} ({shown})",
                "fix those rows, or pass --task-option on_bad_row=skip to skip them (they are counted)",
            )
        self.skipped.extend(bad)
        if not prompts:
            raise TaskError(f"jsonl file {path!r} has no usable rows ({len(bad)} malformed)", "fix the file")
        if self.options["n"]:
            prompts = prompts[: self.options["n"]]
        return self._finish(prompts)
