"""Ranked gather → aggregate pairs, each with its interaction test and a verified joint ablation.

For one task's batch and head table:

1. **Candidates**: the ``n_gather`` heads with the highest P(gather) and the ``n_aggregate`` with the
   highest P(aggregate) (the shipped classifier; without one, the pattern × effect evidence stands in),
   paired whenever the gather head's layer is before the aggregate head's (any distance).
2. **Interaction test** per pair (DESIGN.md: knock out the gather head, watch the aggregate head), the
   same two tests the ground truth (:mod:`discovery.truth`) confirms a pair by:
   - ``select_drop`` / ``focus_drop``: how much of the aggregate head's selection
     (:func:`~discovery.metrics.selection`: ``agg_select``, or ``agg_after`` for a head that reads just past
     the option) / ``agg_focus`` is lost when the gather head is zero-ablated (relative to its clean
     value, clipped to [0, 1]): without the gather head the aggregate head no longer finds the option;
   - ``mediated``: the share of the gather head's cost at the segment positions that holding the
     aggregate head at its clean output at the query gives back (clipped to [0, 1]; null when that cost
     is under ``MIN_MEDIATED_COST`` of the clean logit difference): what the aggregate head reads is what
     the gather head wrote. Unlike comparing the heads' single and joint ablations, it does not read
     "dependence" into two heads that each break the task alone.
   ``score = w(g) · w(a) · (0.4 + 0.6 · max(select_drop, focus_drop, mediated))``, where a
   head's weight ``w`` is 1 when the evidence stage gave it the role (pattern and effect at the right
   positions) and its classifier probability otherwise: a head that passed the causal test outranks one
   that only looks like the heads of the training set (on SmolLM2 every P(gather) was below 0.02, which
   let weak layer-0 candidates outrank the evidence stage's gather heads). The ``rank`` order spreads the
   pairs over gather heads (:func:`~discovery.classifier.spread_by_gather`): every gather candidate's best
   pair, by score, before any gather head's second, so a redundant set of aggregate heads does not fill
   the verified top ``k`` with one gather head (the hybrid toy's true gather head came 7th behind one
   layer-0 SSM head paired with each of five aggregate heads; it now comes 2nd and is verified).
3. **Verification** of the top ``k`` pairs whose two heads both have their G&A roles by the evidence
   stage (:func:`verification_choice`; the top pair alone when none has, the top ``k`` without the stage):
   the joint ablation (both heads zeroed at all positions, through the ablation engine) against a control
   of random pairs of the same kinds, neither head one of the pair's, the control's gather layer before its
   aggregate layer: from the pair's own two layers, and where those
   hold fewer than ``MIN_CONTROLS`` (19) such pairs, from neighbouring layer pairs too (both layers within
   ±1 of the pair's, then ±2, ...; the ``control_layers`` column says how far). Up to ``control_draws``
   controls, nearest layers first, drawn (seeded) without replacement within each distance, in one random
   order of all control pairs, so tested pairs from the same layers share most controls (run once). Reported: the
   joint effect with its bootstrap interval over prompts, the control's mean and 5–95% range,
   ``control_n`` and ``control_p`` = (1 + #controls at least as harmful) / (1 + #controls). ``verified``
   is :func:`discovery.rank.verdict.verified_flag` (the one rule, :func:`~discovery.rank.verdict.pair_status`):
   True iff n >= 19, p <= 0.05 and the joint effect's upper bound lies below the control's 5th percentile;
   null (not testable) when fewer than 19 controls exist; False otherwise. With 9 controls the smallest
   possible p is 0.1, which is why 3 controls (the old minimum) never sufficed.
   Whether a verified pair is a *G&A* pair is the verdict's call (:mod:`discovery.rank.verdict`): both heads
   must have their role by the evidence standards (``gather_role`` ``gather``, ``aggregate_role``
   ``aggregate``). Two important heads that are not G&A heads also beat random pairs under joint ablation,
   so verification alone is no G&A evidence; and the classifier alone is not either (on a toy Mamba-2 it
   gave P >= 0.5 to two SSM heads that matter at the right positions but whose implicit attention is not
   selective, and the report called them a G&A pair under a "no G&A" verdict).

Effects are in logit-difference units (ablated − clean; negative = the pair helps).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import polars as pl
import torch

from discovery.errors import GascanError
from discovery.evidence.budget import Ledger, fit, resolve_budget
from discovery.heads import HeadId
from discovery.measure.ablation import Ablation, AblationEngine, Progress, mediated_share, stage_ticker
from discovery.measure.engines import EngineCache
from discovery.measure.metrics import selection
from discovery.measure.patterns import watch_passes_fe
from discovery.rank.classifier import attach_clean, head_features, load_classifier, spread_by_gather
from discovery.rank.verdict import MIN_CONTROLS, has_ga_roles, is_ga_pair, verified_flag
from discovery.stats import bootstrap_ci

PAIR_COLUMNS = (
    "task", "rank", "gather_layer", "gather_head", "gather_kind", "aggregate_layer", "aggregate_head",
    "aggregate_kind", "p_gather", "p_aggregate", "gather_role", "aggregate_role", "select_clean", "select_ablated", "select_drop", "focus_clean",
    "focus_ablated", "focus_drop", "effect_gather", "effect_aggregate", "mediated", "score",
    "joint_effect", "joint_effect_lo", "joint_effect_hi", "joint_acc", "control_mean", "control_q05",
    "control_q95", "control_n", "control_p", "control_layers", "verified",
)
MIN_MEDIATED_COST = 0.05  # share of the clean logit difference a gather head must cost for ``mediated``


def head_probabilities(frame: pl.DataFrame, summary: Mapping[str, Any] | None = None,
                       clf: Any = None) -> tuple[np.ndarray, np.ndarray, str]:
    """P(gather), P(aggregate) per row and where they came from (table, classifier or evidence)."""
    if "p_gather" in frame.columns and "p_aggregate" in frame.columns:
        return (frame["p_gather"].fill_null(0.0).to_numpy(), frame["p_aggregate"].fill_null(0.0).to_numpy(),
                "table")
    f = attach_clean(frame, summary) if summary is not None else frame
    try:
        clf = clf or load_classifier()
        probs = clf.predict(f)
        return probs["gather"], probs["aggregate"], "classifier"
    except GascanError:
        feats = head_features(f)
        g = np.clip(feats["gather_x_effect"].fill_null(0.0).to_numpy(), 0.0, 1.0)
        a = np.clip(feats["agg_x_effect"].fill_null(0.0).to_numpy(), 0.0, 1.0)
        return g, a, "evidence"


def aggregate_metrics_under(lm: Any, batch: Any, ablate: HeadId | None, watch: Sequence[HeadId], *,
                            engine: AblationEngine | None = None, chunk: int = 16) -> dict[HeadId, dict[str, float]]:
    """``agg_select``, ``agg_after`` and ``agg_focus`` (means over prompts) of the ``watch`` heads, with ``ablate``
    zero-ablated at every position through the engine's own edits (clean when ``ablate`` is None)."""
    from discovery.measure.patterns import pattern_metric_values

    engine = engine or AblationEngine(lm, batch)
    edits_for = None
    if ablate is not None:
        edits_for = lambda rows: engine.plan([Ablation((ablate,))], rows)
    found = pattern_metric_values(lm, batch, layers=sorted({h.layer for h in watch}),
                                  kinds=sorted({h.kind for h in watch}), chunk_prompts=chunk, edits_for=edits_for,
                                  engine=engine)
    return {h: {name: float(torch.nanmean(found[(h.layer, h.kind)][name][:, h.index]).item())
                for name in ("agg_select", "agg_after", "agg_focus")} for h in watch}


