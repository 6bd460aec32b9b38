"""``mc``: multiple choice in MMLU format, generated (category questions) or read from a file.

Default rendering, exactly MMLU's (4 choices)::

    Question: {question}
    A. {c0}
    B. {c1}
    C. {c2}
    D. {c3}
    Answer:                       -> gold continuation " B"

Segments are the option lines *including* their trailing newline (so each summary token is that
"\\n"); labels are the option letters. The built-in generator asks "Which of these is a fruit?"
with one word of that category and distractors from other categories, from DISJOINT train/test
word lists (``split``); ``option_words`` > 1 turns options into short phrases ("the old apple") so
the option's content must be gathered into its summary token. Files: MMLU's CSV layout
(``question,A,B,C,D,answer``, header optional, answer a letter), or JSONL / parquet rows
``{question, choices, answer}`` (answer a 0-based index or a letter). ``chat_template=true`` is
applied at annotate time, with the tokenizer's own template (the answer then starts the
assistant turn, so candidates lose their leading space).
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from discovery.errors import TaskError
from discovery.tasks.base import Prompt, TextBuilder
from discovery.tasks.definition import Option, Task
from discovery.tasks.words import ADJECTIVES, CATEGORIES, DETERMINERS, category_words

LABEL_SETS: dict[str, list[str]] = {
    "upper": list("ABCDEFGHIJ"),
    "lower": list("abcdefghij"),
    "digits": [str(i) for i in range(1, 11)],
}
LABEL_ALIASES = {"ABCD": "upper", "abcd": "lower", "1234": "digits"}
DEFAULT_TEMPLATE = "Question: {question}\n{options}Answer:"
DEFAULT_OPTION_TEMPLATE = "{label}. {choice}\n"
MAX_CHOICES = 10


def resolve_labels(spec: str) -> list[str]:
    """``upper``/``ABCD``, ``lower``/``abcd``, ``digits``/``1234`` or an explicit ``X,Y,Z`` list."""
    key = LABEL_ALIASES.get(spec, spec)
    if key in LABEL_SETS:
        return LABEL_SETS[key]
    labels = [s.strip() for s in spec.split(",")]
    return labels


def _check_labels(spec: str) -> str | None:
    labels = resolve_labels(spec)
    if spec not in LABEL_ALIASES and spec not in LABEL_SETS and "," not in spec:
        return "use upper (ABCD), lower (abcd), digits (1234) or a comma-separated list like X,Y,Z"
    if any(not lab for lab in labels) or len(set(labels)) != len(labels):
        return "labels must be non-empty and distinct"
    return None


def _check_template(t: str) -> str | None:
    if t.count("{question}") != 1 or t.count("{options}") != 1:
        return "the template needs {question} and {options}, once each (in either order)"
    return None


def _check_option_template(t: str) -> str | None:
    if t.count("{label}") != 1 or t.count("{choice}") != 1:
        return "the option template needs {label} and {choice}, once each"
    return None


@dataclass
class MCItem:
    """One question before rendering."""

    question: str
    choices: list[str]
    answer: int
    row: int | None = None
    subject: str | None = None


def render_mc(
    item: MCItem,
    labels: list[str],
    *,
    template: str = DEFAULT_TEMPLATE,
    option_template: str = DEFAULT_OPTION_TEMPLATE,
    shots: list[MCItem] = (),  # type: ignore[assignment]
    header: str = "",
) -> Prompt:
    """Render an item (after ``shots`` solved examples) and annotate its option lines and labels."""
    if len(item.choices) > len(labels):
        raise TaskError(f"{len(item.choices)} choices but only {len(labels)} labels",
                        "use more labels (--task-option labels=upper allows 10)")
    b = TextBuilder()
    if header:
        b.add(header.replace("{subject}", (item.subject or "").replace("_", " ")))
    for shot in shots:
        _render_block(b, shot, labels, template, option_template)
        b.add(f" {labels[shot.answer]}\n\n")
    segments, label_spans = _render_block(b, item, labels, template, option_template)
    meta: dict[str, Any] = {"question": item.question, "choices": list(item.choices)}
    if item.row is not None:
        meta["row"] = item.row
    if item.subject:
        meta["subject"] = item.subject
    return Prompt(
        text=b.text,
        segments=segments,
        labels=label_spans,
        gold=item.answer,
        candidates=[f" {lab}" for lab in labels[: len(item.choices)]],
        gold_segment=item.answer,
        meta=meta,
    )


def _render_block(
    b: TextBuilder, item: MCItem, labels: list[str], template: str, option_template: str
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    segments, label_spans = [], []
    parts = re.split(r"(\{label\}|\{choice\})", option_template)
    for piece in re.split(r"(\{question\}|\{options\})", template):
        if piece == "{question}":
            b.add(item.question)
        elif piece == "{options}":
            for k, choice in enumerate(item.choices):
                start = len(b)
                for part in parts:
                    if part == "{label}":
                        label_spans.append(b.add(labels[k]))
                    elif part == "{choice}":
                        b.add(choice)
                    elif part:
                        b.add(part)
                segments.append((start, len(b)))
        elif piece:
            b.add(piece)
    return segments, label_spans


def make_option(word: str, n_words: int, rng: random.Random) -> str:
    """A single word, or a phrase of ``n_words`` words ending in it ("the old apple")."""
    if n_words <= 1:
        return word
    adjectives = rng.sample(ADJECTIVES, n_words - 2)
    return " ".join([rng.choice(DETERMINERS), *adjectives, word])


def generate_items(n: int, n_choices: int, split: str, option_words: int, rng: random.Random,
                   question: str = "category", question_form: str = "sentence") -> list[MCItem]:
    """Generated questions; ``question="category"``: one word of the asked category, distractors each from
    another category (needs word knowledge); ``"lookup"``: "Which option mentions W?", the gold option
    is the one whose phrase contains W (pure in-context retrieval: solvable for unseen words).
    ``question_form="keyword"`` makes the question text just the category name ("fruit") or W."""
    keyword = question_form == "keyword"
    words = category_words(split)
    names = sorted(words)
    items = []
    if question == "lookup":
        pool = sorted({w for c in names for w in words[c]})
        for _ in range(n):
            chosen = rng.sample(pool, n_choices)
            answer = rng.randrange(n_choices)
            choices = [make_option(w, option_words, rng) for w in chosen]
            text = chosen[answer] if keyword else f"Which option mentions {chosen[answer]}?"
            items.append(MCItem(text, choices, answer, subject="lookup"))
        return items
    for _ in range(n):
        cats = rng.sample(names, n_choices)  # cats[0] is asked for; the others give distractors
        answer = rng.randrange(n_choices)
        picks = [rng.choice(words[c]) for c in cats]
        chosen = picks[1:]
        chosen.insert(answer, picks[0])
        choices = [make_option(w, option_words, rng) for w in chosen]
        question = cats[0] if keyword else f"Which of these is {CATEGORIES[cats[0]][0]}?"
        items.append(MCItem(question, choices, answer, subject=cats[0]))
    return items


class MCTask(Task):
    name = "mc"
    description = "multiple choice in MMLU format (category questions, or mc:FILE with MMLU CSV / JSONL / parquet)"
    accepts_file = True
    default_scoring = "next_token"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "n_choices": Option(4, "options per generated question", int, low=2, high=MAX_CHOICES),
        "question": Option("category", "generated questions: category ('Which of these is a fruit?', needs word "
                           "knowledge) or lookup ('Which option mentions apple?', in-context retrieval)", str,
                           choices=("category", "lookup")),
        "question_form": Option("sentence", "generated question text: sentence ('Which of these is a fruit?') or "
                                "keyword ('fruit'; with lookup, the word itself)", str, choices=("sentence", "keyword")),
        "labels": Option("upper", "option labels: upper (A B C D), lower (a b c d), digits (1 2 3 4) "
                         "or a list X,Y,Z", str, check=_check_labels),
        "label_order": Option("fixed", "fixed (each prompt uses the first n_choices labels in order), "
                              "shuffled (each prompt draws its n_choices labels from the label set in a random "
                              "order, so the answer letter says nothing about the answer's position) or mixed "
                              "(each prompt shuffled with probability 1/2)", str,
                              choices=("fixed", "shuffled", "mixed")),
        "split": Option("all", "generator words: train and test are DISJOINT word lists", str,
                        choices=("train", "test", "all")),
        "option_words": Option(1, "words per generated option (1 = a word; more = a phrase "
                               "such as 'the old apple')", int, low=1, high=6),
        "shots": Option(0, "solved examples before the question (from the generator, or other "
                        "rows of the file)", int, low=0, high=25),
        "chat_template": Option(False, "wrap each prompt in the tokenizer's chat template "
                                "(applied at annotate time)", bool),
        "template": Option(DEFAULT_TEMPLATE, "prompt template with {question} and {options}", str,
                           check=_check_template),
        "option_template": Option(DEFAULT_OPTION_TEMPLATE, "one option line with {label} and "
                                  "{choice}; the whole line is the segment", str,
                                  check=_check_option_template),
        "header": Option("", "text before the prompt ({subject} is replaced by the row's subject)", str),
        "on_bad_row": Option("error", "malformed file rows: error (default) or skip them (counted "
                             "and reported)", str, choices=("error", "skip")),
    }

    def prompts(self) -> list[Prompt]:
        o = self.options
        labels = resolve_labels(o["labels"])
        if self.path is None:
            if o["n_choices"] > len(labels):
                raise TaskError(
                    f"n_choices={o['n_choices']} but labels={o['labels']!r} gives only {len(labels)} labels",
                    "use fewer choices or more labels",
                )
            rng = random.Random(o["seed"])
            items = generate_items(o["n"], o["n_choices"], o["split"], o["option_words"], rng, o["question"],
                                   o["question_form"])
            shot_rng = random.Random(o["seed"] + 7919)
            pool = (generate_items(max(o["shots"] * 4, 1), o["n_choices"], o["split"], o["option_words"],
                                   shot_rng, o["question"], o["question_form"]) if o["shots"] else [])
            shots_for = [shot_rng.sample(pool, o["shots"]) if o["shots"] else [] for _ in items]
        else:
            all_items = read_mc_file(self.path, labels, o["on_bad_row"], self.skipped)
            items = all_items if o["n"] == 0 else all_items[: o["n"]]
            shot_rng = random.Random(o["seed"])
            shots_for = []
            for item in items:
                others = [x for x in all_items if x is not item]
                if o["shots"] > len(others):
                    raise TaskError(f"shots={o['shots']} but {self.path} has only {len(others)} other rows",
                                    "use fewer shots")
                shots_for.append(shot_rng.sample(others, o["shots"]) if o["shots"] else [])
        label_rng = random.Random(o["seed"] + 104729)  # its own stream: fixed-order prompts stay as they were
        prompts = []
        for item, shots in zip(items, shots_for):
            shuffle = o["label_order"] == "shuffled" or (o["label_order"] == "mixed" and label_rng.random() < 0.5)
            if shuffle:
                n_labels = max(len(x.choices) for x in [item, *shots])
                item_labels = label_rng.sample(labels, n_labels)
            else:
                item_labels = labels
            p = render_mc(item, item_labels, template=o["template"], option_template=o["option_template"],
                          shots=shots, header=o["header"])
            if self.path is not None:
                p.meta["source"] = self.path
            if o["chat_template"]:
                p.meta["chat_template"] = True
            prompts.append(p)
        return self._finish(prompts)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def read_mc_file(path: str, labels: list[str], on_bad_row: str, skipped: list[tuple[int, str]]) -> list[MCItem]:
    """Read MMLU CSV, JSONL or parquet rows; malformed rows are an error (or skipped and counted)."""
    p = Path(path)
    if not p.is_file():
        raise TaskError(f"mc file {path!r} does not exist", "give the path of a .csv, .jsonl or .parquet file")
    suffix = p.suffix.lower()
    if suffix == ".csv":
        raw = _read_csv(p)
    elif suffix in (".jsonl", ".json"):
        raw = _read_jsonl(p)
    elif suffix == ".parquet":
        raw = _read_parquet(p)
    else:
        raise TaskError(f"mc file {path!r} has an unknown format {suffix!r}",
                        "use MMLU's .csv layout, .jsonl or .parquet rows {question, choices, answer}")
    if not raw:
        raise TaskError(f"mc file {path!r} is empty (no rows)", "give a file with at least one question")
    items: list[MCItem] = []
    bad: list[tuple[int, str]] = []
    for row, rec in raw:
        if isinstance(rec, str):  # a row that could not even be parsed
            bad.append((row, rec))
            continue
        problem = _validate(rec, labels)
        if problem:
            bad.append((row, problem))
            continue
        items.append(MCItem(rec["question"], rec["choices"], rec["answer"], row=row, subject=rec.get("subject")))
    if bad and on_bad_row == "error":
        shown = "; ".join(f"row {r}: {why}" for r, why in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise TaskError(
            f"mc file {path!r} has {len(bad)} malformed row(s) of {len(raw)} ({shown})",
            "fix those rows, or pass --task-option on_bad_row=skip to skip them (they are counted)",
        )
    skipped.extend(bad)
    if not items:
        raise TaskError(f"mc file {path!r} has no usable rows ({len(bad)} malformed)", "fix the file")
    return items


def _validate(rec: dict, labels: list[str]) -> str | None:
    """Normalise ``rec`` in place (answer to an index); return the problem or None."""
    for key in ("question", "choices", "answer"):
        if key not in rec or rec[key] is None or rec[key] == "":
            return f"missing {key!r}"
    if not isinstance(rec["question"], str):
        return "question is not text"
    choices = rec["choices"]
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        return "choices is not a list of strings"
    choices = [c.strip() for c in choices]
    if any(not c for c in choices):
        return "an empty choice"
    if len(choices) < 2:
        return f"fewer than two choices ({len(choices)})"
    if len(choices) > len(labels):
        return f"{len(choices)} choices but only {len(labels)} labels"
    if len(set(choices)) != len(choices):
        dup = sorted({c for c in choices if choices.count(c) > 1})
        return f"duplicate choices {dup}"
    ans = rec["answer"]
    if isinstance(ans, bool):
        return f"answer {ans!r} is not a letter or index"
    if isinstance(ans, str):
        a = ans.strip()
        letters = "ABCDEFGHIJ"
        if len(a) == 1 and a.upper() in letters:
            idx = letters.index(a.upper())
        elif a.isdigit():
            idx = int(a)
        else:
            return f"answer {ans!r} is not a letter or index"
    elif isinstance(ans, (int, float)) and float(ans).is_integer():
        idx = int(ans)
    else:
        return f"answer {ans!r} is not a letter or index"
    if not 0 <= idx < len(choices):
        return f"answer {ans!r} out of range for {len(choices)} choices"
    rec["choices"], rec["answer"] = choices, idx
    return None


def _read_csv(p: Path) -> list[tuple[int, dict | str]]:
    import csv

    with p.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    out: list[tuple[int, dict | str]] = []
    for line, row in enumerate(rows, start=1):
        if not row or all(not c.strip() for c in row):
            continue
        if line == 1 and [c.strip().lower() for c in row[:1] + row[-1:]] == ["question", "answer"]:
            continue  # optional header row
        if len(row) < 3:
            out.append((line, f"{len(row)} columns; expected question, choices..., answer"))
            continue
        out.append((line, {"question": row[0], "choices": row[1:-1], "answer": row[-1]}))
    return out


def _read_jsonl(p: Path) -> list[tuple[int, dict | str]]:
    out: list[tuple[int, dict | str]] = []
    for line, text in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as err:
            out.append((line, f"not valid JSON ({err.msg})"))
            continue
        out.append((line, rec if isinstance(rec, dict) else "not a JSON object"))
    return out


def _read_parquet(p: Path) -> list[tuple[int, dict | str]]:
    import polars as pl

    try:
        df = pl.read_parquet(p)
    except Exception as err:  # noqa: BLE001 -- polars raises many error types for unreadable files
        raise TaskError(f"cannot read parquet file {str(p)!r}: {err}".splitlines()[0]) from None
    return [(i, rec) for i, rec in enumerate(df.to_dicts(), start=1)]
