"""What every part of the report shares: escaping, number formats, the sign convention, the content types.

Escaping: :func:`esc` for HTML (``html.escape`` of anything a model, tokenizer, dataset or user supplied);
:func:`md_esc` / :func:`md_cell` for Markdown, which backslash-escape Markdown's punctuation instead of
writing HTML entities, so ``report.md`` has neither raw HTML nor ``&gt;``-style entities.

Signs: every effect the report prints is a **drop in logit difference** (clean − ablated, positive = the
head helps), converted from the head table's raw ``d_ld_*`` deltas with :func:`discovery.rank.verdict.drop`;
a percentage of the clean logit difference carries the sign of its number (:func:`drop_pct`).
"""
from __future__ import annotations

import html
import io
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl

from discovery.artifacts import Scan, with_evidence
from discovery.errors import GascanError
from discovery.heads import channel_label
from discovery.rank.verdict import drop

# ---------------------------------------------------------------------------------------------
# escaping
# ---------------------------------------------------------------------------------------------


def esc(value: Any) -> str:
    """HTML-escape anything that may have come from a model, tokenizer, dataset or user."""
    return html.escape(str(value), quote=True)


_MD_SPECIAL = re.compile(r"[\\`*_<>|~]|\](?=[(\[:])|&(?=#?\w+;)")


def md_esc(value: Any) -> str:
    """Escape for Markdown text without HTML entities: Markdown's active punctuation (``\\ ` * _ < > | ~``,
    a ``]`` that could close a link or a link definition, an ``&`` that could start an entity) gets a
    backslash, so a model's ``<script>`` shows as text; a leading ``#``, ``-``, ``+``, ``=`` or ``1.``
    cannot start a heading or a list."""
    text = _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), str(value))
    text = re.sub(r"^(\d+)([.)])(?=\s|$)", r"\1\\\2", text)
    return re.sub(r"^([#+=-])(?=\s|$)", r"\\\1", text)


def md_cell(value: Any) -> str:
    """Escape for a Markdown table cell: as :func:`md_esc`, and line breaks become spaces."""
    return md_esc(str(value).replace("\r", " ").replace("\n", " "))


def md_fence(text: str) -> str:
    """A fenced code block holding ``text`` verbatim (the fence is longer than any backtick run in it)."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


# ---------------------------------------------------------------------------------------------
# names and numbers
# ---------------------------------------------------------------------------------------------


def head_name(layer: int, head: int, kind: str) -> str:
    return f"L{layer}{'H' if kind == 'attn' else 'S'}{head}"


def head_label(row: Mapping[str, Any]) -> str:
    """A head table row's name, with its channels when it is a refined Mamba-1 channel head:
    ``L1S32 (ch 42)``, ``L1S33 (ch 48-55)``."""
    return channel_label(head_name(row["layer"], row["head"], row["kind"]), row.get("channel_start"),
                         row.get("channel_end"))


_HEAD_NAME = re.compile(r"^L(\d+)([HS])(\d+)$")


def parse_head(name: str) -> tuple[int, int, str] | None:
    """``"L3H1"`` -> (3, 1, "attn"), ``"L2S6"`` -> (2, 6, "ssm"); None for anything else."""
    m = _HEAD_NAME.match(str(name))
    return (int(m.group(1)), int(m.group(3)), "attn" if m.group(2) == "H" else "ssm") if m else None


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(v):
        return "–"
    return f"{v:.{digits}f}"


def _finite(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def signed(value: Any, digits: int = 3) -> str:
    """A number with its sign always shown (``+0.120``, ``-0.050``); "–" when missing."""
    v = _finite(value)
    return "–" if v is None else f"{v:+.{digits}f}"


def drop_ci(row: Mapping[str, Any], column: str, digits: int = 3) -> str:
    """The drop in logit difference (clean − ablated) of a raw ``d_ld_*``-style column with its 95% interval:
    ``+0.110 [+0.010, +0.200]`` (the interval's ends swap under the sign change)."""
    v = _finite(row.get(column))
    if v is None:
        return "–"
    lo, hi = _finite(row.get(f"{column}_hi")), _finite(row.get(f"{column}_lo"))
    text = signed(drop(v), digits)
    if lo is not None and hi is not None:
        text += f" [{signed(drop(lo), digits)}, {signed(drop(hi), digits)}]"
    return text


def ci_only(row: Mapping[str, Any], column: str, digits: int = 3) -> str:
    """Only the 95% interval of :func:`drop_ci`: ``[+0.010, +0.200]``."""
    lo, hi = _finite(row.get(f"{column}_hi")), _finite(row.get(f"{column}_lo"))
    return "–" if lo is None or hi is None else f"[{signed(drop(lo), digits)}, {signed(drop(hi), digits)}]"


def drop_pct(delta: Any, clean: Any, digits: int = 3) -> str:
    """A drop with its share of the clean logit difference, both with the same sign:
    ``+0.110 (+34% of clean)``."""
    v = _finite(delta)
    if v is None:
        return "–"
    d = drop(v)
    c = _finite(clean)
    if c is None or abs(c) < 1e-12:
        return signed(d, digits)
    share = 100.0 * d / abs(c)
    pct = f"{share:+.0f}"
    if pct in ("+0", "-0"):
        pct = "0"
    return f"{signed(d, digits)} ({pct}% of clean)"


def show_token(tok: str) -> str:
    """A token as a label: newlines and tabs visible, a leading space as '·'."""
    shown = tok.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    if shown.startswith(" "):
        shown = "·" + shown[1:]
    return shown or "∅"


# ---------------------------------------------------------------------------------------------
# content types
# ---------------------------------------------------------------------------------------------


@dataclass
class Figure:
    name: str  # file stem under figures/
    title: str
    png: bytes
    caption: str = ""
    element_id: str = ""  # an id for the HTML <figure> (the first screen's map is "effect-map")


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Any]]  # cells: str (escaped on output) or numbers
    element_id: str = ""
    wrap: frozenset[str] = frozenset()  # columns whose cells may wrap in HTML (the others stay on one line)


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)  # plain text, escaped on output
    tables: list[Table] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    preformatted: list[str] = field(default_factory=list)


def cell(value: Any) -> str:
    return value if isinstance(value, str) else fmt(value)


# ---------------------------------------------------------------------------------------------
# matplotlib
# ---------------------------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig, dpi: int = 90) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------
# reading a scan
# ---------------------------------------------------------------------------------------------


def scored_heads(scan: Scan) -> pl.DataFrame:
    """The head table with the evidence stage's columns and ``p_gather``/``p_aggregate`` (from the table,
    else the shipped classifier)."""
    heads = with_evidence(scan.heads, scan.evidence)
    if "p_gather" in heads.columns and "p_aggregate" in heads.columns:
        return heads
    try:
        from discovery.rank.classifier import score_heads

        return score_heads(heads, scan.summary)
    except GascanError:  # no classifier artifact in this install: report without probabilities
        return heads


def n_layers_of(scan: Scan, heads: pl.DataFrame) -> int:
    return int(scan.summary.get("n_layers") or (int(heads["layer"].max()) + 1 if heads.height else 1))