def _nan_to_none(x: Any) -> Any:
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def _relative_drop(clean: float, ablated: float) -> float | None:
    if math.isnan(clean) or math.isnan(ablated) or clean <= 1e-6:
        return None
    return float(min(1.0, max(0.0, (clean - ablated) / clean)))


def rank_pairs(lm: Any, batch: Any, heads_frame: pl.DataFrame, k: int = 3, *, summary: Mapping[str, Any] | None = None,
               clf: Any = None, engine: AblationEngine | None = None, n_gather: int = 6, n_aggregate: int = 6,
               control_draws: int = 50, bootstrap: int = 1000, seed: int = 0,
               task: str | None = None, ledger: Ledger | None = None, progress: Progress | None = None
               ) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Rank candidate pairs of one task (see module docstring).

    Returns the pairs table (one row per candidate pair, best first, verification columns filled for the
    top ``k``) and the summary fields ``top_pairs``, ``gather_heads`` and ``aggregate_heads``. A ``ledger``
    (:class:`~discovery.evidence.budget.Ledger`) bounds the cost: fewer candidates by probability (the evidence
    stage's role heads always stay), then fewer of the top ``k`` verified (each keeps its ``control_draws``
    controls); each head's single effect is the sweep's ``d_ld_all`` where the table has it. ``progress``
    hears each step (single effects, mediation, patterns under ablation, verification) with its count.
    """
    frame = heads_frame
    if task is not None:
        frame = frame.filter(pl.col("task") == task)
    tasks = frame["task"].unique().to_list() if frame.height else []
    if len(tasks) > 1:
        raise GascanError(f"the head table holds {len(tasks)} tasks", "pass task=... (one batch is one task)")
    task = tasks[0] if tasks else (task or "")
    p_g, p_a, source = head_probabilities(frame, summary, clf)
    head_ids = [HeadId(int(r[0]), int(r[1]), str(r[2])) for r in frame.select("layer", "head", "kind").rows()]
    # the evidence stage's roles, when the table has them: its gather/aggregate heads are always candidates,
    # its decoys (pattern without effect at any scope) never are
    roles = frame["role"].to_list() if "role" in frame.columns else [None] * len(head_ids)
    decoy = {h for h, r in zip(head_ids, roles) if r == "decoy"}
    role_of = dict(zip(head_ids, roles))
    prob = {h: (float(p_g[i]), float(p_a[i])) for i, h in enumerate(head_ids)}

    def pairs_of(n_g: int, n_a: int) -> list[tuple[HeadId, HeadId]]:
        """Candidate pairs from the top ``n_g`` / ``n_a`` heads by probability and every evidence-role head."""
        g_rank = [head_ids[i] for i in np.argsort(-p_g, kind="stable") if head_ids[i] not in decoy][:n_g]
        a_rank = [head_ids[i] for i in np.argsort(-p_a, kind="stable") if head_ids[i] not in decoy][:n_a]
        g_rank += [h for h, r in zip(head_ids, roles) if r == "gather" and h not in g_rank]
        a_rank += [h for h, r in zip(head_ids, roles) if r == "aggregate" and h not in a_rank]
        return [(g, a) for g in g_rank for a in a_rank if g.layer < a.layer]

    def role_weight(h: HeadId, which: int) -> float:
        """A head's weight for a role in the pair score: 1 when the evidence stage gave it that role (it
        passed the causal test at its positions), else the classifier's probability."""
        return 1.0 if role_of.get(h) == ("gather", "aggregate")[which] else prob[h][which]
    fields: dict[str, Any] = {"gather_heads": _role_list(head_ids, p_g, task), "aggregate_heads":
                              _role_list(head_ids, p_a, task), "pair_probabilities": source}
    if not pairs_of(n_gather, n_aggregate):
        fields["top_pairs"] = []
        return pl.DataFrame(schema={c: pl.Float64 for c in PAIR_COLUMNS}).clear(), fields

    engine = engine or AblationEngine(lm, batch)
    ledger = ledger or Ledger(None)
    known = _sweep_singles(frame, head_ids)  # the sweep's own all-position effects: not run again

    def mediation_tests(pairs: list[tuple[HeadId, HeadId]]) -> list[tuple[Ablation, list[tuple[HeadId]]]]:
        """Each gather candidate at the segments, with each of its partners held at the query."""
        return [(Ablation((g,), "zero", ("segment",)), [(a,) for g2, a in pairs if g2 == g])
                for g in sorted({g for g, _ in pairs})]

    def ranking_cost(pairs: list[tuple[HeadId, HeadId]]) -> float:
        singles = sorted({h for p in pairs for h in p} - set(known))
        tests = mediation_tests(pairs)
        held = [replace(seg, hold=h) for seg, holds in tests for h in holds]
        passes = watch_passes_fe(engine, pairs)  # patterns: the aggregate candidates clean, and under each gather
        return (engine.predicted_forward_equivalents([Ablation((h,), label=str(h)) for h in singles])
                + engine.prefetch_cost(held)  # the held heads' clean values, once for every test
                + sum(engine.mediation_cost(seg, holds) - engine.prefetch_cost([replace(seg, hold=h) for h in holds])
                      for seg, holds in tests) + passes)

    reserve: dict[tuple[HeadId, HeadId], float] = {}

    def verification_reserve(pairs: list[tuple[HeadId, HeadId]]) -> float:
        """The least the verification will cost: one pair's joint ablation and its controls as the engine plans
        them, for the costliest pair it may verify first (:func:`verification_choice`: one with both G&A roles
        when any has them, else the top pair, unknown until ranked). A bound that ignored shared control
        prefixes and the candidates-only readout (51 passes from the deepest gather head) asked Gemma3-270M
        for 45 fe where its verification cost 22.4, and cut its ranking to 2 pairs."""
        first = [p for p in pairs if has_ga_roles(role_of.get(p[0]), role_of.get(p[1]))] or pairs
        for pair in first:
            if pair not in reserve:
                tests = _verify_ablations(engine, [pair], control_draws, seed)[0]
                reserve[pair] = engine.predicted_forward_equivalents(tests, logprob=False)
        return max(reserve[p] for p in first)

    allowed = ledger.allowance("pairs")
    sizes = [(n_gather, n_aggregate), *((n, n) for n in range(min(n_gather, n_aggregate) - 1, 0, -1))]
    (n_g, n_a), _, fits = fit(sizes, lambda n: ranking_cost(pairs_of(*n)) + verification_reserve(pairs_of(*n)),
                              allowed)
    candidates = pairs_of(n_g, n_a)
    gs = sorted({g for g, _ in candidates})
    as_ = sorted({a for _, a in candidates})
    run_singles = sorted((set(gs) | set(as_)) - set(known))
    singles_abl = [Ablation((h,), label=str(h)) for h in run_singles]
    measured = engine.effects(singles_abl, engine.run(singles_abl, stage_ticker(progress, "pairs: single effects",
                                                                                len(singles_abl)))
                              ).logit_diff.double().mean(-1) if run_singles else torch.empty(0)
    single = {**known, **{h: float(measured[i]) for i, h in enumerate(run_singles)}}
    # the mediation test: each gather head at the segments, alone and with each partner held at the query
    partners = {g: [a for g2, a in candidates if g2 == g] for g in gs}
    tick = stage_ticker(progress, "pairs: mediation", len(gs))
    tests = mediation_tests(candidates)
    engine.prefetch([replace(seg, hold=h) for seg, holds in tests for h in holds])  # one pass for every test
    mediation = {}
    for seg, holds in tests:
        mediation[seg.heads[0]] = engine.mediation(seg, holds)
        tick(1)
    held_cost = {(g, a): held for g in gs for a, held in zip(partners[g], mediation[g][1])}
    min_cost = MIN_MEDIATED_COST * abs(float(engine.clean.logit_diff.mean()))
    ranking_note = {"gather": len(gs), "aggregate": len(as_), "pairs": len(candidates), "fits": fits}

    tick = stage_ticker(progress, "pairs: patterns under ablation", 1 + len(gs))
    clean_agg = aggregate_metrics_under(lm, batch, None, as_, engine=engine)
    tick(1)
    under = {}
    for g in gs:
        under[g] = aggregate_metrics_under(lm, batch, g, partners[g], engine=engine)
        tick(1)

    rows = []
    for i, (g, a) in enumerate(candidates):
        d_g, d_a = single[g], single[a]
        mediated = mediated_share(mediation[g][0], held_cost[(g, a)], min_cost)
        mediated = None if mediated is None else float(min(1.0, max(0.0, mediated)))
        sel_c, foc_c = selection(clean_agg[a]), clean_agg[a]["agg_focus"]
        sel_u, foc_u = selection(under[g][a]), under[g][a]["agg_focus"]
        sel_drop, foc_drop = _relative_drop(sel_c, sel_u), _relative_drop(foc_c, foc_u)
        interaction = max(x for x in (sel_drop, foc_drop, mediated, 0.0) if x is not None)
        score = role_weight(g, 0) * role_weight(a, 1) * (0.4 + 0.6 * interaction)
        rows.append({
            "task": task, "gather_layer": g.layer, "gather_head": g.index, "gather_kind": g.kind,
            "aggregate_layer": a.layer, "aggregate_head": a.index, "aggregate_kind": a.kind,
            "p_gather": prob[g][0], "p_aggregate": prob[a][1],
            "gather_role": role_of.get(g), "aggregate_role": role_of.get(a),
            "select_clean": _nan_to_none(sel_c), "select_ablated": _nan_to_none(sel_u), "select_drop": sel_drop,
            "focus_clean": _nan_to_none(foc_c), "focus_ablated": _nan_to_none(foc_u), "focus_drop": foc_drop,
            "effect_gather": d_g, "effect_aggregate": d_a, "mediated": mediated, "score": float(score),
            "_pair": i,
        })
    rows = spread_by_gather(rows, lambda r: (r["gather_layer"], r["gather_head"], r["gather_kind"]),
                            lambda r: r["score"])
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
    ledger.charge("pairs (ranking)", allowed, ranking_cost(candidates), **ranking_note)
    # verification keeps its controls (they are the test's statistics); the budget verifies fewer top pairs
    chosen = verification_choice(rows, k)
    allowed = ledger.allowance("pairs")
    n_top, cost, fits = fit(list(range(len(chosen), 0, -1)), lambda n: engine.predicted_forward_equivalents(
        _verify_ablations(engine, [candidates[r["_pair"]] for r in chosen[:n]], control_draws, seed)[0],
        logprob=False), allowed)
    ledger.charge("pairs (verification)", allowed, cost, pairs=n_top, of=len(chosen), controls=control_draws,
                  fits=fits)
    _verify(engine, chosen[:n_top], candidates, control_draws, bootstrap, seed, progress)
    for r in rows:
        r.pop("_pair")
    table = pl.DataFrame(rows, infer_schema_length=None)
    table = table.select([c for c in PAIR_COLUMNS if c in table.columns])
    fields["top_pairs"] = [_pair_summary(r) for r in rows[:k]]
    return table, fields


