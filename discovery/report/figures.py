"""The report's figures (matplotlib, Agg, PNG bytes): the first screen's effect map, and the appendix's
metric heatmaps, G&A depth profile, minimal-model curve and example attention patterns.

Effects are drawn as drops in logit difference (clean − ablated, positive = the head helps, red).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from discovery.artifacts import Scan
from discovery.report.common import _plt, _png, show_token

MAX_PATTERN_KEYS = 160  # longer example prompts show their last keys only

# (column, label, colour scale): "seq" 0..1, "div" symmetric around 0, "prob" 0..1. The raw d_ld_* and
# atp_ld deltas (ablated − clean) are negated into drops before drawing (see _as_drops).
HEATMAP_METRICS: tuple[tuple[str, str, str], ...] = (
    ("gather_score", "gather score", "seq"),
    ("agg_focus", "aggregate focus", "seq"),
    ("agg_select", "aggregate select", "seq"),
    ("selectivity", "selectivity", "seq"),
    ("dla", "direct logit attribution", "div"),
    ("drop_all", "drop in logit diff (all positions)", "div"),
    ("drop_query", "drop in logit diff (query only)", "div"),
    ("drop_atp", "AtP estimate of the drop", "div"),
    ("p_gather", "P(gather)", "prob"),
    ("p_aggregate", "P(aggregate)", "prob"),
)
_DROPS = {"d_ld_all": "drop_all", "d_ld_query": "drop_query", "atp_ld": "drop_atp"}


def _as_drops(frame: pl.DataFrame) -> pl.DataFrame:
    """The frame plus ``drop_*`` columns: the raw deltas with the sign flipped (positive = the head helps)."""
    return frame.with_columns([(-pl.col(raw).cast(pl.Float64)).alias(new) for raw, new in _DROPS.items()
                               if raw in frame.columns])


def _group_heads(frame: pl.DataFrame) -> pl.DataFrame:
    """The rows of group heads: refined Mamba-1 channel heads (``channel_start`` set) left out."""
    return frame.filter(pl.col("channel_start").is_null()) if "channel_start" in frame.columns else frame


def _matrix(frame: pl.DataFrame, column: str, n_layers: int, n_heads: int | None = None) -> np.ndarray:
    """``[layer, head]`` values of one column (NaN where absent)."""
    if n_heads is None:
        n_heads = int(frame["head"].max()) + 1 if frame.height else 1
    out = np.full((n_layers, n_heads), np.nan)
    if column not in frame.columns:
        return out
    for layer, head, value in frame.select("layer", "head", column).iter_rows():
        if value is not None and 0 <= layer < n_layers and 0 <= head < n_heads:
            out[layer, head] = float(value)
    return out


def _mark(ax, marks: Sequence[tuple[int, int, str]], fontsize: int = 8) -> None:
    from matplotlib import patheffects

    for layer, head, text in marks:
        ax.text(head, layer, text, ha="center", va="center", color="black", fontsize=fontsize, fontweight="bold",
                path_effects=[patheffects.withStroke(linewidth=2, foreground="white")])


def effect_map_figure(frame: pl.DataFrame, n_layers: int, tasks: Sequence[str],
                      marks: Mapping[str, Sequence[tuple[int, int, str, str]]]) -> bytes | None:
    """The first screen's figure: per task (rows) and head kind (columns), a layer × head map of the drop in
    logit difference when the head is ablated at all positions (query-only where the scan has no
    all-position sweep); ``marks[task]`` = (layer, head, kind, "G"/"A")."""
    frame = _group_heads(_as_drops(frame))  # refined channel heads are marked on their group's cell instead
    column = next((c for c in ("drop_all", "drop_query") if c in frame.columns and frame[c].drop_nulls().len()),
                  None)
    if column is None or frame.height == 0:
        return None
    kinds = [k for k in ("attn", "ssm") if frame.filter(pl.col("kind") == k).height]
    tasks = [t for t in tasks if frame.filter(pl.col("task") == t).height] or list(tasks)[:1]
    v = float(np.nanmax(np.abs(frame[column].drop_nulls().to_numpy()))) or 1.0
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    widths = [max(2.6, min(3.6, 0.8 + 0.3 * (int(frame.filter(pl.col("kind") == k)["head"].max()) + 1)))
              for k in kinds]
    height = max(2.6, min(4.6, 0.6 + 0.15 * n_layers)) if len(tasks) == 1 else max(1.4, min(2.6, 0.5 + 0.1 * n_layers))
    with plt.rc_context({"text.parse_math": False}):
        fig, axes = plt.subplots(len(tasks), len(kinds), figsize=(sum(widths) + 0.9, height * len(tasks) + 0.3),
                                 squeeze=False, gridspec_kw={"width_ratios": widths})
        im = None
        for i, task in enumerate(tasks):
            for j, kind in enumerate(kinds):
                ax = axes[i, j]
                part = frame.filter((pl.col("task") == task) & (pl.col("kind") == kind))
                n_heads = int(part["head"].max()) + 1 if part.height else 1
                m = _matrix(part, column, n_layers, n_heads)
                im = ax.imshow(np.ma.masked_invalid(m), cmap="RdBu_r", vmin=-v, vmax=v, aspect="auto",
                               interpolation="nearest")
                ax.set_facecolor("0.85")
                what = "attention heads" if kind == "attn" else "SSM heads"
                ax.set_title(f"{task}: {what}" if len(tasks) > 1 or len(kinds) > 1 else what, fontsize=8)
                ax.set_xlabel("head", fontsize=7)
                ax.set_ylabel("layer", fontsize=7)
                ax.tick_params(labelsize=6)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
                _mark(ax, [(layer, head, text) for layer, head, k, text in marks.get(task, ()) if k == kind], 7)
        if im is not None:
            bar = fig.colorbar(im, ax=axes.ravel().tolist(), fraction=0.05, pad=0.03)
            bar.ax.tick_params(labelsize=6)
            bar.set_label("drop in logit diff (+ = head helps)", fontsize=7)
        return _png(fig, dpi=100)


def heatmap_figure(frame: pl.DataFrame, n_layers: int, title: str,
                   marks: Sequence[tuple[int, int, str]] = ()) -> bytes | None:
    """One panel per metric of :data:`HEATMAP_METRICS` present in ``frame`` (one task, one head kind; refined
    channel heads are left out: they overlap their groups)."""
    frame = _group_heads(_as_drops(frame))
    metrics = [(c, label, scale) for c, label, scale in HEATMAP_METRICS
               if c in frame.columns and frame[c].drop_nulls().len() > 0]
    if not metrics or frame.height == 0:
        return None
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    n_heads = int(frame["head"].max()) + 1
    cols = min(4, len(metrics))
    rows = math.ceil(len(metrics) / cols)
    width = min(4.2, 1.2 + 0.25 * n_heads)
    height = min(4.5, 1.0 + 0.22 * n_layers)
    with plt.rc_context({"text.parse_math": False}):
        fig, axes = plt.subplots(rows, cols, figsize=(cols * width, rows * height), squeeze=False)
        for ax in axes.flat[len(metrics):]:
            ax.axis("off")
        for ax, (column, label, scale) in zip(axes.flat, metrics):
            m = _matrix(frame, column, n_layers)
            if scale == "div":
                v = float(np.nanmax(np.abs(m))) if np.isfinite(m).any() else 1.0
                v = v or 1.0
                im = ax.imshow(np.ma.masked_invalid(m), cmap="RdBu_r", vmin=-v, vmax=v, aspect="auto",
                               interpolation="nearest")
            else:
                cmap = "viridis" if scale == "seq" else "magma"
                lo = min(0.0, float(np.nanmin(m))) if np.isfinite(m).any() else 0.0
                im = ax.imshow(np.ma.masked_invalid(m), cmap=cmap, vmin=lo, vmax=1.0, aspect="auto",
                               interpolation="nearest")
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("head", fontsize=8)
            ax.set_ylabel("layer", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            _mark(ax, marks)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=7)
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
        return _png(fig)


def depth_profile_figure(frame: pl.DataFrame, n_layers: int, title: str) -> bytes | None:
    """Per layer: the strongest gather and aggregate evidence (probabilities, and pattern × effect)."""
    from discovery.rank.classifier import head_features

    if frame.height == 0:
        return None
    feats = head_features(frame).select("gather_x_effect", "agg_x_effect")
    f = pl.concat([frame.select("layer"), feats], how="horizontal")
    cols = [c for c in ("p_gather", "p_aggregate") if c in frame.columns]
    if cols:
        f = pl.concat([f, frame.select(cols)], how="horizontal")
    per_layer = f.group_by("layer").agg(pl.all().max()).sort("layer")
    layers = per_layer["layer"].to_numpy()
    plt = _plt()
    panels = 2 if cols else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.2), squeeze=False)
    ax = axes[0, 0]
    ax.plot(layers, per_layer["gather_x_effect"].fill_null(np.nan).to_numpy(), "o-", label="gather: score × drop")
    ax.plot(layers, per_layer["agg_x_effect"].fill_null(np.nan).to_numpy(), "s-",
            label="aggregate: select × query drop")
    ax.set_xlabel("layer")
    ax.set_ylabel("max over heads")
    ax.set_title("pattern × drop in logit diff (relative to clean)", fontsize=9)
    ax.set_xlim(-0.5, n_layers - 0.5)
    ax.legend(fontsize=7)
    if cols:
        ax = axes[0, 1]
        if "p_gather" in cols:
            ax.plot(layers, per_layer["p_gather"].fill_null(np.nan).to_numpy(), "o-", label="max P(gather)")
        if "p_aggregate" in cols:
            ax.plot(layers, per_layer["p_aggregate"].fill_null(np.nan).to_numpy(), "s-", label="max P(aggregate)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("layer")
        ax.set_title("classifier", fontsize=9)
        ax.set_xlim(-0.5, n_layers - 0.5)
        ax.legend(fontsize=7)
    with plt.rc_context({"text.parse_math": False}):
        fig.suptitle(title, fontsize=10)
        fig.tight_layout()
    return _png(fig)


def minimal_depth_figure(scan: Scan) -> bytes | None:
    """Task score of the model truncated after each layer (the evidence stage's depth profile)."""
    depth = scan.evidence_depth
    if depth is None or depth.height == 0:
        return None
    plt = _plt()
    with plt.rc_context({"text.parse_math": False}):
        fig, ax = plt.subplots(figsize=(5.5, 3.2))
        groups = depth.partition_by("task", as_dict=True, maintain_order=True) if "task" in depth.columns \
            else {("",): depth}
        for (task,), part in groups.items():
            part = part.sort("depth")
            ax.plot(part["depth"].to_numpy(), part["acc"].to_numpy(), "o-", label=f"{task} accuracy")
            mm = (((scan.summary.get("evidence") or {}).get(task) or {}).get("minimal_model") or {}).get("depth")
            if mm is not None:
                ax.axvline(mm, color="0.5", linestyle="--", linewidth=1)
        if "chance" in depth.columns:
            ax.axhline(float(depth["chance"][0]), color="0.7", linewidth=1, label="chance")
        ax.set_xlabel("layers kept (read out through the final norm)")
        ax.set_ylabel("accuracy")
        ax.set_title("minimal model: score of the truncated model (dashed: minimal depth)", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return _png(fig)


def pattern_figure(example: Mapping[str, Any]) -> bytes | None:
    """Rows: every summary token and the query; columns: the prompt's keys, labelled with their tokens."""
    tokens = [str(t) for t in example["tokens"]]
    patterns = np.asarray(example["patterns"])  # [shown head, q, k]
    if patterns.size == 0 or not tokens:
        return None
    summary_pos = [int(p) for p in example["summary_pos"]]
    query = int(example["query_pos"])
    gold = int(example["gold_segment"]) if int(example["gold_segment"]) >= 0 else None
    rows = summary_pos + [query]
    row_labels = [f"{show_token(tokens[p])} @{p} (seg {i}{' gold' if i == gold else ''})"
                  for i, p in enumerate(summary_pos)] + [f"{show_token(tokens[query])} @{query} (query)"]
    start = max(0, len(tokens) - MAX_PATTERN_KEYS)
    keys = list(range(start, len(tokens)))
    plt = _plt()
    n = patterns.shape[0]
    width = min(22.0, 2.5 + 0.13 * len(keys))
    with plt.rc_context({"text.parse_math": False}):
        fig, axes = plt.subplots(n, 1, figsize=(width, n * (1.2 + 0.28 * len(rows))), squeeze=False)
        for i in range(n):
            ax = axes[i, 0]
            m = patterns[i][np.ix_(rows, keys)]
            im = ax.imshow(m, cmap="viridis", aspect="auto", interpolation="nearest",
                           vmin=0.0, vmax=max(1e-9, float(np.abs(m).max())))
            ax.set_yticks(range(len(rows)), row_labels, fontsize=7)
            ax.set_xticks(range(len(keys)), [show_token(tokens[k]) for k in keys], rotation=90, fontsize=6)
            role, name = str(example["roles"][i]), str(example["names"][i])
            ax.set_title(f"{role} head {name}: attention from summary tokens and the query", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.02, pad=0.01).ax.tick_params(labelsize=6)
        fig.tight_layout()
        return _png(fig)
