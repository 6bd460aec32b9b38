"""Markdown and self-contained HTML from the first screen and the appendix sections.

HTML: every string is passed through :func:`esc` (``html.escape``); figures are embedded as ``data:``
URIs under a Content-Security-Policy that allows nothing else; the first screen (verdict, effect map,
ranked heads) fits 1280×800 and every appendix section is a closed ``<details>``.

Markdown: no raw HTML and no HTML entities; text is backslash-escaped (:func:`md_esc`) and the prompt's
tokens sit in a fenced code block.
"""
from __future__ import annotations

import base64
from collections.abc import Sequence

from discovery.report.common import Figure, Section, Table, cell, esc, md_cell, md_esc, md_fence
from discovery.report.first_screen import FirstScreen

FOOTER = "Written by gascan from the scan's tables; rebuild with gascan report DIR."


def _md_table(table: Table) -> list[str]:
    lines = ["| " + " | ".join(md_cell(c) for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(md_cell(cell(v)) for v in row) + " |" for row in table.rows]
    return lines + [""]


def _md_figure(fig: Figure) -> list[str]:
    lines = [f"![{md_cell(fig.title)}](figures/{fig.name}.png)", ""]
    return lines + ([f"*{md_esc(fig.caption)}*", ""] if fig.caption else [])


def render_markdown(first: FirstScreen, sections: Sequence[Section]) -> str:
    lines = [f"**{md_esc(first.incomplete)}**", ""] if first.incomplete else []
    lines += [f"# {md_esc(first.title)}", "", md_esc(first.facts), ""]
    for v in first.verdicts:
        lines += [(f"**Verdict ({md_esc(v.task)}): {md_esc(v.words)}, confidence {md_esc(v.confidence)}.** "
                   f"{md_esc(v.sentence)}"), ""]
    if not first.verdicts:
        lines += [f"**Verdict.** {md_esc(first.note or 'no verdict')}", ""]
    if first.figure is not None:
        lines += _md_figure(first.figure)
    elif first.figure_note:
        lines += [md_esc(first.figure_note), ""]
    if first.table is not None:
        lines += _md_table(first.table)
    if first.table_note:
        lines += [md_esc(first.table_note), ""]
    lines += ["---", "", "Appendix: the evidence behind the verdict, section by section.", ""]
    for sec in sections:
        lines += [f"## {md_esc(sec.title)}", ""]
        for p in sec.paragraphs:
            lines += [md_esc(p), ""]
        for text in sec.preformatted:
            lines += [md_fence(text), ""]
        for table in sec.tables:
            lines += _md_table(table)
        for fig in sec.figures:
            lines += _md_figure(fig)
    lines += [md_esc(FOOTER), ""]
    return "\n".join(lines)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1248px;margin:0 auto;padding:6px 16px;
color:#222;line-height:1.35}
h1{font-size:1.35em;margin:4px 0 2px} .facts{color:#555;font-size:0.85em;margin:0 0 8px}
table{border-collapse:collapse;margin:0.4em 0;font-size:0.82em}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f2f2f2} td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
img{max-width:100%;border:1px solid #eee}
figure{margin:0} figcaption{font-size:0.78em;color:#555;max-width:560px}
pre{white-space:pre-wrap;background:#f7f7f7;padding:0.6em;font-size:0.8em}
.incomplete{background:#fff3cd;border-left:4px solid #b26b00;padding:6px 10px;margin:4px 0;font-weight:600}
.verdict{background:#eef6ff;border-left:4px solid #3a7bd5;padding:6px 10px;margin:0 0 10px;font-size:0.98em}
.verdict p{margin:2px 0} .conf{color:#555;font-size:0.88em;white-space:nowrap}
.badge{display:inline-block;border-radius:3px;padding:0 6px;margin-right:4px;font-weight:600;color:#fff;
background:#777} .b-verified{background:#1b7f3b} .b-ga_like{background:#b26b00} .b-none{background:#555}
.first{display:flex;gap:18px;align-items:flex-start}
#effect-map{flex:0 0 auto} #effect-map img{max-height:500px;max-width:560px;width:auto}
#ranked td{white-space:nowrap;padding:3px 5px} #ranked th{padding:3px 5px}
#ranked td.wrap{white-space:normal;min-width:5em} #effect-map figcaption{max-width:460px}
.ranked{flex:1;min-width:0;overflow-x:auto} .note{font-size:0.78em;color:#555;margin:2px 0}
details{border-top:1px solid #ddd;padding:4px 0} summary{cursor:pointer;font-weight:600;font-size:1.02em}
h2{font-size:1.1em;margin:18px 0 4px}
"""


def _is_num(text: str) -> bool:
    return bool(text) and (text[0].isdigit() or text[0] in "+-–")


def _td(text: str, wrap: bool) -> str:
    """One cell: numbers right-aligned on one line; text on one line unless its column may wrap."""
    css = "num" if _is_num(text) else "wrap" if wrap else ""
    return f'<td class="{css}">{esc(text)}</td>' if css else f"<td>{esc(text)}</td>"


def _html_table(table: Table) -> list[str]:
    ident = f' id="{esc(table.element_id)}"' if table.element_id else ""
    out = [f"<table{ident}><tr>" + "".join(f"<th>{esc(c)}</th>" for c in table.columns) + "</tr>"]
    wraps = [c in table.wrap for c in table.columns]
    for row in table.rows:
        out.append("<tr>" + "".join(_td(cell(v), w) for v, w in zip(row, wraps)) + "</tr>")
    return out + ["</table>"]


def _html_figure(fig: Figure) -> str:
    data = base64.b64encode(fig.png).decode("ascii")
    ident = f' id="{esc(fig.element_id)}"' if fig.element_id else ""
    return (f'<figure{ident}><img alt="{esc(fig.title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{esc(fig.caption or fig.title)}</figcaption></figure>")


def render_html(first: FirstScreen, sections: Sequence[Section]) -> str:
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           ('<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
            'style-src \'unsafe-inline\'">'),
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{esc(first.title)}</title>", f"<style>{_CSS}</style></head><body>",
           *([f'<p id="incomplete" class="incomplete">{esc(first.incomplete)}</p>'] if first.incomplete else []),
           f"<header><h1>{esc(first.title)}</h1><p class=\"facts\">{esc(first.facts)}</p></header>",
           '<section id="verdict" class="verdict">']
    for v in first.verdicts:
        out.append(f'<p><span class="badge b-{esc(v.outcome)}">{esc(v.words)}</span> <b>{esc(v.task)}:</b> '
                   f'{esc(v.sentence)} <span class="conf">confidence: {esc(v.confidence)}</span></p>')
    if not first.verdicts:
        out.append(f"<p><b>Verdict.</b> {esc(first.note or 'no verdict')}</p>")
    out += ["</section>", '<div class="first">']
    if first.figure is not None:
        out.append(_html_figure(first.figure))
    elif first.figure_note:
        out.append(f'<p class="note">{esc(first.figure_note)}</p>')
    out.append('<div class="ranked">')
    if first.table is not None:
        out += _html_table(first.table)
    if first.table_note:
        out.append(f'<p class="note">{esc(first.table_note)}</p>')
    out += ["</div></div>", "<h2>Appendix</h2>"]
    for sec in sections:
        out.append(f"<details><summary>{esc(sec.title)}</summary>")
        out += [f"<p>{esc(p)}</p>" for p in sec.paragraphs]
        out += [f"<pre>{esc(t)}</pre>" for t in sec.preformatted]
        for table in sec.tables:
            out += _html_table(table)
        out += [_html_figure(fig) for fig in sec.figures]
        out.append("</details>")
    out.append(f"<p><small>{esc(FOOTER)}</small></p></body></html>")
    return "\n".join(out)
