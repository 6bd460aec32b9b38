"""Several scans side by side: where G&A sits relative to depth, how much it matters, clean scores; and,
for a checkpoint series, the same against training step (when G&A emerges).

One row per scan × task (:func:`compare_scans`). The gather/aggregate heads of a scan are its top
ranked pair for that task when pair ranking ran, else its most probable heads. Effects are relative to
the scan's clean logit difference (floored like the classifier's features), so models of different
sizes and scores compare. A checkpoint's training step comes from its directory name (``step-000600``,
``step_600``) — the scan directory's or the scanned checkpoint's — or from ``training.json`` beside
the checkpoint (``step`` or ``steps``).
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from discovery.errors import GascanError

STEP_RE = re.compile(r"(?:^|[^a-z])step[-_]?(\d+)", re.IGNORECASE)


def training_step(scan_dir: Path, summary: dict[str, Any]) -> int | None:
    """The training step of the scanned checkpoint, when it can be told (see module docstring)."""
    spec = str(summary.get("spec") or "")
    for text in (Path(spec).name if spec else "", scan_dir.name, spec):
        m = STEP_RE.search(text)
        if m:
            return int(m.group(1))
    if spec and Path(spec).is_dir():
        meta = Path(spec) / "training.json"
        if meta.is_file():
            try:
                info = json.loads(meta.read_text())
            except json.JSONDecodeError:
                return None
            for key in ("step", "steps", "global_step"):
                if isinstance(info.get(key), int):
                    return int(info[key])
    return None


def _pick(frame: pl.DataFrame, head: dict[str, Any]) -> pl.DataFrame:
    return frame.filter((pl.col("layer") == head["layer"]) & (pl.col("head") == head["head"])
                        & (pl.col("kind") == head["kind"]))


def _best(frame: pl.DataFrame, column: str) -> dict[str, Any] | None:
    if column not in frame.columns or frame[column].drop_nulls().len() == 0:
        return None
    return frame.sort(column, descending=True, nulls_last=True).row(0, named=True)


def compare_scans(dirs: Sequence[str | Path]) -> pl.DataFrame:
    """One row per scan directory × task (see module docstring)."""
    from discovery.artifacts import read_scan
    from discovery.rank.classifier import CLEAN_FLOOR, attach_clean, head_features
    from discovery.report import scored_heads

    if not dirs:
        raise GascanError("no scan directories given", "pass two or more --out directories of `gascan scan`")
    rows = []
    for d in dirs:
        scan = read_scan(d)
        s = scan.summary
        heads = scored_heads(scan)
        n_layers = int(s.get("n_layers") or int(heads["layer"].max()) + 1)
        step = training_step(scan.dir, s)
        for task in scan.tasks:
            frame = heads.filter(pl.col("task") == task)
            clean = scan.clean(task)
            scale = max(abs(clean.get("logit_diff") or 0.0), CLEAN_FLOOR)
            feats = head_features(attach_clean(frame, s))
            frame = pl.concat([frame, feats.select("gather_x_effect", "agg_x_effect", "drop_all", "drop_query")],
                              how="horizontal")
            row: dict[str, Any] = {"dir": str(scan.dir), "model": str(s.get("model")), "checkpoint": s.get("checkpoint"),
                                   "step": step, "n_layers": n_layers, "task": task, "clean_acc": clean.get("acc"),
                                   "clean_logit_diff": clean.get("logit_diff")}
            pairs = [p for p in (s.get("top_pairs") or []) if p.get("task", task) == task]
            g = a = None
            if pairs:
                top = pairs[0]
                gs, as_ = _pick(frame, top["gather"]), _pick(frame, top["aggregate"])
                g = gs.row(0, named=True) if gs.height else None
                a = as_.row(0, named=True) if as_.height else None
                row.update(pair_score=top.get("score"), pair_verified=top.get("verified"),
                           joint_effect_rel=(top["joint_effect"] / scale if top.get("joint_effect") is not None else None),
                           control_effect_rel=(top["control_effect"] / scale if top.get("control_effect") is not None
                                               else None))
            g = g or _best(frame, "p_gather") or _best(frame, "gather_x_effect")
            a = a or _best(frame, "p_aggregate") or _best(frame, "agg_x_effect")
            for role, h in (("gather", g), ("aggregate", a)):
                if h is None:
                    continue
                row[f"{role}_head"] = f"L{h['layer']}{'H' if h['kind'] == 'attn' else 'S'}{h['head']}"
                row[f"{role}_depth"] = h["layer"] / (n_layers - 1) if n_layers > 1 else 0.0
                row[f"p_{role}"] = h.get(f"p_{role}")
            if g is not None:
                row["gather_drop"] = g.get("drop_all")
            if a is not None:
                row["aggregate_drop"] = a.get("drop_query")
            drops = frame["drop_all"].drop_nulls()
            row["max_drop"] = float(drops.max()) if drops.len() else None
            row["max_gather_evidence"] = frame["gather_x_effect"].max()
            row["max_aggregate_evidence"] = frame["agg_x_effect"].max()
            rows.append(row)
    table = pl.DataFrame(rows, infer_schema_length=None)
    if "step" in table.columns and table["step"].drop_nulls().len():
        table = table.sort(["model", "task", "step"], nulls_last=True) if table["step"].null_count() else \
            table.sort(["task", "step"])
    return table


SERIES_METRICS = (("clean_acc", "clean accuracy"), ("max_aggregate_evidence", "max aggregate evidence"),
                  ("max_gather_evidence", "max gather evidence"), ("p_aggregate", "P(aggregate) of top head"),
                  ("p_gather", "P(gather) of top head"), ("max_drop", "largest single-head drop (× clean)"))


def series_figure(table: pl.DataFrame) -> bytes | None:
    """Metrics against training step, one line per task (when at least two scans have a step)."""
    from discovery.report import _plt, _png

    part = table.filter(pl.col("step").is_not_null()) if "step" in table.columns else table.clear()
    if part.select("step").n_unique() < 2:
        return None
    plt = _plt()
    metrics = [(c, label) for c, label in SERIES_METRICS if c in part.columns and part[c].drop_nulls().len()]
    cols = min(3, len(metrics))
    rows = int(np.ceil(len(metrics) / cols))
    with plt.rc_context({"text.parse_math": False}):
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
        for ax in axes.flat[len(metrics):]:
            ax.axis("off")
        for ax, (column, label) in zip(axes.flat, metrics):
            for (task,), g in part.sort("step").partition_by(["task"], as_dict=True, maintain_order=True).items():
                ax.plot(g["step"].to_numpy(), g[column].fill_null(np.nan).to_numpy(), "o-", label=str(task))
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("training step", fontsize=8)
            ax.tick_params(labelsize=7)
        axes.flat[0].legend(fontsize=7)
        fig.tight_layout()
        return _png(fig)


def depth_figure(table: pl.DataFrame) -> bytes | None:
    """Gather and aggregate depth (fraction of the model's layers) per scan × task."""
    from discovery.report import _plt, _png

    if table.height == 0 or ("gather_depth" not in table.columns and "aggregate_depth" not in table.columns):
        return None
    plt = _plt()
    labels = [f"{m} [{t}]" + (f" step {s}" if s is not None else "") for m, t, s in
              zip(table["model"], table["task"], table["step"] if "step" in table.columns else [None] * table.height)]
    y = np.arange(table.height)
    with plt.rc_context({"text.parse_math": False}):
        fig, ax = plt.subplots(figsize=(7, 0.8 + 0.35 * table.height))
        for role, marker in (("gather", "o"), ("aggregate", "s")):
            col = f"{role}_depth"
            if col in table.columns:
                ax.scatter(table[col].fill_null(np.nan).to_numpy(), y, marker=marker, label=role, s=40)
        ax.set_yticks(y, labels, fontsize=7)
        ax.set_xlim(-0.05, 1.05)
        ax.set_xlabel("depth (layer / (layers − 1))")
        ax.axvspan(0.4, 0.65, color="0.9", zorder=0, label="paper's G&A band")
        ax.legend(fontsize=7)
        fig.tight_layout()
        return _png(fig)


COLUMNS = ("model", "step", "task", "clean_acc", "clean_logit_diff", "gather_head", "gather_depth", "p_gather",
           "gather_drop", "aggregate_head", "aggregate_depth", "p_aggregate", "aggregate_drop", "pair_verified",
           "joint_effect_rel", "control_effect_rel", "max_drop")


def write_comparison(table: pl.DataFrame, out: str | Path) -> Path:
    """compare.parquet, compare.md, a self-contained compare.html and figures/*.png in ``out``."""
    import base64

    from discovery.io import write_bytes, write_parquet, write_text
    from discovery.report import esc, fmt, md_cell

    out = Path(out)
    write_parquet(out / "compare.parquet", table)
    cols = [c for c in COLUMNS if c in table.columns]
    figures = [(name, title, png) for name, title, png in
               (("depth", "Where G&A sits", depth_figure(table)), ("series", "Against training step",
                                                                    series_figure(table))) if png]
    for name, _, png in figures:
        write_bytes(out / "figures" / f"compare_{name}.png", png)
    md = ["# gascan comparison", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(md_cell(fmt(r[c]) if not isinstance(r[c], str) else r[c]) for c in cols) + " |"
           for r in table.iter_rows(named=True)]
    md += [""] + [f"![{title}](figures/compare_{name}.png)" for name, title, _ in figures]
    write_text(out / "compare.md", "\n".join(md) + "\n")
    html = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>gascan comparison</title>",
            ("<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:.85em}"
             "td,th{border:1px solid #ccc;padding:3px 6px}img{max-width:100%}</style></head><body>"),
            "<h1>gascan comparison</h1><table><tr>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>"]
    html += ["<tr>" + "".join(f"<td>{esc(r[c] if isinstance(r[c], str) else fmt(r[c]))}</td>" for c in cols) + "</tr>"
             for r in table.iter_rows(named=True)]
    html.append("</table>")
    for _, title, png in figures:
        html.append(f"<h2>{esc(title)}</h2><img alt='{esc(title)}' src='data:image/png;base64,"
                    f"{base64.b64encode(png).decode('ascii')}'>")
    html.append("</body></html>")
    return write_text(out / "compare.html", "\n".join(html))
