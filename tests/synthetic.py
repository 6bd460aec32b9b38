"""Synthetic head tables with the scan's schema, for testing pure logic (report, classifier, placement).

The values mimic a scan of a model with one planted gather head and one aggregate head: the gather head
has a high ``gather_score`` and an all-position effect but no query-position effect; the aggregate head
has a high ``agg_select`` and a large query-position effect; a decoy head has an aggregate-like pattern
and no effect; the rest are noise.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import polars as pl

METRICS = ("gather_score", "gather_entropy", "agg_focus", "agg_focus_segment", "agg_select", "agg_margin",
           "selectivity", "dla")


def synthetic_heads(model: str = "synthetic", *, n_layers: int = 6, n_heads: int = 4, kind: str = "attn",
                    gather: tuple[int, int] | None = (2, 1), aggregate: tuple[int, int] | None = (3, 2),
                    decoy: tuple[int, int] | None = (1, 3), clean_ld: float = 4.0, task: str = "mc",
                    seed: int = 0, checkpoint: str | None = None, ssm_layers: tuple[int, ...] = ()) -> pl.DataFrame:
    """A head table (one task) of a model with the given planted roles; ``ssm_layers`` makes a hybrid."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for layer in range(n_layers):
        layer_kind = "ssm" if layer in ssm_layers else kind
        for head in range(n_heads):
            noise = lambda s=0.05: rng.gauss(0.0, s)
            row = {
                "model": model, "checkpoint": checkpoint or f"ck-{model}", "task": task, "layer": layer,
                "head": head, "kind": layer_kind, "depth": layer / (n_layers - 1),
                "gather_score": abs(noise(0.1)), "gather_entropy": 0.5 + noise(0.1),
                "agg_focus": 0.25 + noise(), "agg_focus_segment": 0.3 + noise(), "agg_select": 0.25 + noise(0.1),
                "agg_margin": noise(), "selectivity": 0.25 + noise(0.1), "dla": noise(0.1),
                "d_ld_all": noise(0.05 * clean_ld), "d_acc_all": noise(0.01), "d_lp_all": noise(0.05),
                "d_ld_query": noise(0.03 * clean_ld), "d_acc_query": noise(0.01), "d_lp_query": noise(0.03),
                "atp_ld": noise(0.05 * clean_ld),
            }
            if (layer, head) == gather:
                row.update(gather_score=0.85, gather_entropy=0.8, d_ld_all=-0.7 * clean_ld, d_acc_all=-0.6,
                           d_lp_all=-1.2, atp_ld=-0.6 * clean_ld, d_ld_query=noise(0.02))
            if (layer, head) == aggregate:
                row.update(agg_focus=0.8, agg_focus_segment=0.9, agg_select=0.97, agg_margin=0.7, selectivity=0.9,
                           dla=0.6 * clean_ld, d_ld_all=-0.8 * clean_ld, d_ld_query=-0.75 * clean_ld,
                           d_acc_all=-0.7, d_acc_query=-0.65, d_lp_all=-1.5, d_lp_query=-1.4,
                           atp_ld=-0.7 * clean_ld)
            if (layer, head) == decoy:
                row.update(agg_focus=0.82, agg_select=0.9, selectivity=0.85, agg_margin=0.6)
            for name in ("d_ld_all", "d_acc_all", "d_lp_all", "d_ld_query", "d_acc_query", "d_lp_query"):
                width = 0.05 * abs(row[name]) + 0.02
                row[f"{name}_lo"] = row[name] - width
                row[f"{name}_hi"] = row[name] + width
            rows.append(row)
    return pl.DataFrame(rows)


def synthetic_summary(model: str = "synthetic", *, n_layers: int = 6, n_heads: int = 4, clean_ld: float = 4.0,
                      task: str = "mc", spec: str | None = None, architecture: str = "llama",
                      ssm_heads: int = 0) -> dict[str, Any]:
    """A summary.json matching :func:`synthetic_heads`."""
    return {
        "model": model, "spec": spec or f"/nonexistent/{model}", "checkpoint": f"ck-{model}",
        "architecture": architecture, "n_layers": n_layers,
        "n_heads": {"attn": n_layers * n_heads - ssm_heads, "ssm": ssm_heads},
        "options": {"tasks": [task], "prompts": 16, "ablation": "exact", "seed": 0},
        "tasks": {task: {"clean": {"acc": 0.97, "logit_diff": clean_ld, "gold_logprob": -0.1},
                         "n_prompts": 16, "seconds": 1.0, "options": {"n": 16, "seed": 0}}},
        "top_effects": [], "table_version": 1,
    }


def write_synthetic_scan(out: Path, model: str = "synthetic", **kwargs: Any) -> Path:
    """Write heads.parquet and summary.json of a synthetic scan into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    heads = synthetic_heads(model, **kwargs)
    summary_keys = {k: kwargs[k] for k in ("n_layers", "n_heads", "clean_ld", "task") if k in kwargs}
    summary = synthetic_summary(model, **summary_keys)
    heads.write_parquet(out / "heads.parquet")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return out


def finite(x: float | None) -> bool:
    return x is not None and not math.isnan(x)
