"""Labelled head tables for the classifier: planted circuits, toy models with ground truth, published heads.

- **Planted circuits** (:mod:`discovery.planted_ga`): :data:`PLANTED_VARIANTS` vary depth, width, the
  gather/aggregate layers (adjacent or not), decoys and redundant aggregate copies; each is scanned with
  gascan's own scan and labelled from its construction.
- **Toy models** (``gascan toy train``): their ``truth.json`` (written by ``gascan toy truth``) gives the
  labels. Without one, :func:`derive_truth` labels a scanned toy model from its exhaustive single-head
  ablation and patterns — see its docstring for the rule, which is a fallback, not ground truth.
- **Published heads** (``discovery/data/published_heads.json``) label any scan of those checkpoints.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from discovery.errors import GascanError

PLANTED_VARIANTS: tuple[dict[str, Any], ...] = (
    {"n_layers": 4, "n_heads": 4, "gather": (1, 2), "aggregate": (2, 1), "seed": 0},
    {"n_layers": 3, "n_heads": 4, "gather": (0, 1), "aggregate": (1, 3), "seed": 1},
    {"n_layers": 5, "n_heads": 4, "gather": (1, 0), "aggregate": (3, 2), "seed": 2},
    {"n_layers": 6, "n_heads": 2, "gather": (2, 1), "aggregate": (3, 0), "seed": 3},
    {"n_layers": 4, "n_heads": 8, "gather": (0, 4), "aggregate": (3, 5), "seed": 4},
    {"n_layers": 5, "n_heads": 4, "gather": (2, 2), "aggregate": (4, 0), "seed": 5, "decoys": False},
    {"n_layers": 6, "n_heads": 4, "gather": (3, 3), "aggregate": (4, 1), "seed": 6, "aggregate_copies": 2},
    {"n_layers": 4, "n_heads": 4, "gather": (0, 0), "aggregate": (2, 3), "seed": 7, "filler_scale": 0.03},
)

# derive_truth thresholds (fractions of the clean logit difference)
TRUTH_EFFECT = 0.3
TRUTH_QUERY_SHARE = 0.5


def build_planted_set(out_root: str | Path, *, prompts: int = 32, variants: Sequence[Mapping[str, Any]] = PLANTED_VARIANTS,
                      pairs: bool = True, progress: Callable[[str], None] | None = None) -> list[Path]:
    """Scan every planted variant into ``out_root/<name>/`` (heads.parquet, summary.json, truth.json,
    pairs.parquet); returns the scan directories."""
    from discovery.artifacts import write_pairs, write_scan
    from discovery.io import write_json
    from discovery.rank.pairs import scan_pairs
    from discovery.toy.planted import planted_model, write_prompts
    from pipelines.sweep import ScanOptions, scan_model

    dirs = []
    for i, variant in enumerate(variants):
        circuit = planted_model(**variant, name=f"planted-{i}")
        out = Path(out_root) / circuit.name
        task_file = write_prompts(out / "prompts.jsonl", prompts, seed=i)
        if progress:
            progress(f"scanning {circuit.name} ({variant})")
        heads, summary = scan_model(circuit.lm, ScanOptions(tasks=[f"jsonl:{task_file}"], prompts=prompts,
                                                             bootstrap=200, seed=i))
        write_scan(out, heads, summary)
        write_json(out / "truth.json", circuit.truth())
        if pairs:
            table, fields = scan_pairs(circuit.lm, heads, summary, k=3, clf=None)
            write_pairs(out, table, fields)
        dirs.append(out)
    return dirs


def labels_from_truth(path: str | Path, model: str | None = None) -> list[dict[str, Any]]:
    """Label records from a ``truth.json``: ``{"labels": [...]}`` or ``{"gather": [...], "aggregate": [...]}``
    (heads as ``{layer, head, kind}``), plus ``role: none`` for every other head its ``heads`` list tested;
    ``model`` defaults to the file's ``model`` or its directory name."""
    p = Path(path)
    data = json.loads(p.read_text(encoding="utf-8"))
    name = model or data.get("model") or p.parent.name
    if isinstance(data.get("labels"), list):
        return [{**rec, "model": rec.get("model") or name} for rec in data["labels"]]
    checkpoint = {"checkpoint": data["checkpoint"]} if data.get("checkpoint") else {}
    out = []
    for role in ("gather", "aggregate"):
        for head in data.get(role) or []:
            out.append({"model": name, "layer": int(head["layer"]), "head": int(head.get("head", head.get("index"))),
                        "kind": head.get("kind", "attn"), "role": role, **checkpoint})
    # an exhaustive truth (``gascan toy truth``) lists every head it tested: the others are known
    # negatives, so a model without G&A (a negative fixture) still counts as labelled
    labelled = {(r["layer"], r["head"], r["kind"]) for r in out}
    for head in data.get("heads") or []:
        key = (int(head["layer"]), int(head["head"]), head.get("kind", "attn"))
        if key not in labelled:
            out.append({"model": name, "layer": key[0], "head": key[1], "kind": key[2], "role": "none", **checkpoint})
    if not out:
        raise GascanError(f"{p} names no gather or aggregate heads and lists no tested heads",
                          "regenerate it with `gascan toy truth`")
    return out