def verification_choice(rows: Sequence[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The ranked pairs whose joint ablation is tested, best first: the top ``k`` whose two heads have
    their G&A roles by the evidence stage (:func:`~discovery.rank.verdict.has_ga_roles`; only such a pair
    can enter the verdict as G&A), or, when none has, the top pair alone (the verdict says whether it
    beats the controls as important heads). Without the evidence stage's roles, the top ``k``. On
    Gemma3-270M two of the three top pairs joined an ``other_important`` gather head to the aggregate
    head: their controls cost two thirds of the verification and could not change the verdict."""
    if not any(r.get("gather_role") is not None or r.get("aggregate_role") is not None for r in rows):
        return list(rows[:k])
    eligible = [r for r in rows if has_ga_roles(r.get("gather_role"), r.get("aggregate_role"))]
    return eligible[:k] if eligible else list(rows[:1])


def control_pool(inv: Any, g: HeadId, a: HeadId, draws: int, seed: int = 0
                 ) -> tuple[list[tuple[HeadId, HeadId]], int]:
    """The control pairs for pair ``g`` → ``a`` and how far (in layers) the pool was widened: pairs (x, y) of
    the same kinds, x's layer before y's, neither head ``g`` or ``a``; first from the pair's own layers, then,
    while fewer than ``MIN_CONTROLS`` exist, from layers within ±1, ±2, ... of each. At most ``draws``,
    nearest distance first, each distance's pairs in a seeded random order that is the same for every tested
    pair (:func:`_control_order`): two pairs from the same layers share most of their controls, and the engine
    runs a shared control once."""
    def heads(layer: int, kind: str) -> list[HeadId]:
        if not 0 <= layer < inv.n_layers:
            return []
        try:
            return inv.group(layer, kind).heads()
        except KeyError:  # a hybrid's layer without heads of this kind
            return []

    chosen: list[tuple[HeadId, HeadId]] = []
    seen: set[tuple[int, int]] = set()
    distance = 0
    for distance in range(inv.n_layers):
        ring = []
        for lg in range(g.layer - distance, g.layer + distance + 1):
            for la in range(a.layer - distance, a.layer + distance + 1):
                if lg >= la or (lg, la) in seen:
                    continue
                seen.add((lg, la))
                ring += [(x, y) for x in heads(lg, g.kind) for y in heads(la, a.kind)
                         if x not in (g, a) and y not in (g, a)]
        ring.sort(key=lambda pair: _control_order(seed, *pair))
        chosen += ring[:max(0, draws - len(chosen))]
        if len(chosen) >= min(MIN_CONTROLS, draws):
            break
    return chosen, distance


def _control_order(seed: int, x: HeadId, y: HeadId) -> float:
    """A control pair's place in the seeded random order, from the pair alone (not the tested pair): each
    tested pair still takes a uniform random sample of its eligible controls, and the samples of neighbouring
    tested pairs coincide wherever their eligible controls do."""
    digest = hashlib.blake2b(f"{seed}:{x}:{y}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def _layers_text(distance: int) -> str:
    return "same layers" if distance == 0 else f"±{distance} layer" + ("s" if distance > 1 else "")


def _verify_ablations(engine: AblationEngine, pairs: Sequence[tuple[HeadId, HeadId]], draws: int, seed: int
                      ) -> tuple[list[Ablation], list[list[tuple[HeadId, HeadId]]], list[int]]:
    """The verification of ``pairs`` (gather, aggregate): its ablations (each pair's joint ablation, then every
    control pair), the control pools and how far each pool was widened."""
    pools, distances = [], []
    for pair in pairs:
        pool, distance = control_pool(engine.inventory, *pair, draws, seed)
        pools.append(pool)
        distances.append(distance)
    joints = [Ablation(pair, label="joint") for pair in pairs]
    return joints + [Ablation(pair, label="control") for pool in pools for pair in pool], pools, distances


def _verify(engine: AblationEngine, rows: list[dict[str, Any]], candidates: list[tuple[HeadId, HeadId]],
            draws: int, bootstrap: int, seed: int, progress: Progress | None = None) -> None:
    """Fill the joint-effect and control columns of ``rows`` (the top pairs) in place."""
    ablations, controls, distances = _verify_ablations(engine, [candidates[r["_pair"]] for r in rows], draws, seed)
    if not rows:
        return
    tick = stage_ticker(progress, "pairs: verification (joint + controls)", len(ablations))
    effects = engine.effects(ablations, engine.run(ablations, tick, logprob=False))  # reads ld and acc only
    joint, joint_acc = effects["logit_diff"][:len(rows)].double(), effects["acc"][:len(rows)].double()  # [pair, prompt]
    control_ld = effects["logit_diff"][len(rows):].double().mean(-1)  # [draw]
    start = 0
    for i, (r, pool, distance) in enumerate(zip(rows, controls, distances)):
        r["control_layers"] = _layers_text(distance)
        mean, lo, hi = bootstrap_ci(joint[i], bootstrap, seed=seed)
        r.update(joint_effect=float(mean), joint_effect_lo=float(lo), joint_effect_hi=float(hi),
                 joint_acc=float(joint_acc[i].mean()))
        values = control_ld[start:start + len(pool)].numpy()
        start += len(pool)
        if len(values) == 0:
            r.update(control_mean=None, control_q05=None, control_q95=None, control_n=0, control_p=None)
        else:
            q05, q95 = (float(v) for v in np.quantile(values, [0.05, 0.95]))
            r.update(control_mean=float(values.mean()), control_q05=q05, control_q95=q95, control_n=len(values),
                     control_p=float((1 + (values <= float(mean)).sum()) / (1 + len(values))))
        r["verified"] = verified_flag(r)


def _sweep_singles(frame: pl.DataFrame, heads: list[HeadId]) -> dict[HeadId, float]:
    """Each head's all-position zero-ablation effect as the sweep measured it (``d_ld_all``), where it did."""
    if "d_ld_all" not in frame.columns:
        return {}
    return {h: float(v) for h, v in zip(heads, frame["d_ld_all"].to_list())
            if v is not None and not math.isnan(v)}


def _role_list(heads: list[HeadId], p: np.ndarray, task: str, threshold: float = 0.5, limit: int = 20
               ) -> list[dict[str, Any]]:
    order = [i for i in np.argsort(-p, kind="stable") if p[i] >= threshold][:limit]
    return [{**heads[i].as_dict(), "p": float(p[i]), "task": task} for i in order]


def _pair_summary(r: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "task": r["task"],
        "gather": {"layer": r["gather_layer"], "head": r["gather_head"], "kind": r["gather_kind"]},
        "aggregate": {"layer": r["aggregate_layer"], "head": r["aggregate_head"], "kind": r["aggregate_kind"]},
        "score": r["score"], "p_gather": r["p_gather"], "p_aggregate": r["p_aggregate"],
        "joint_effect": r.get("joint_effect"), "joint_effect_lo": r.get("joint_effect_lo"),
        "joint_effect_hi": r.get("joint_effect_hi"), "control_effect": r.get("control_mean"),
        "control_q05": r.get("control_q05"), "control_q95": r.get("control_q95"), "control_p": r.get("control_p"),
        "control_n": r.get("control_n"), "control_layers": r.get("control_layers"),
        "verified": r.get("verified"),
        "gather_role": r.get("gather_role"), "aggregate_role": r.get("aggregate_role"),
        "confident": is_confident(r),
    }


def is_confident(r: Mapping[str, Any]) -> bool:
    """A G&A pair by the verdict's rules (:func:`discovery.rank.verdict.is_ga_pair`: verified against at
    least 19 controls at p <= 0.05, both heads G&A by the evidence standards); kept for the ``confident``
    field of ``top_pairs`` and its readers."""
    return is_ga_pair(r)


def merge_fields(per_task: Sequence[Mapping[str, Any]], k: int = 3) -> dict[str, Any]:
    """Summary fields of several tasks: pairs and role lists concatenated (each entry names its task)."""
    out: dict[str, Any] = {"top_pairs": [], "gather_heads": [], "aggregate_heads": []}
    for fields in per_task:
        for key, items in out.items():
            items.extend(fields.get(key) or [])
        if "pair_probabilities" in fields:
            out["pair_probabilities"] = fields["pair_probabilities"]
    return out


def scan_pairs(lm: Any, heads: pl.DataFrame, summary: Mapping[str, Any], k: int = 3, *,
               evidence: pl.DataFrame | None = None, budget: tuple[str, float | None] = ("auto", None),
               progress: Progress | None = None, engines: EngineCache | None = None, **kwargs: Any
               ) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Pairs for every task of a finished scan: each task's batch rebuilt as the scan built it. With the
    evidence stage's table (``evidence.parquet``), its roles steer the candidates (see :func:`rank_pairs`).
    ``engines``: the process's engines (an earlier stage's clean pass, reused when the batch is the same)."""
    from discovery.artifacts import restore_refined, with_evidence
    from discovery.tasks import build_task
    from discovery.tasks.base import annotate

    heads = with_evidence(heads, evidence)
    restore_refined(lm.inventory, heads)

    frames, fields, budgets, skipped = [], [], {}, {}
    for task, info in (summary.get("tasks") or {}).items():
        done = ((summary.get("evidence") or {}).get(task) or {}).get("task_done")
        if done is False:  # the evidence stage found the task not done: no pair can join G&A heads
            skipped[task] = "the model does not do the task (evidence stage), so no pair was ranked or tested"
            continue
        options = dict(info.get("options") or {})
        prompts = build_task(task, options).prompts()
        max_len = getattr(lm.model.config, "max_position_embeddings", None)
        batch = annotate(prompts, lm.tokenizer, padding_side="left", max_length=max_len)
        spent = ((summary.get("evidence") or {}).get(task) or {}).get("budget")  # what the evidence stage spent
        fe = resolve_budget(*budget, [h.layer for h in lm.inventory.heads()], lm.inventory.n_layers, info)
        ledger = Ledger.from_record(spent, fe)
        memory = (summary.get("options") or {}).get("max_memory_mb")
        engine = engines.engine(task, lm, batch, max_memory_mb=memory) if engines is not None else None
        frame, f = rank_pairs(lm, batch, heads, k, summary=summary, task=task, engine=engine,
                              seed=int(options.get("seed", 0)), ledger=ledger, progress=progress, **kwargs)
        frames.append(frame)
        fields.append(f)
        budgets[task] = ledger.record()
    table = pl.concat([f for f in frames if f.height], how="diagonal_relaxed") if any(f.height for f in frames) \
        else pl.DataFrame()
    return table, {**merge_fields(fields, k), "budget": budgets, **({"pairs_skipped": skipped} if skipped else {})}
