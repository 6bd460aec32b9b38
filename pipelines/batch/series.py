"""A checkpoint series: key G&A metrics of every checkpoint against its training step."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from pipelines.batch.spec import Checkpoint

SERIES_METRICS = ("acc", "logit_diff", "max_agg_select", "max_gather_score", "top_d_ld_all")


def series_rows(checkpoint: Checkpoint, heads: pl.DataFrame, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Key G&A metrics of one checkpoint, per task: clean accuracy, strongest pattern scores, largest effect."""
    rows = []
    for task, info in summary["tasks"].items():
        part = heads.filter(pl.col("task") == task)
        clean = info.get("clean") or {}
        row: dict[str, Any] = {"checkpoint_name": checkpoint.name, "step": checkpoint.step, "task": task,
                               "acc": clean.get("acc"), "logit_diff": clean.get("logit_diff")}
        for column, name in (("agg_select", "max_agg_select"), ("gather_score", "max_gather_score")):
            row[name] = part[column].max() if column in part.columns and part[column].null_count() < part.height \
                else None
            row[f"{name}_head"] = _top_head(part, column, descending=True)
        if "d_ld_all" in part.columns and part["d_ld_all"].null_count() < part.height:
            best = part.filter(pl.col("d_ld_all").is_not_null()).sort(pl.col("d_ld_all").abs(), descending=True)
            row["top_d_ld_all"] = best["d_ld_all"][0]
            row["top_d_ld_all_head"] = _head_name(best.row(0, named=True))
        else:
            row["top_d_ld_all"] = None
            row["top_d_ld_all_head"] = None
        rows.append(row)
    return rows


def _head_name(row: dict[str, Any]) -> str:
    return f"L{row['layer']}{'H' if row['kind'] == 'attn' else 'S'}{row['head']}"


def _top_head(part: pl.DataFrame, column: str, descending: bool) -> str | None:
    if column not in part.columns or part[column].null_count() == part.height:
        return None
    best = part.filter(pl.col(column).is_not_null()).sort(column, descending=descending)
    return _head_name(best.row(0, named=True))


def write_series(out: Path, table: pl.DataFrame) -> dict[str, Any]:
    """``series.parquet`` and ``series.png``: key metrics against training step (checkpoint order if none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from discovery.io import atomic_write, write_parquet

    write_parquet(out / "series.parquet", table)
    names = list(dict.fromkeys(table["checkpoint_name"].to_list()))
    steps = table["step"].to_list()
    by_step = all(s is not None for s in steps)
    labels = {"acc": "clean accuracy", "logit_diff": "clean logit diff", "max_agg_select": "max agg_select",
              "max_gather_score": "max gather_score", "top_d_ld_all": "largest |Δ logit diff| (signed)"}
    metrics = [m for m in SERIES_METRICS if m in table.columns and table[m].null_count() < table.height]
    fig, axes = plt.subplots(1, max(len(metrics), 1), figsize=(3.6 * max(len(metrics), 1), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for task in dict.fromkeys(table["task"].to_list()):
            part = table.filter(pl.col("task") == task)
            xs = part["step"].to_list() if by_step else [names.index(n) for n in part["checkpoint_name"]]
            ax.plot(xs, part[metric].to_list(), marker="o", label=task)
        ax.set_title(labels[metric], fontsize=9)
        ax.set_xlabel("training step" if by_step else "checkpoint")
        if not by_step:
            ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    atomic_write(out / "series.png", lambda p: fig.savefig(p, dpi=110, format="png"))
    plt.close(fig)
    return {"table": str(out / "series.parquet"), "figure": str(out / "series.png"), "metrics": metrics,
            "x": "step" if by_step else "checkpoint"}
