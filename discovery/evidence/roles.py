"""Verdicts: a role per head (gather, aggregate, other_important, decoy, none) with the evidence behind it,
and one verdict per model (clean, distributed, none)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import polars as pl

from discovery.evidence.common import _fmt, _num
from discovery.evidence.thresholds import MINIMAL_SCOPES, SCOPE_ABLATIONS, EvidenceThresholds
from discovery.heads import HeadId
from discovery.measure.metrics import selection


@dataclass
class _Effect:
    mean: float | None
    lo: float | None
    hi: float | None

    @property
    def drop(self) -> float | None:
        return None if self.mean is None else -self.mean

    def counts(self, ref: float, fraction: float) -> bool:
        """A harmful effect of at least ``fraction * ref`` whose interval lies below 0."""
        return (self.mean is not None and self.hi is not None and ref > 0 and self.hi < 0
                and -self.mean >= fraction * ref)

    def some(self, ref: float, fraction: float) -> bool:
        """Any effect (either sign) of at least ``fraction * ref`` whose interval excludes 0."""
        if self.mean is None or self.lo is None or self.hi is None or ref <= 0:
            return False
        return (self.hi < 0 or self.lo > 0) and abs(self.mean) >= fraction * ref


def _effect(row: Mapping[str, Any], column: str) -> _Effect:
    return _Effect(_num(row.get(column)), _num(row.get(f"{column}_lo")), _num(row.get(f"{column}_hi")))


def lives_at(row: Mapping[str, Any], scope: str, th: EvidenceThresholds, clean_ld: float,
             mm_ld: float | None = None) -> bool:
    """The head's own effect lives at ``scope`` (``query`` or ``segment``), in the full model or in the
    minimal model (``mm_`` columns, against ``mm_ld``): ablating it there alone gives a drop that counts,
    and at least ``th.located`` of its all-position drop."""
    for prefix, ref in (("", clean_ld), ("mm_", mm_ld)):
        if ref is None or f"{prefix}d_ld_{scope}" not in row:
            continue
        here, everywhere = _effect(row, f"{prefix}d_ld_{scope}"), _effect(row, f"{prefix}d_ld_all")
        if not here.counts(ref, th.effect):
            continue
        if everywhere.drop is None or everywhere.drop <= 0 or here.drop >= th.located * everywhere.drop:
            return True
    return False


_PLACES = {"query": "at the query", "summary tokens": "at the summary tokens", "segments": "at the segments",
           "elsewhere": "spread or at other positions", "none": "no effect alone"}


# ``where`` names of the positions a drop can live at -> the scope of their ``d_ld_{scope}`` columns
WHERE_SCOPES = {"query": "query", "summary tokens": "summary", "segments": "segment"}


def _where(row: Mapping[str, Any], th: EvidenceThresholds, ref: float, prefix: str = "") -> str:
    """Where a head's all-position drop lives: query, summary tokens, segments, elsewhere, or none (a drop
    under ``noise`` of ``ref``, the clean logit difference)."""
    total = _num(row.get(f"{prefix}d_ld_all"))
    if total is None or ref <= 0 or -total < th.noise * ref:
        return "none"
    shares = {name: (_num(row.get(f"{prefix}d_ld_{scope}")) or 0.0) / total for name, scope in WHERE_SCOPES.items()}
    for name in WHERE_SCOPES:
        if shares[name] >= th.located:
            return name
    return "elsewhere"


def task_done(clean: Mapping[str, float], th: EvidenceThresholds) -> bool:
    """Whether the model does the task: a positive clean logit difference and clean accuracy at least
    ``min_margin`` above chance. When it does not, no head can carry the task (no G&A role is given)."""
    return float(clean["logit_diff"]) > 0 and clean.get("acc", 1.0) - clean.get("chance", 0.0) >= th.min_margin


def verdicts(frame: pl.DataFrame, groups: pl.DataFrame | None, thresholds: EvidenceThresholds | None = None, *,
             clean: Mapping[str, float], reads: pl.DataFrame | None = None,
             minimal: Mapping[str, Any] | None = None, unresolved: frozenset[str] = frozenset()
             ) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Per-head roles with their evidence, and the model's verdict.

    ``frame``: one row per head with the pattern metrics (``selectivity``, ``agg_select``,
    ``gather_score``) and :func:`position_effects` columns (plus ``mm_`` minimal-model columns when
    available); ``groups``: :func:`group_ablations`; ``clean``: ``logit_diff``, ``acc``, ``chance`` of the
    full model (and ``mm_logit_diff`` of the minimal model); ``reads``: :func:`read_test`.

    Roles (first that applies):

    - ``aggregate``: an aggregate-like pattern (selectivity, or agg_select / agg_after >= threshold) and an effect at
      the query: its own query-position drop counts and is at least ``located`` of its all-position drop
      (full or minimal model, :func:`lives_at`), or it is credited by a significant query-scoped group of
      such heads (the spare-one test);
    - ``gather``: a gather-like pattern, an effect at the segment positions (its own, likewise, or credit
      from its layer's gatherer group), and a later ``aggregate`` head reads it (:func:`read_test`);
    - ``other_important``: any effect that counts (either sign, any scope) or credit from any group;
    - ``decoy``: a G&A-like pattern and no effect at any scope (each within ``noise`` of the clean logit
      difference or with an interval including 0), in the minimal model too, and no group credit; never a
      head the evidence budget left untested (``tested`` false: only the sweep's scopes were measured) or
      a member of a group the budget did not test (``unresolved``: its group credit is unknown); and only when
      the model does the task (:func:`task_done`: otherwise no head has an effect, and a pattern without one
      says nothing);
    - ``none``: the rest.

    Group credit: a member of a significant group is credited when sparing it alone restores at least
    ``noise`` of the clean logit difference; when a significant role group of two or more heads credits
    nobody (an effect too spread to resolve), every member shares it ("jointly"); a group whose spare-one test
    the budget skipped (``marginal`` null) credits nobody, and its members are ``unresolved``.

    Verdict: ``clean`` when an aggregate head with its own query effect is read-linked to a gather head
    with its own segment effect; ``distributed`` when G&A roles exist but only through groups (single
    heads too weak, the group strong against its controls) or without a single confirmed pair; ``none``
    otherwise, naming the heads that carry the task and where their effect lives.
    """
    th = thresholds or EvidenceThresholds()
    clean_ld = float(clean["logit_diff"])
    mm_ld = float(clean.get("mm_logit_diff") or 0.0)
    groups = groups if groups is not None else pl.DataFrame()
    reads = reads if reads is not None else pl.DataFrame()
    credits: dict[str, list[str]] = {}  # head -> significant groups that credit it
    sig_groups = []
    for g in groups.iter_rows(named=True) if groups.height else []:
        if g["significant"]:
            sig_groups.append(g)
            for h in g["credited"] or []:
                credits.setdefault(h, []).append(g["group"])
            if not g["credited"] and g["n"] >= 2 and g["role"] in ("aggregate", "gather") and g["marginal"] is not None:
                # too spread for the spare-one test to resolve: every member shares the joint effect
                for h in g["heads"]:
                    credits.setdefault(h, []).append(f"{g['group']} (jointly)")
    read_by: dict[str, list[dict[str, Any]]] = {}
    for r in reads.iter_rows(named=True) if reads.height else []:
        if r["reads"]:
            read_by.setdefault(r["gather"], []).append(r)

    done = task_done(clean, th)
    rows: list[dict[str, Any]] = []
    info: dict[str, dict[str, Any]] = {}
    for row in frame.iter_rows(named=True):
        h = HeadId(int(row["layer"]), int(row["head"]), str(row["kind"]))
        name = str(h)
        sel, sel_ok = _num(row.get("selectivity")), False
        gscore = _num(row.get("gather_score"))
        # selection on the gold option's own tokens or just after them (metrics.selection)
        agg_pattern = (sel is not None and sel >= th.selectivity) or selection(row) >= th.agg_select
        gather_pattern = gscore is not None and gscore >= th.gather_score
        sel_ok = agg_pattern
        eff = {s: _effect(row, f"d_ld_{s}") for s in SCOPE_ABLATIONS}
        mm = {s: _effect(row, f"mm_d_ld_{s}") for s in MINIMAL_SCOPES}
        mine = credits.get(name, [])
        q_single = lives_at(row, "query", th, clean_ld, mm_ld)
        q_group = any(g.endswith("@query") or "@query " in g for g in mine)
        s_single = lives_at(row, "segment", th, clean_ld, mm_ld)
        s_group = any(g.startswith("gatherers") for g in mine)
        any_effect = (any(e.some(clean_ld, th.effect) for e in eff.values())
                      or any(e.some(mm_ld, th.effect) for e in mm.values()))
        no_effect = (not any(e.some(clean_ld, th.noise) for e in eff.values())
                     and not any(e.some(mm_ld, th.noise) for e in mm.values()) and not mine
                     and name not in unresolved)
        info[name] = {"head": h, "agg_pattern": agg_pattern, "gather_pattern": gather_pattern, "q_single": q_single,
                      "q_group": q_group, "s_single": s_single, "s_group": s_group, "any_effect": any_effect,
                      "no_effect": no_effect, "credits": mine, "row": row, "sel_ok": sel_ok}

    # aggregate first: gather needs a later aggregate head that reads it
    for name, v in info.items():
        v["role"] = "aggregate" if done and v["agg_pattern"] and (v["q_single"] or v["q_group"]) else None
    aggregate_names = {n for n, v in info.items() if v["role"] == "aggregate"}
    for name, v in info.items():
        if v["role"] or not done:
            continue
        readers = [r for r in read_by.get(name, []) if r["reader"] in aggregate_names]
        v["readers"] = readers
        if v["gather_pattern"] and (v["s_single"] or v["s_group"]) and readers:
            v["role"] = "gather"
    for name, v in info.items():
        if v["role"]:
            continue
        if done and (v["any_effect"] or v["credits"]):
            v["role"] = "other_important"
        elif (done and (v["agg_pattern"] or v["gather_pattern"]) and v["no_effect"]
              and v["row"].get("tested") is not False):
            v["role"] = "decoy"  # a head the budget left untested is no decoy: its other scopes were not measured
        else:
            v["role"] = "none"

    for name, v in info.items():
        row = v["row"]
        rows.append({"layer": v["head"].layer, "head": v["head"].index, "kind": v["head"].kind, "name": name,
                     "role": v["role"], "evidence": _evidence_text(v, th, clean_ld, mm_ld),
                     "where": _where(row, th, clean_ld),
                     "mm_where": _where(row, th, mm_ld, "mm_") if "mm_d_ld_all" in row else None,
                     "pattern": "+".join(p for p, f in (("aggregate", v["agg_pattern"]), ("gather", v["gather_pattern"]))
                                         if f) or None,
                     "credited_by": ", ".join(v["credits"]) or None,
                     "read_by": ", ".join(r["reader"] for r in v.get("readers", [])) or None,
                     "rel_drop_all": (-_num(row.get("d_ld_all")) / clean_ld
                                      if _num(row.get("d_ld_all")) is not None and clean_ld > 0 else None)})
    roles = pl.DataFrame(rows, schema_overrides={"mm_where": pl.Utf8, "pattern": pl.Utf8, "credited_by": pl.Utf8,
                                                 "read_by": pl.Utf8, "rel_drop_all": pl.Float64},
                         infer_schema_length=None)
    verdict = _model_verdict(info, sig_groups, read_by, th, clean, done, frame, minimal)
    return roles, verdict

