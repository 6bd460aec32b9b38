"""The appendix's tables about heads and pairs: how the verdict was decided (the tested pairs with their
status), roles by the evidence standards, group ablations, the heads with the largest effects, possible
decoys. Every effect is a drop in logit difference (clean − ablated, positive = helps).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from discovery.artifacts import Scan
from discovery.rank.verdict import Verdict, drop
from discovery.report.common import Section, Table, ci_only, drop_ci, drop_pct, fmt, head_label, head_name, signed
from discovery.report.first_screen import OUTCOME_WORDS, ROLE_ORDER, head_roles

MAX_LISTED = 10  # long head lists: the first ten, then "and N more"
MAX_ROWS = 20


def listing(names: list[str], where: str = "evidence.parquet", k: int = MAX_LISTED) -> str:
    """``a, b, c`` or ``a, b, … and N more; full list in WHERE``."""
    if not names:
        return "none"
    text = ", ".join(names[:k])
    return text + (f" and {len(names) - k} more; full list in {where}" if len(names) > k else "")


def verdict_section(scan: Scan, verdict: Verdict | None, note: str) -> Section:
    """Why the verdict is what it is, and every ranked pair with the status the verdict gave it."""
    sec = Section("How the verdict was decided")
    if verdict is None:
        sec.paragraphs.append(note.capitalize() + ".")
    for t in (verdict.tasks if verdict else ()):
        sec.paragraphs.append(f"{t.task}: {OUTCOME_WORDS.get(t.outcome, t.outcome)}, confidence {t.confidence}. "
                              f"{t.reason}")
    status = {(p.task, p.rank): p for t in (verdict.tasks if verdict else ()) for p in t.pairs}
    pairs = scan.pairs
    if pairs is None or pairs.height == 0:
        sec.paragraphs.append("No pairs.parquet in this scan: no pair was ranked or tested.")
        return sec
    sec.paragraphs.append(
        "Pair score: classifier probabilities and the interaction test (ablating the gather head changes the "
        "aggregate head's selection, or holding the aggregate head clean gives back the gather head's drop: the "
        "mediated share). Joint drop: both heads ablated, with its 95% bootstrap interval; control: random "
        "head pairs from the same two layers (mean drop, and its 95th percentile). Joint ablations run for the "
        "top pairs whose two heads both have their G&A roles by the evidence stage (only such a pair can be a G&A "
        "pair; without one, the top pair alone; without the stage, the top pairs by score); the other pairs "
        "show –. Status from the verdict: verified when the joint drop beats the controls at the 5% level.")
    several = len(scan.tasks) > 1
    rows = []
    for r in pairs.sort("rank").head(MAX_ROWS).iter_rows(named=True):
        call = status.get((r.get("task", ""), r.get("rank")))
        control = (f"{signed(drop(r['control_mean']))} (95th pct {signed(drop(r.get('control_q05')))})"
                   if r.get("control_mean") is not None else "–")
        rows.append(([r.get("task", "")] if several else []) + [
            r.get("rank"), head_name(r["gather_layer"], r["gather_head"], r["gather_kind"]),
            head_name(r["aggregate_layer"], r["aggregate_head"], r["aggregate_kind"]),
            r.get("score"), r.get("select_drop"), r.get("mediated"), drop_ci(r, "joint_effect"), control,
            r.get("control_p"), call.status.replace("_", " ") if call else "–"])
    sec.tables.append(Table((["task"] if several else []) + [
        "rank", "gather", "aggregate", "score", "select drop", "mediated", "joint drop [95% CI]", "control drop",
        "p", "status"], rows))
    if pairs.height > MAX_ROWS:
        sec.paragraphs.append(f"The first {MAX_ROWS} of {pairs.height} ranked pairs; all in pairs.parquet.")
    return sec


def _evidence_rows(heads: pl.DataFrame, roles: Mapping[tuple[str, int, int, str], str], clean: Mapping[str, Any]):
    for r in heads.iter_rows(named=True):
        role = roles.get((r["task"], r["layer"], r["head"], r["kind"]))
        if not role:
            continue
        yield ROLE_ORDER.get(role, 9), -(drop(r.get("d_ld_all")) or 0.0), role, r


def roles_section(scan: Scan, heads: pl.DataFrame, verdict: Verdict | None) -> Section | None:
    """The heads with a role (the verdict's, else the evidence stage's), their position-resolved drops, the
    minimal model and the group ablations."""
    roles = head_roles(verdict, heads)
    if not roles and scan.evidence_groups is None:
        return None
    sec = Section("Roles by the evidence standards",
                  [("A head is gather or aggregate only when its pattern and its drop at the right positions "
                    "agree; decoy = G&A-like pattern and no effect at any scope, minimal model included "
                    "(thresholds in summary.json, evidence.*.thresholds).")])
    clean = {t: scan.clean(t).get("logit_diff") for t in scan.tasks}
    ranked = sorted(_evidence_rows(heads, roles, clean), key=lambda x: (x[0], x[1]))
    for task in scan.tasks:
        by_role: dict[str, list[str]] = {}
        for _o, _d, role, r in ranked:
            if r["task"] == task:
                by_role.setdefault(role, []).append(head_label(r))
        if by_role:
            sec.paragraphs.append(f"{task}: " + "; ".join(f"{role.replace('_', ' ')} {listing(names)}"
                                                          for role, names in by_role.items()))
        mm = ((scan.summary.get("evidence") or {}).get(task) or {}).get("minimal_model") or {}
        if mm.get("depth") is not None:
            sec.paragraphs.append(f"{task}: the minimal model keeps {mm['depth']} of {mm.get('n_layers')} layers.")
    rows = []
    for _o, _d, role, r in [x for x in ranked if x[2] != "other_important"] + \
            [x for x in ranked if x[2] == "other_important"][:MAX_LISTED]:
        rows.append([r["task"], head_label(r), role.replace("_", " "),
                     r.get("where") or "–", drop_pct(r.get("d_ld_all"), clean.get(r["task"])),
                     drop_ci(r, "d_ld_query"), drop_ci(r, "d_ld_segment"), drop_ci(r, "d_ld_summary"),
                     drop_ci(r, "mm_d_ld_all"), r.get("read_by") or "–"])
    if rows:
        sec.tables.append(Table(["task", "head", "role", "where the effect lives", "drop, all positions",
                                 "drop, query", "drop, segments", "drop, summary tokens", "drop, minimal model",
                                 "read by"], rows[:MAX_ROWS + MAX_LISTED]))
        n_other = sum(1 for x in ranked if x[2] == "other_important")
        if n_other > MAX_LISTED:
            sec.paragraphs.append(f"The table lists the {MAX_LISTED} other important heads with the largest "
                                  f"drops, of {n_other}; full list in evidence.parquet.")
    groups = scan.evidence_groups
    if groups is not None and groups.height:
        rows = []
        for r in groups.iter_rows(named=True):
            control = (f"{signed(drop(r['control_mean']))} [{signed(drop(r.get('control_p95')))}, "
                       f"{signed(drop(r.get('control_p05')))}]" if r.get("control_mean") is not None
                       else "not drawn: joint drop too small" if r.get("controls_drawn") is False else "–")
            rows.append([r.get("task", ""), r.get("group"), r.get("scope"), r.get("n"), drop_ci(
                {"e": r.get("effect"), "e_lo": r.get("effect_lo"), "e_hi": r.get("effect_hi")}, "e"),
                control, r.get("significant"), ", ".join(r.get("credited") or []) or "–"])
        sec.tables.append(Table(["task", "group", "scope", "heads", "joint drop [95% CI]",
                                 "control drop (5–95%)", "significant", "credited"], rows[:MAX_ROWS]))
        if "controls_drawn" in groups.columns and not all(groups["controls_drawn"].to_list()):
            share = ((scan.summary.get("evidence") or {}).get(scan.tasks[0], {}).get("thresholds") or {}).get("group")
            sec.paragraphs.append(
                "Random controls are drawn only for groups whose joint drop could make them significant (at least "
                + (f"{share:.0%}" if share is not None else "the group share")
                + " of the clean logit difference, interval below 0); the others are not significant whatever "
                  "their controls would show.")
    return sec


def screened_sentence(task: str, screened: dict) -> str:
    """What ``--ablation screened`` did and how far its screen is trusted: the screen's cost for every head,
    the k heads it sent to the exact sweep and why k, and its agreement on those k only (the other heads
    have no exact all-position effect to compare with)."""
    agreement = screened.get("agreement") or {}
    measured = screened.get("measured_recall") or {}
    n, k = screened.get("n_heads"), screened.get("k")
    worst = measured.get("worst_k_for_recall")
    relation = "at least" if worst is not None and k is not None and k >= worst else "below (the screen may miss heads)"
    why = (f" (k is {relation} the largest k, {worst}, the screen needed on the "
           f"{measured.get('runs')} measured runs to find {measured.get('target')} of the exact top "
           f"{measured.get('top')}: {measured.get('table')})" if measured.get("worst_k_for_recall") else "")
    return (f"{task}: the screen ({screened.get('method')}, {fmt(screened.get('forward_equivalents'))} "
            f"forward-equivalents for all {n} heads) sent its top {k} heads to the exact all-position sweep{why}; "
            f"the other {n - k if n is not None and k is not None else '–'} heads have no exact all-position drop. "
            f"On the {k} swept heads the screen ranks like the exact sweep with Spearman "
            f"{fmt(agreement.get('spearman'))} (on absolute drops {fmt(agreement.get('spearman_abs'))}); "
            f"recall@{agreement.get('k')} {fmt(agreement.get('recall_at_k'))}.")


def top_heads_section(scan: Scan, heads: pl.DataFrame, k: int = MAX_LISTED) -> Section:
    sec = Section("Heads with the largest effects",
                  [("Zero ablation of one head; drop = clean − ablated logit difference, mean over prompts with a "
                    "95% bootstrap interval. Positive = the head helps the task.")])
    for task in scan.tasks:
        task_summary = (scan.summary.get("tasks") or {}).get(task) or {}
        screen = task_summary.get("attribution") or {}
        agreement = screen.get("agreement")
        screened = task_summary.get("screen")
        if screened and agreement:
            sec.paragraphs.append(screened_sentence(task, screened))
        elif agreement:
            sec.paragraphs.append(
                f"{task}: the attribution screen (AtP with the QK fix, {fmt(screen.get('forward_equivalents'))} "
                f"forward-equivalents for every head) ranks heads like the exact sweep with Spearman "
                f"{fmt(agreement.get('spearman'))} (on absolute drops {fmt(agreement.get('spearman_abs'))}); "
                f"recall@{agreement.get('k')} {fmt(agreement.get('recall_at_k'))}.")
        frame = heads.filter(pl.col("task") == task)
        column = next((c for c in ("d_ld_all", "d_ld_query", "atp_ld") if c in frame.columns
                       and frame[c].drop_nulls().len()), None)
        if column is None:
            sec.paragraphs.append(f"{task}: no ablation effects in this scan.")
            continue
        clean = scan.clean(task).get("logit_diff")
        best = frame.filter(pl.col(column).is_not_null()).sort(column).head(k)
        rows = [[task, head_label(r), drop_pct(r.get("d_ld_all"), clean),
                 ci_only(r, "d_ld_all"), drop_ci(r, "d_ld_query"), signed(drop(r.get("atp_ld"))),
                 r.get("gather_score"), r.get("agg_select"), r.get("selectivity"), r.get("p_gather"),
                 r.get("p_aggregate"), (r.get("role") or "–").replace("_", " ")] for r in best.iter_rows(named=True)]
        sec.tables.append(Table(["task", "head", "drop, all positions", "[95% CI]", "drop, query [95% CI]",
                                 "AtP drop", "gather score", "agg select", "selectivity", "P(gather)",
                                 "P(aggregate)", "role"], rows))
    return sec


def decoys_section(scan: Scan, heads: pl.DataFrame, verdict: Verdict | None) -> Section:
    """Heads whose pattern looks like G&A but whose ablation changes (almost) nothing."""
    from discovery.rank.classifier import head_features

    sec = Section("Pattern without effect (possible decoys)")
    roles = head_roles(verdict, heads)
    if roles:
        keys = [k for k, v in roles.items() if v == "decoy"]
        key_frame = pl.DataFrame(keys, schema={"task": pl.Utf8, "layer": pl.Int64, "head": pl.Int64,
                                               "kind": pl.Utf8}, orient="row")
        part = heads.with_columns(pl.col("layer").cast(pl.Int64), pl.col("head").cast(pl.Int64)).join(
            key_frame, on=["task", "layer", "head", "kind"], how="semi")
        sec.paragraphs.append("Heads the verdict (or the evidence stage) calls decoys.")
    else:
        feats = head_features(heads)
        strong = pl.max_horizontal(
            *(pl.col(c).fill_null(0.0) for c in ("agg_select", "selectivity") if c in heads.columns),
            *((pl.col("gather_score").fill_null(0.0) - 0.2,) if "gather_score" in heads.columns else ()),
        ) if heads.height else pl.lit(0.0)
        weak = pl.max_horizontal(pl.Series(feats["drop_all"]).abs().fill_null(0.0),
                                 pl.Series(feats["drop_query"]).abs().fill_null(0.0)) < 0.1
        part = heads.with_columns(strong.alias("_strong"), weak.alias("_weak")).filter(
            (pl.col("_strong") >= 0.6) & pl.col("_weak"))
        sec.paragraphs.append("Heads with agg select or selectivity ≥ 0.6, or gather score ≥ 0.8, whose single-head "
                              "ablation moves the logit difference by less than 10% of the clean value. A pattern "
                              "alone is not evidence (DESIGN.md); these may also be redundant copies, which only a "
                              "group ablation can tell.")
    if part.height == 0:
        sec.paragraphs.append("None.")
        return sec
    rows = [[r["task"], head_label(r), r.get("gather_score"), r.get("agg_select"),
             r.get("selectivity"), drop_ci(r, "d_ld_all"), drop_ci(r, "d_ld_query")]
            for r in part.head(MAX_ROWS).iter_rows(named=True)]
    sec.tables.append(Table(["task", "head", "gather score", "agg select", "selectivity", "drop, all positions",
                             "drop, query"], rows))
    if part.height > MAX_ROWS:
        sec.paragraphs.append(f"The first {MAX_ROWS} of {part.height}; all in evidence.parquet.")
    return sec


def classifier_section(scan: Scan, heads: pl.DataFrame) -> Section:
    """The classifier's G&A heads (P ≥ 0.5), short lists."""
    sec = Section("Classifier probabilities")
    for role in ("gather", "aggregate"):
        items = scan.summary.get(f"{role}_heads")
        column = f"p_{role}"
        if items is None and column in heads.columns:
            part = heads.filter(pl.col(column) >= 0.5).sort(column, descending=True)
            items = [{"layer": r["layer"], "head": r["head"], "kind": r["kind"], "p": r[column], "task": r["task"]}
                     for r in part.iter_rows(named=True)]
        if items is None:
            sec.paragraphs.append(f"{role}: no classifier probabilities in this scan.")
            continue
        names = [f"{head_name(i['layer'], i['head'], i['kind'])} ({fmt(i.get('p'), 2)})" for i in items]
        sec.paragraphs.append(f"P({role}) ≥ 0.5: {listing(names, 'heads.parquet')}." if names
                              else f"P({role}) ≥ 0.5: no head.")
    return sec


