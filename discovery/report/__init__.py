"""The per-model report: ``report.md`` and a self-contained ``report.html`` rebuilt from a scan's tables.

``write_report(DIR)`` reads the scan directory (:func:`discovery.artifacts.read_scan`) and writes,
atomically, a report that reads in 30 seconds:

- first screen (:mod:`.first_screen`): the model in one line; the verdict
  (:class:`discovery.rank.verdict.Verdict`, from ``summary.json``'s ``verdict`` or
  :func:`discovery.rank.verdict.decide`) with its confidence; one layer × head map of the drop in logit
  difference with the verdict's gather (G) and aggregate (A) heads marked; at most ten ranked heads;
- appendix (:mod:`.appendix`, :mod:`.sections`): how the verdict was decided (tested pairs and their
  status), roles with position-resolved drops and group ablations, the largest effects, decoys, clean
  scores, depth profile and heatmaps of every metric (:mod:`.figures`), the example attention pattern
  (:mod:`.example`, ``patterns.npz``), placement advice, published heads.

One sign convention throughout: a drop in logit difference is clean − ablated (positive = the head
helps). Rendering (:mod:`.render`): HTML escapes every string with :func:`html.escape`; Markdown
backslash-escapes instead, so it holds no raw HTML and no HTML entities.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from discovery.artifacts import read_scan
from discovery.report.appendix import build_appendix
from discovery.report.common import (
    Figure,
    Section,
    Table,
    _plt,
    _png,
    drop_ci,
    drop_pct,
    esc,
    fmt,
    head_name,
    md_cell,
    md_esc,
    n_layers_of,
    scored_heads,
    signed,
)
from discovery.report.example import (
    CHEAP_MODEL_BYTES,
    compute_example,
    example_for_report,
    load_example,
    save_example,
    top_heads,
)
from discovery.report.first_screen import build_first_screen, scan_verdict
from discovery.report.render import render_html, render_markdown

__all__ = ["CHEAP_MODEL_BYTES", "Figure", "Section", "Table", "_plt", "_png", "build_report", "compute_example",
           "drop_ci", "drop_pct", "esc", "example_for_report", "fmt", "head_name", "load_example", "md_cell",
           "md_esc", "save_example", "scan_verdict", "scored_heads", "signed", "top_heads", "write_report"]


def build_report(out_dir: str | Path, lm: Any = None):
    """The scan, its first screen and its appendix sections, and every figure to write."""
    scan = read_scan(out_dir)
    heads = scored_heads(scan)
    n_layers = n_layers_of(scan, heads)
    first, verdict = build_first_screen(scan, heads, n_layers)
    sections = build_appendix(scan, heads, n_layers, verdict, first.note, lm)
    figures = ([first.figure] if first.figure else []) + [f for s in sections for f in s.figures]
    return scan, first, sections, figures


def write_report(out_dir: str | Path, lm: Any = None) -> Path:
    """Rebuild ``report.md``, ``report.html`` and ``figures/*.png`` in a scan directory; returns the HTML path."""
    from discovery.io import write_bytes, write_text

    scan, first, sections, figures = build_report(out_dir, lm)
    for fig in figures:
        write_bytes(scan.dir / "figures" / f"{fig.name}.png", fig.png)
    write_text(scan.dir / "report.md", render_markdown(first, sections))
    return write_text(scan.dir / "report.html", render_html(first, sections))
