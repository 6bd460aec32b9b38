"""Where attention belongs: rank layers (or heads) to keep or insert attention at, from the G&A evidence.

The science (DESIGN.md): retrieval in the MMLU format runs through a gather and an aggregate head;
replacing the aggregate layer of a distilled Llama-to-Mamba model with the Transformer's own layer
took MMLU from 33% to 50%, and keeping ~2% of heads chosen by retrieval importance kept most of the
teacher's retrieval performance. So a head's placement score combines:

- its role evidence: max(P(gather), P(aggregate)) from the classifier (or, without probabilities, the
  pattern × effect evidence ``gather_x_effect`` / ``agg_x_effect``);
- its causal importance: the larger of its all-position and query-position drop in logit difference,
  relative to the clean value, clipped to [0, 1];
- membership of a ranked G&A pair: +0.25 for a top pair, +0.5 for a confident one (verified by joint
  ablation *and* both heads look like their roles: a verified pair of important non-G&A heads gets
  +0.25 only; on the single-word fixture the larger bonus put attention on the wrong layer);
- the evidence stage's role when the scan has one (``evidence.parquet``): a causally confirmed gather or
  aggregate head counts as role evidence ≥ 0.9, a decoy's role evidence is cut to a tenth.

``score = 0.5 * role + 0.5 * importance + pair bonus``; a layer scores as its best head. The action is
"keep attention" where the head is an attention head (distilling a Transformer or a hybrid) and "insert
attention" where it is an SSM head (the layer's mixer carries the role without softmax attention).
Every choice comes with the evidence behind it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from discovery.errors import GascanError
from discovery.rank.pairs import is_confident

UNITS = ("layer", "head")


@dataclass
class Choice:
    """One place to keep or insert attention, and why."""

    unit: str
    layer: int
    head: int | None
    kind: str
    action: str
    score: float
    why: str

    @property
    def name(self) -> str:
        if self.unit == "layer":
            return f"layer {self.layer}"
        return f"L{self.layer}{'H' if self.kind == 'attn' else 'S'}{self.head}"

    def as_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "layer": self.layer, "head": self.head, "kind": self.kind,
                "action": self.action, "score": self.score, "why": self.why}


def default_budget(summary: Mapping[str, Any], unit: str) -> int:
    """Layers: about one in 16 (at least 1); heads: about 2% of all heads (at least a gather and an aggregate)."""
    if unit == "layer":
        return max(1, round(int(summary.get("n_layers") or 1) / 16))
    total = sum((summary.get("n_heads") or {}).values()) or 1
    return max(2, math.ceil(0.02 * total))


def _pair_members(pairs: pl.DataFrame | None) -> dict[tuple[int, int, str], tuple[float, str]]:
    """Head -> (bonus, reason) for heads in ranked pairs (best pair first)."""
    out: dict[tuple[int, int, str], tuple[float, str]] = {}
    if pairs is None or pairs.height == 0:
        return out
    order = pairs.sort("rank") if "rank" in pairs.columns else pairs
    for r in order.head(10).iter_rows(named=True):
        g = (r["gather_layer"], r["gather_head"], r["gather_kind"])
        a = (r["aggregate_layer"], r["aggregate_head"], r["aggregate_kind"])
        confident = is_confident(r)
        bonus = 0.5 if confident else 0.25
        gname = f"L{g[0]}{'H' if g[2] == 'attn' else 'S'}{g[1]}"
        aname = f"L{a[0]}{'H' if a[2] == 'attn' else 'S'}{a[1]}"
        evidence = (f"joint ablation {r['joint_effect']:.3g} vs random same-layer pairs {r['control_mean']:.3g}"
                    if r.get("joint_effect") is not None and r.get("control_mean") is not None else
                    f"pair score {r.get('score', 0.0):.3g}")
        kind = "confident" if confident else "verified (heads not G&A-like)" if r.get("verified") else "ranked"
        text = f"{kind} pair {gname} → {aname} ({evidence})"
        for head in (g, a):
            if head not in out or out[head][0] < bonus:
                out[head] = (bonus, text)
    return out


def head_scores(heads: pl.DataFrame, summary: Mapping[str, Any] | None = None,
                pairs: pl.DataFrame | None = None) -> pl.DataFrame:
    """One row per head (best task): role, importance, pair bonus, score and the reason text."""
    from discovery.rank.classifier import attach_clean, head_features

    if heads.height == 0:
        return pl.DataFrame()
    f = attach_clean(heads, summary) if summary is not None else heads
    feats = head_features(f)
    has_p = "p_gather" in heads.columns and "p_aggregate" in heads.columns
    pg = heads["p_gather"].fill_null(0.0).to_numpy() if has_p else feats["gather_x_effect"].fill_null(0.0).to_numpy()
    pa = (heads["p_aggregate"].fill_null(0.0).to_numpy() if has_p
          else feats["agg_x_effect"].fill_null(0.0).to_numpy())
    drop_all = feats["drop_all"].fill_null(np.nan).to_numpy()
    drop_query = feats["drop_query"].fill_null(np.nan).to_numpy()
    importance = np.clip(np.nan_to_num(np.fmax(drop_all, drop_query), nan=0.0), 0.0, 1.0)
    members = _pair_members(pairs)
    evidence_roles = heads["role"].to_list() if "role" in heads.columns else [None] * heads.height
    rows = []
    for i, r in enumerate(heads.select("task", "layer", "head", "kind").iter_rows(named=True)):
        key = (r["layer"], r["head"], r["kind"])
        bonus, pair_text = members.get(key, (0.0, ""))
        role_name, role = ("aggregate", pa[i]) if pa[i] >= pg[i] else ("gather", pg[i])
        label = f"P({role_name})" if has_p else f"{role_name} pattern × effect"
        parts = [f"{role_name}-like ({label} {role:.2f})"]
        verdict = evidence_roles[i]
        if verdict in ("gather", "aggregate"):  # the evidence stage confirmed the role causally
            role_name, role = verdict, max(float(role), 0.9)
            parts.append(f"{verdict} by the evidence standards")
        elif verdict == "decoy":
            role = 0.1 * float(role)
            parts.append("decoy by the evidence standards (pattern without effect)")
        score = 0.5 * float(role) + 0.5 * float(importance[i]) + bonus
        if np.isfinite(drop_all[i]) or np.isfinite(drop_query[i]):
            where, value = (("at the query position", drop_query[i]) if np.nan_to_num(drop_query[i], nan=-9) >=
                            np.nan_to_num(drop_all[i], nan=-9) else ("at all positions", drop_all[i]))
            parts.append(f"ablating it {where} costs {100 * value:.0f}% of the clean logit difference")
        if pair_text:
            parts.append(pair_text)
        rows.append({**r, "role": role_name, "role_evidence": float(role), "importance": float(importance[i]),
                     "pair_bonus": bonus, "score": score, "why": f"{r['task']}: " + "; ".join(parts)})
    table = pl.DataFrame(rows)
    best = table.sort("score", descending=True).unique(["layer", "head", "kind"], keep="first", maintain_order=True)
    return best


def _action(kind: str, summary: Mapping[str, Any] | None) -> str:
    if kind == "attn":
        return "keep attention"
    return "insert attention"


def place(heads: pl.DataFrame, summary: Mapping[str, Any] | None = None, pairs: pl.DataFrame | None = None, *,
          budget: int = 1, unit: str = "layer") -> list[Choice]:
    """The ``budget`` best layers or heads for attention, best first, each with the reason."""
    if unit not in UNITS:
        raise GascanError(f"unknown placement unit {unit!r}", "use --unit layer or --unit head")
    if budget < 1:
        raise GascanError(f"budget {budget} is below 1", "pass --budget 1 or more")
    scores = head_scores(heads, summary, pairs)
    if scores.height == 0:
        return []
    choices: list[Choice] = []
    if unit == "head":
        for r in scores.head(budget).iter_rows(named=True):
            choices.append(Choice("head", r["layer"], r["head"], r["kind"], _action(r["kind"], summary),
                                  float(r["score"]), r["why"]))
        return choices
    by_layer = scores.sort("score", descending=True).group_by("layer", maintain_order=True).head(2)
    ranked = by_layer.group_by("layer", maintain_order=True).agg(pl.col("score").max().alias("best"),
                                                                pl.col("why"), pl.col("kind"), pl.col("head"))
    ranked = ranked.sort("best", descending=True).head(budget)
    for r in ranked.iter_rows(named=True):
        heads_text = "; ".join(f"L{r['layer']}{'H' if k == 'attn' else 'S'}{h}: {w}"
                               for h, k, w in zip(r["head"], r["kind"], r["why"]))
        kind = r["kind"][0]
        choices.append(Choice("layer", r["layer"], None, kind, _action(kind, summary), float(r["best"]), heads_text))
    return choices