def refinement_section(scan: Scan, heads: pl.DataFrame) -> Section | None:
    """Mamba-1 channel refinement per task: done (the refined heads, what the tree cost against ablating
    every channel alone) or skipped and why; None for a scan with no Mamba-1 layers."""
    records = {t: (scan.summary.get("tasks") or {}).get(t, {}).get("refinement") for t in scan.tasks}
    records = {t: r for t, r in records.items() if r and r.get("reason") != "no Mamba-1 layers"}
    if not records:
        return None
    sec = Section("Mamba-1 channel refinement")
    sec.paragraphs.append(
        "The channel groups whose drop counts were split in halves, level by level (all halves of a level in "
        "one batched run), following the halves that count or hold a quarter of their parent's drop, until "
        "single channels, or a group whose halves together no longer carry half its drop (a redundant set, "
        "kept whole). Every node has its drop and its implicit-attention metrics (summary.json: refinement).")
    rows = []
    for task, r in records.items():
        if r.get("status") != "done":
            sec.paragraphs.append(f"{task}: skipped: {r.get('reason')}.")
            continue
        sec.paragraphs.append(
            f"{task}: {r['groups_refined']} groups refined in {r['levels']} levels ({r['ablations']} ablations, "
            f"{fmt(r['forward_equivalents'], 1)} forward-equivalents; every channel ablated alone would cost "
            f"{fmt(r['channel_sweep_forward_equivalents'], 1)}): {len(r['leaves'])} heads.")
        frame = heads.filter(pl.col("task") == task) if "task" in heads.columns else heads
        by_index = {(x["layer"], x["head"]): x for x in frame.iter_rows(named=True)}
        for leaf in r["leaves"]:
            row = by_index.get((leaf["layer"], leaf["index"]), {})
            rows.append([task, leaf["head"], _channels(leaf["channel_start"], leaf["channel_end"]), leaf["kind"],
                         f"{leaf['drop']:+.2f} [{leaf['drop_lo']:+.2f}, {leaf['drop_hi']:+.2f}]",
                         fmt(row.get("agg_select"), 2), fmt(row.get("gather_score"), 2)])
    if rows:
        sec.tables.append(Table(["task", "head", "channels", "kind", "drop [95% CI]", "agg_select", "gather_score"],
                                rows, element_id="refinement"))
    return sec


def _channels(start: int, end: int) -> str:
    return str(start) if end - start == 1 else f"{start}-{end - 1}"
