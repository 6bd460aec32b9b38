"""Position-resolved effects: each head's ablation effect at all positions, the query, the segments
and the summary tokens, with bootstrap intervals over prompts."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import polars as pl

from discovery.errors import GascanError
from discovery.evidence.thresholds import SCOPE_ABLATIONS, SHORT
from discovery.heads import HeadId
from discovery.measure.ablation import Ablation, AblationEngine, Progress, single_head_ablations, stage_ticker
from discovery.stats import bootstrap_ci


def position_effects(engine: AblationEngine, heads: Iterable[HeadId] | None = None, *,
                     scopes: Sequence[str] = tuple(SCOPE_ABLATIONS), bootstrap: int = 1000, seed: int = 0,
                     prefix: str = "", progress: Progress | None = None) -> pl.DataFrame:
    """Every head's effect per scope, in one batched ``engine.run``.

    Columns ``layer, head, kind`` and, per scope ``s`` of ``scopes`` (keys of :data:`SCOPE_ABLATIONS`:
    ``all``, ``query``, ``segment``, ``summary`` zero-ablate there; ``mean_all`` mean-ablates everywhere)
    and metric, ``{prefix}d_{ld|acc|lp}_{s}`` with ``_lo``/``_hi`` bootstrap bounds over prompts (the
    scan's naming and bootstrap, so the numbers agree with its ``d_ld_all``/``d_ld_query``).
    """
    heads = list(engine.inventory.heads() if heads is None else heads)
    heads = [h for h in heads if h.layer < engine.n_active_layers]
    bad = [s for s in scopes if s not in SCOPE_ABLATIONS]
    if bad:
        raise GascanError(f"unknown effect scope {bad[0]!r}", f"use some of: {', '.join(SCOPE_ABLATIONS)}")
    ablations: list[Ablation] = []
    for s in scopes:
        method, where = SCOPE_ABLATIONS[s]
        ablations += single_head_ablations(heads, method, where)
    tick = stage_ticker(progress, f"{prefix}position effects", len(ablations))
    effects = engine.effects(ablations, engine.run(ablations, progress=tick)) if ablations else None
    columns: dict[str, list[Any]] = {"layer": [h.layer for h in heads], "head": [h.index for h in heads],
                                     "kind": [h.kind for h in heads]}
    n = len(heads)
    schema: dict[str, Any] = {"layer": pl.Int64, "head": pl.Int64, "kind": pl.Utf8}
    for k, s in enumerate(scopes):
        for metric, short in SHORT.items():
            name = f"{prefix}d_{short}_{s}"
            schema.update({name: pl.Float64, f"{name}_lo": pl.Float64, f"{name}_hi": pl.Float64})
            if effects is None:  # no heads to test: the columns, empty
                columns[name] = columns[f"{name}_lo"] = columns[f"{name}_hi"] = []
                continue
            mean, lo, hi = bootstrap_ci(effects[metric][k * n:(k + 1) * n], bootstrap, seed=seed)
            columns[name] = mean.tolist()
            columns[f"{name}_lo"] = lo.tolist()
            columns[f"{name}_hi"] = hi.tolist()
    return pl.DataFrame(columns, schema=schema)