def derive_truth(heads: pl.DataFrame, clean_ld: float, *, effect: float = TRUTH_EFFECT,
                 query_share: float = TRUTH_QUERY_SHARE) -> list[dict[str, Any]]:
    """Fallback labels from an exhaustive single-head scan (when a model has no truth.json).

    A head is **aggregate** when zero-ablating it only at the query position costs at least ``effect`` of
    the clean logit difference and its ``agg_select`` is at least 0.5; **gather** when ablating it at all
    positions costs at least ``effect``, at most ``query_share`` of that cost is at the query position
    (it acts earlier, at the segments), its ``gather_score`` is at least 0.3, and it sits before an
    aggregate head. Redundant heads are missed (single-head ablation), so this under-labels.
    """
    scale = max(abs(clean_ld), 0.5)
    rows = heads.to_dicts()
    aggregate = [r for r in rows if (r.get("d_ld_query") or 0.0) <= -effect * scale and (r.get("agg_select") or 0.0) >= 0.5]
    first_agg = min((r["layer"] for r in aggregate), default=None)
    gather = [r for r in rows if (r.get("d_ld_all") or 0.0) <= -effect * scale
              and (r.get("d_ld_query") or 0.0) >= query_share * (r.get("d_ld_all") or 0.0)
              and (r.get("gather_score") or 0.0) >= 0.3 and first_agg is not None and r["layer"] < first_agg]
    out = []
    for role, part in (("gather", gather), ("aggregate", aggregate)):
        for r in part:
            out.append({"model": r["model"], "checkpoint": r["checkpoint"], "layer": r["layer"], "head": r["head"],
                        "kind": r["kind"], "role": role, "task": r["task"], "source": "derive_truth"})
    return out


def _scanned_model_dir(spec: str | None) -> Path | None:
    """The directory a scan's model spec resolves to (as the loader resolves it), or None."""
    from discovery.model.loading import resolve_spec

    if not spec:
        return None
    try:
        kind, directory, _ = resolve_spec(spec)
    except GascanError:  # the scanned model is not on this machine any more
        return None
    return directory if kind == "dir" else None


def labels_for_dirs(dirs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Labels of scan directories from their truth.json (or the scanned model's truth.json, or derived)."""
    from discovery.artifacts import read_scan

    labels: list[dict[str, Any]] = []
    for d in dirs:
        scan = read_scan(d)
        name = str(scan.summary.get("model"))
        candidates = [Path(d) / "truth.json"]
        model_dir = _scanned_model_dir(scan.summary.get("spec"))
        if model_dir is not None:  # the scanned model's own truth.json (a bundled toy carries one)
            candidates.append(model_dir / "truth.json")
        found = next((c for c in candidates if c.is_file()), None)
        if found is not None:
            checkpoint = scan.summary.get("checkpoint")
            labels += [{**rec, "model": name, **({"checkpoint": checkpoint} if checkpoint else {})}
                       for rec in labels_from_truth(found, name)]
            continue
        for task in scan.tasks:
            clean = scan.clean(task).get("logit_diff")
            if clean is not None:
                labels += derive_truth(scan.heads.filter(pl.col("task") == task), float(clean))
    return labels