EVIDENCE_PATTERN_METRICS = ("selectivity", "agg_select", "agg_after", "gather_score", "gather_cross")
"""The pattern metrics an evidence line quotes, in this order."""


def _direct_change(drop: float | None) -> str:
    """A reader's relative direct-effect drop in words ("direct effect falls 19%")."""
    if drop is None:
        return "direct effect n/a"
    return f"direct effect {'falls' if drop >= 0 else 'rises'} {abs(drop):.0%}"


def _evidence_text(v: Mapping[str, Any], th: EvidenceThresholds, clean_ld: float, mm_ld: float) -> str:
    """One line: the pattern numbers, the drops per scope (share of clean), credits and readers."""
    row = v["row"]

    def drop(column: str, ref: float) -> str:
        """``drop all 4.89 [4.10, 5.60] (48% of clean 10.20)``: the drop in logit difference, its interval and
        its share of ``ref`` (the clean logit difference), number and share with the same sign.

        Drop = clean - ablated = minus the stored ``d_ld_*`` delta (ablated - clean); positive = the head
        helps. That is the convention of ``discovery.rank.verdict.drop``, written out here because the
        evidence stage sits below rank and must not import it."""
        e = _effect(row, column)
        if e.mean is None:
            return "n/a"
        value = -e.mean + 0.0  # + 0.0: no "-0.00"
        lo, hi = (None if e.hi is None else -e.hi + 0.0), (None if e.lo is None else -e.lo + 0.0)
        share = f" ({value / ref:.0%} of clean {ref:.2f})" if ref > 0 else ""
        return f"{value:.2f} [{_fmt(lo)}, {_fmt(hi)}]{share}"

    # only the columns the table has: tables from before agg_after or gather_cross existed lack them
    parts = [", ".join(f"{name} {_fmt(_num(row[name]))}" for name in EVIDENCE_PATTERN_METRICS if name in row)]
    parts.append("drop " + ", ".join(f"{s} {drop(f'd_ld_{s}', clean_ld)}" for s in SCOPE_ABLATIONS
                                     if f"d_ld_{s}" in row))
    if "mm_d_ld_all" in row:
        parts.append("minimal model drop " + ", ".join(f"{s} {drop(f'mm_d_ld_{s}', mm_ld)}" for s in MINIMAL_SCOPES
                                                        if f"mm_d_ld_{s}" in row))
    if v["credits"]:
        parts.append("needed by group " + ", ".join(v["credits"]))
    if v.get("readers"):
        parts.append("read by " + ", ".join(f"{r['reader']} ({_direct_change(r['dla_drop'])}, "
                                            f"selectivity {_fmt(r['select_clean'])}->{_fmt(r['select_ablated'])})"
                                            for r in v["readers"]))
    if v["role"] == "decoy":
        parts.append(f"pattern without effect: every |effect| < {th.noise:.0%} of clean or interval includes 0")
    if row.get("tested") is False:
        parts.append("untested beyond the sweep (evidence budget)")
    return "; ".join(parts)


