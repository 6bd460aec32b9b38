"""Where attention belongs: rank layers (or heads) to keep or insert attention at, from the G&A evidence.

The science (DESIGN.md): retrieval in the MMLU format runs through a gather and an aggregate head;
replacing the aggregate layer of a distilled Llama-to-Mamba model with the Transformer's own layer
took MMLU from 33% to 50%, and keeping ~2% of heads chosen by retrieval importance kept most of the
teacher's retrieval performance. So a head's placement score combines:

- its role evidence: max(P(gather), P(aggregate)) from the classifier (or, without probabilities, the
  pattern × effect evidence ``gather_x_effect`` / ``agg_x_effect``);
- its causal importance: the larger of its all-position and query-position drop in logit difference,
  relative to the clean value, clipped to [0, 1];
- membership of a ranked G&A pair: +0.25 for a top pair, +0.5 for a pair the verdict
  (:func:`discovery.rank.verdict.decide`) calls verified (it beats at least 19 random controls at
  p <= 0.05 *and* both heads have their roles by the evidence standards: a pair of important non-G&A
  heads that beats the controls gets +0.25 only; on the single-word fixture the larger bonus put
  attention on the wrong layer);
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
from discovery.rank.verdict import decide, pair_call

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


def _pair_members(pairs: pl.DataFrame | None, summary: Mapping[str, Any] | None = None
                  ) -> dict[tuple[int, int, str], tuple[float, str]]:
    """Head -> (bonus, reason) for heads in ranked pairs (best pair first); the larger bonus goes to the
    verdict's verified pairs only."""
    out: dict[tuple[int, int, str], tuple[float, str]] = {}
    if pairs is None or pairs.height == 0:
        return out
    order = pairs.sort("rank") if "rank" in pairs.columns else pairs
    rows = order.to_dicts()
    verdict = decide(summary or {}, rows)
    verified = {(p.task, p.gather, p.aggregate) for t in verdict.tasks if t.outcome == "verified"
                for p in t.verified_pairs}
    for r in rows[:10]:
        call = pair_call(r)
        g = (call.gather.layer, call.gather.head, call.gather.kind)
        a = (call.aggregate.layer, call.aggregate.head, call.aggregate.kind)
        is_verified = (call.task, call.gather, call.aggregate) in verified
        bonus = 0.5 if is_verified else 0.25
        evidence = (f"joint drop {call.joint_drop:.3g} vs control mean {call.control_mean_drop:.3g}"
                    + (f", p = {call.p_value:.2g}, n = {call.control_n} controls" if call.p_value is not None else "")
                    if call.joint_drop is not None and call.control_mean_drop is not None else
                    f"pair score {r.get('score') or 0.0:.3g}")
        pair = f"{call.gather.name} → {call.aggregate.name}"
        text = (f"verified G&A pair {pair} ({evidence})" if is_verified else
                f"pair {pair} beats the controls, but its heads are not G&A by the evidence standards ({evidence})"
                if call.status == "verified" else f"ranked pair {pair} ({evidence})")
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
    members = _pair_members(pairs, summary)
    evidence_roles = heads["role"].to_list() if "role" in heads.columns else [None] * heads.height
    rows = []
    for i, r in enumerate(heads.select("task", "layer", "head", "kind").iter_rows(named=True)):
        key = (r["layer"], r["head"], r["kind"])
        bonus, pair_text = members.get(key, (0.0, ""))
        role_name, role = ("aggregate", pa[i]) if pa[i] >= pg[i] else ("gather", pg[i])
        label = f"P({role_name})" if has_p else f"{role_name} pattern × effect"
        parts = [f"{role_name}-like ({label} {role:.2f})" if role >= 0.5 else
                 f"not G&A-like (highest: {label} {role:.2f})"]
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
            change = "lowers" if value >= 0 else "raises"  # value: the drop, a share of the clean logit difference
            parts.append(f"ablating it {where} {change} the logit difference by {100 * abs(value):.0f}% of clean")
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