def _model_verdict(info: Mapping[str, Mapping[str, Any]], sig_groups: list[dict[str, Any]],
                   read_by: Mapping[str, list[dict[str, Any]]], th: EvidenceThresholds, clean: Mapping[str, float],
                   done: bool, frame: pl.DataFrame, minimal: Mapping[str, Any] | None) -> dict[str, Any]:
    clean_ld = float(clean["logit_diff"])

    def names(role: str) -> list[str]:
        return [n for n, v in info.items() if v["role"] == role]

    aggregates, gathers, decoys = names("aggregate"), names("gather"), names("decoy")
    pairs = []
    for g in gathers:
        for r in read_by.get(g, []):
            if r["reader"] in aggregates:
                a = info[r["reader"]]
                clean_pair = bool(a["q_single"] and info[g]["s_single"])
                pairs.append({"gather": g, "aggregate": r["reader"], "single_head_evidence": clean_pair,
                              "dla_drop": r["dla_drop"], "select_clean": r["select_clean"],
                              "select_ablated": r["select_ablated"]})
    role_groups_sig = [g for g in sig_groups if g["role"] in ("aggregate", "gather")
                       and any(g["group"] in c for n in aggregates + gathers for c in info[n]["credits"])]
    carriers = []
    ranked = sorted(((_num(v["row"].get("d_ld_all")), n) for n, v in info.items()
                     if _num(v["row"].get("d_ld_all")) is not None), key=lambda t: t[0])
    for value, n in ranked[:th.top_k]:
        row = info[n]["row"]
        carriers.append({"head": n, "effect": value, "rel_drop": -value / clean_ld if clean_ld > 0 else None,
                         "where": _where(row, th, clean_ld), "role": info[n]["role"]})
    out: dict[str, Any] = {
        "clean": {k: _num(v) for k, v in clean.items()}, "pairs": pairs, "aggregate_heads": aggregates,
        "gather_heads": gathers, "decoys": decoys, "other_important": names("other_important"),
        "groups": [{"group": g["group"], "heads": g["heads"], "effect": g["effect"], "rel_drop": g["rel_drop"],
                    "control_p95": g["control_p95"], "credited": g["credited"]} for g in sig_groups],
        "carriers": carriers, "minimal_model": dict(minimal) if minimal else None,
    }
    if not done:
        out["verdict"] = "none"
        out["reason"] = (f"the model does not do the task (clean logit difference {clean_ld:.2f}, accuracy "
                         f"{clean.get('acc', float('nan')):.2f} vs chance {clean.get('chance', float('nan')):.2f}), "
                         "so no head can carry it")
        return out
    confident = [p for p in pairs if p["single_head_evidence"]]
    if confident:
        out["verdict"] = "clean"
        out["reason"] = ("clean G&A: " + "; ".join(f"{p['gather']} gathers, {p['aggregate']} aggregates"
                                                   for p in confident)
                         + " (each head's own ablation matters at its positions, and the aggregate head reads "
                           "the gather head)")
    elif aggregates or gathers:
        out["verdict"] = "distributed"
        spread = [f"{g['group']} ({len(g['heads'])} heads: joint drop {g['rel_drop']:.0%} of clean, random "
                  f"controls' 95th percentile {-(g['control_p05'] or 0.0) / clean_ld + 0.0:.0%})"
                  for g in role_groups_sig]
        out["reason"] = ("G&A spread over several heads: "
                         + ("; ".join(spread) if spread else "roles found without a single confirmed pair")
                         + (f"; aggregate {', '.join(aggregates)}" if aggregates else "")
                         + (f"; gather {', '.join(gathers)}" if gathers else ""))
    else:
        out["verdict"] = "none"
        what = ", ".join(f"{c['head']} ({c['rel_drop']:.0%} of clean, {_PLACES.get(c['where'], c['where'])})"
                         for c in carriers
                         if c["rel_drop"] is not None and c["rel_drop"] >= th.effect) or "no single head"
        out["reason"] = f"no G&A: the task is carried by {what}"
    if decoys:
        out["reason"] += f"; decoys (pattern without effect): {', '.join(decoys)}"
    return out
