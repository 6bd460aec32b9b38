"""Group ablations: heads that share a role by pattern, and the top-k by effect, ablated together against
random controls of the same size from the same layers; members credited by sparing them one at a time."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import polars as pl
import torch

from discovery.evidence.budget import MIN_DRAWS, Ledger, fit
from discovery.evidence.common import _heads_of, _num
from discovery.evidence.thresholds import EvidenceThresholds
from discovery.heads import HeadId
from discovery.measure.ablation import Ablation, AblationEngine, Progress, stage_ticker
from discovery.measure.metrics import SELECTION_METRICS
from discovery.stats import bootstrap_ci


@dataclass
class Group:
    """Heads ablated together, why, and where."""

    name: str
    role: str  # aggregate | gather | top
    heads: tuple[HeadId, ...]
    scope: tuple[str, ...]


def _flag(frame: pl.DataFrame, column: str, threshold: float) -> list[bool]:
    if column not in frame.columns:
        return [False] * frame.height
    return [v is not None and not math.isnan(v) and v >= threshold for v in frame[column].to_list()]


def _significant_single(frame: pl.DataFrame, column: str, clean_ld: float, fraction: float) -> list[bool]:
    """Per row: the single-head drop in ``column`` is >= fraction * clean_ld with its interval below 0."""
    if column not in frame.columns:
        return [False] * frame.height
    out = []
    for mean, hi in zip(frame[column].to_list(), frame[f"{column}_hi"].to_list()):
        mean, hi = _num(mean), _num(hi)
        out.append(mean is not None and hi is not None and hi < 0 and -mean >= fraction * clean_ld)
    return out


def role_groups(frame: pl.DataFrame, thresholds: EvidenceThresholds | None = None, *,
                clean_ld: float | None = None) -> list[Group]:
    """The groups to test: every selective head (all positions, and the query alone), the gatherers of
    each layer (segment positions), the top-k heads by single-head drop (all positions), and, when a
    role group mixes individually important heads with weak ones, the weak members alone."""
    th = thresholds or EvidenceThresholds()
    heads = _heads_of(frame)
    selective = [h for h, *flags in zip(heads, _flag(frame, "selectivity", th.selectivity),
                                        *(_flag(frame, name, th.agg_select) for name in SELECTION_METRICS))
                 if any(flags)]
    groups: list[Group] = []
    strong: dict[str, set[HeadId]] = {}
    if clean_ld is not None and clean_ld > 0:
        for scope in ("all", "query", "segment"):
            flags = _significant_single(frame, f"d_ld_{scope}", clean_ld, th.effect)
            strong[scope] = {h for h, f in zip(heads, flags) if f}

    def add(name: str, role: str, members: Sequence[HeadId], scope: tuple[str, ...]) -> None:
        if not members:
            return
        groups.append(Group(name, role, tuple(sorted(members)), scope))
        weak = [h for h in members if h not in strong.get(scope[0], set())]
        if 2 <= len(weak) < len(members):
            groups.append(Group(f"{name} (weak)", role, tuple(sorted(weak)), scope))

    add("selective", "aggregate", selective, ("all",))
    add("selective@query", "aggregate", selective, ("query",))
    gatherers = [h for h, f in zip(heads, _flag(frame, "gather_score", th.gather_score)) if f]
    layers = sorted({h.layer for h in gatherers})
    if th.max_gather_groups is not None and len(layers) > th.max_gather_groups:
        drop = dict(zip(heads, (-(_num(v) or 0.0) for v in frame["d_ld_segment"].to_list()))) \
            if "d_ld_segment" in frame.columns else {}
        weight = {layer: sum(drop.get(h, 0.0) for h in gatherers if h.layer == layer) for layer in layers}
        layers = sorted(sorted(layers, key=lambda layer: -weight[layer])[:th.max_gather_groups])
    for layer in layers:
        add(f"gatherers L{layer}", "gather", [h for h in gatherers if h.layer == layer], ("segment",))
    if "d_ld_all" in frame.columns:
        effect = [(_num(v), h) for v, h in zip(frame["d_ld_all"].to_list(), heads)]
        ranked = [h for v, h in sorted((e for e in effect if e[0] is not None), key=lambda e: e[0])]
        if ranked:
            groups.append(Group(f"top{th.top_k}", "top", tuple(sorted(ranked[:th.top_k])), ("all",)))
    return groups


def control_draws(group: Sequence[HeadId], pool: Sequence[HeadId], n: int, seed: int = 0) -> list[tuple[HeadId, ...]]:
    """Up to ``n`` distinct random head sets of the group's size and per-layer make-up, drawn from
    ``pool`` minus the group (a layer short of heads lends from the group's other layers, then from
    anywhere). Deterministic for ``seed`` and the group."""
    members = set(group)
    rest = [h for h in pool if h not in members]
    if not rest:
        return []
    need: dict[int, int] = {}
    for h in group:
        need[h.layer] = need.get(h.layer, 0) + 1
    by_layer: dict[int, list[HeadId]] = {}
    for h in rest:
        by_layer.setdefault(h.layer, []).append(h)
    size = min(len(group), len(rest))
    rng = random.Random(f"{seed}:" + ",".join(map(str, sorted(group))))
    seen: set[tuple[HeadId, ...]] = set()
    draws: list[tuple[HeadId, ...]] = []
    for _ in range(n * 20):
        if len(draws) >= n:
            break
        chosen: list[HeadId] = []
        for layer, count in sorted(need.items()):
            options = by_layer.get(layer, [])
            chosen += rng.sample(options, min(count, len(options)))
        near = [h for h in rest if h.layer in need and h not in chosen]
        far = [h for h in rest if h.layer not in need]
        for source in (near, far):
            short = size - len(chosen)
            if short > 0 and source:
                chosen += rng.sample(source, min(short, len(source)))
        key = tuple(sorted(chosen))
        if key not in seen:
            seen.add(key)
            draws.append(key)
    return draws


def _drop_order(groups: Sequence[Group]) -> list[Group]:
    """The order a budget drops groups in: weak variants first, then gatherer layers, then the rest, last
    first (the last of all is never dropped)."""
    return ([g for g in groups if g.name.endswith("(weak)")][::-1]
            + [g for g in groups if g.role == "gather" and not g.name.endswith("(weak)")][::-1]
            + [g for g in groups if g.role != "gather" and not g.name.endswith("(weak)")][::-1])


def _kept_options(groups: Sequence[Group]) -> list[list[Group]]:
    """Every group, then fewer, dropped in :func:`_drop_order` down to one."""
    options, kept = [list(groups)], list(groups)
    for g in _drop_order(groups)[:-1]:
        kept = [x for x in kept if x is not g]
        options.append(kept)
    return options


def _budget_options(groups: Sequence[Group], n_controls: int) -> list[tuple[list[Group], int]]:
    """(groups kept, control draws) from the full test down to the smallest: fewer controls first (not under
    ``MIN_DRAWS``), then groups dropped (:func:`_drop_order`)."""
    draws = sorted({n_controls, *(n for n in (24, MIN_DRAWS) if n < n_controls)}, reverse=True)
    return [(list(groups), n) for n in draws] + [(kept, draws[-1]) for kept in _kept_options(groups)[1:]]


def strong_enough(mean: float, hi: float, clean_ld: float, th: EvidenceThresholds) -> bool:
    """The part of a group's significance its controls cannot change: the joint drop is at least ``th.group``
    of the clean logit difference with its interval below 0. A group failing it is not significant whatever
    its controls show, so its controls are not drawn."""
    return clean_ld > 0 and -mean >= th.group * clean_ld and hi < 0


def _spare_ablations(plans: Sequence[tuple[Group, Sequence[tuple[HeadId, ...]]]], rows: Sequence[int] | None,
                     spare: Sequence[tuple[int, HeadId]] | None = None) -> list[Ablation]:
    """The spare-one ablations: each significant group with one member left out (``spare`` pairs, or every
    member of the groups ``rows``)."""
    pairs = spare if spare is not None else [(r, h) for r in rows or [] for h in plans[r][0].heads]
    out = []
    for r, h in pairs:
        g = plans[r][0]
        out.append(Ablation(tuple(x for x in g.heads if x != h), "zero", g.scope, label=f"spare:{h}"))
    return out


def group_ablations(engine: AblationEngine, frame: pl.DataFrame, thresholds: EvidenceThresholds | None = None, *,
                    groups: Sequence[Group] | None = None, bootstrap: int = 1000, seed: int = 0,
                    progress: Progress | None = None, ledger: Ledger | None = None) -> pl.DataFrame:
    """Each group's joint effect against random controls, and which members it needs.

    One row per group: ``group, role, scope, heads`` (names), ``n``, the joint effect ``effect`` (logit
    difference) with ``effect_lo/_hi`` and ``d_acc``, ``rel_drop`` (drop / clean logit difference), the
    controls' ``control_n, control_mean, control_p05, control_p50, control_p95`` (drops are minus these),
    ``control_p`` = (1 + #controls at least as harmful) / (1 + #controls), ``beyond_control``,
    ``significant`` (large, beyond the controls' quantile, interval below 0), and for significant groups
    of two or more heads the spare-one test: ``marginal`` (per member: the drop lost when that member
    alone is spared, in logit difference) and ``credited`` (members whose marginal is >= noise * clean
    with an interval above 0).

    The joint ablations run first; controls are drawn only for the groups :func:`strong_enough` (the others
    cannot be significant: ``controls_drawn`` false, control columns null), so the decisions equal those of
    drawing controls for every group at a fraction of the cost. With a ``ledger`` the tests fit its allowance:
    fewer groups' joint ablations if even those do not fit, then fewer controls, then fewer groups' controls,
    then spare-one tests of fewer groups (each cut recorded in the ledger; a group whose controls were cut is
    left out of the table, untested).
    """
    th = thresholds or EvidenceThresholds()
    clean_ld = float(engine.clean.logit_diff.mean())
    groups = list(groups) if groups is not None else role_groups(frame, th, clean_ld=clean_ld)
    pool = [h for h in engine.inventory.heads() if h.layer < engine.n_active_layers]
    joint_of = {g.name: Ablation(g.heads, "zero", g.scope, label=g.name) for g in groups}
    # every test here reads the logit difference (and the joint ablations accuracy): candidates-only readout
    predicted = partial(engine.predicted_forward_equivalents, logprob=False)
    run = partial(engine.run, logprob=False)

    # 1. every group's joint ablation (fewer groups only if even these do not fit)
    allowed = ledger.allowance("group ablations") if ledger is not None else None
    tested, cost, fits = fit(_kept_options(groups), lambda kept: predicted([joint_of[g.name] for g in kept]), allowed)
    if ledger is not None:
        ledger.charge("group ablations (joint)", allowed, cost, groups=len(tested), of=len(groups),
                      untested=[g.name for g in groups if g not in tested], fits=fits)
    joints = [joint_of[g.name] for g in tested]
    tick = stage_ticker(progress, "group ablations (joint)", len(joints))
    effects = engine.effects(joints, run(joints, progress=tick)) if joints else None
    rows: dict[str, dict[str, Any]] = {}
    joint_ld: dict[str, torch.Tensor] = {}
    for i, g in enumerate(tested):
        joint_ld[g.name] = effects.logit_diff[i].double()  # [prompt]
        mean, lo, hi = (float(x) for x in bootstrap_ci(joint_ld[g.name], bootstrap, seed=seed))
        rows[g.name] = {
            "group": g.name, "role": g.role, "scope": "+".join(g.scope), "heads": [str(h) for h in g.heads],
            "n": len(g.heads), "effect": mean, "effect_lo": lo, "effect_hi": hi,
            "d_acc": float(effects.acc[i].double().mean()),
            "rel_drop": -mean / clean_ld if clean_ld > 0 else None, "controls_drawn": False, "control_n": 0,
            "control_mean": None, "control_p05": None, "control_p50": None, "control_p95": None,
            "control_p": None, "beyond_control": None, "significant": False, "marginal": None, "credited": [],
        }

    # 2. controls for the groups whose joint drop could be significant, and the spare-one tests they may need
    strong = [g for g in tested if strong_enough(rows[g.name]["effect"], rows[g.name]["effect_hi"], clean_ld, th)]

    def build(kept: Sequence[Group], n_draws: int) -> tuple[list[tuple[Group, list[tuple[HeadId, ...]]]], list[Ablation]]:
        plans, ablations = [], []
        for g in kept:
            draws = control_draws(g.heads, pool, n_draws, seed)
            plans.append((g, draws))
            ablations += [Ablation(d, "zero", g.scope, label=f"control:{g.name}") for d in draws]
        return plans, ablations

    def cost_with_spares(option: tuple[list[Group], int]) -> float:
        plans, ablations = build(*option)
        return predicted(ablations) + predicted(_spare_ablations(plans, [i for i, (g, _) in enumerate(plans)
                                                                           if len(g.heads) >= 2]))

    plans: list[tuple[Group, list[tuple[HeadId, ...]]]] = []
    if strong:
        allowed = ledger.allowance("group ablations") if ledger is not None else None
        (kept, n_draws), _, fits = fit(_budget_options(strong, th.n_controls), cost_with_spares, allowed)
        plans, ablations = build(kept, n_draws)
        if ledger is not None:
            ledger.charge("group ablations (controls)", allowed, predicted(ablations), groups=len(kept),
                          of=len(strong), controls=n_draws, untested=[g.name for g in strong if g not in kept],
                          fits=fits)
        for g in strong:  # a strong group whose controls the budget cut is untested
            if g not in kept:
                del rows[g.name]
        tick = stage_ticker(progress, "group ablations (controls)", len(ablations))
        control_ld = engine.effects(ablations, run(ablations, progress=tick)).logit_diff.double().mean(-1) \
            if ablations else torch.zeros(0, dtype=torch.float64)  # [draw]
        start = 0
        for g, draws in plans:
            control = control_ld[start:start + len(draws)]
            start += len(draws)
            row = rows[g.name]
            row["controls_drawn"] = True
            if len(draws):
                mean = row["effect"]
                q = torch.quantile(control, torch.tensor([0.05, 0.5, 0.95, 1.0 - th.control_quantile],
                                                         dtype=control.dtype))
                row.update(control_n=len(draws), control_mean=float(control.mean()), control_p05=float(q[0]),
                           control_p50=float(q[1]), control_p95=float(q[2]),
                           control_p=float((1 + (control <= mean).sum()) / (1 + len(draws))),
                           beyond_control=bool(mean < float(q[3])))
            row["significant"] = bool(row["beyond_control"])  # strong_enough holds for every planned group

    # 3. which members a significant group needs: spare each one
    spare = [(r, h) for r, (g, _) in enumerate(plans) if rows[g.name]["significant"] and len(g.heads) >= 2
             for h in g.heads]  # (plan, spared member)
    if spare and ledger is not None:  # the spare-one tests of as many significant groups as the budget leaves
        allowed = ledger.allowance("group ablations")
        cost_of = lambda some: predicted(_spare_ablations(plans, some))
        with_spares = sorted({r for r, _ in spare})
        keep, cost, fits = fit([with_spares[:n] for n in range(len(with_spares), -1, -1)], cost_of, allowed)
        ledger.charge("group ablations (spare one)", allowed, cost, groups=len(keep), of=len(with_spares), fits=fits)
        spare = [(r, h) for r, h in spare if r in set(keep)]
    if spare:
        spare_abl = _spare_ablations(plans, None, spare)
        tick = stage_ticker(progress, "group ablations (spare one)", len(spare_abl))
        spared = engine.effects(spare_abl, run(spare_abl, progress=tick)).logit_diff.double()  # [spare, prompt]
        for j, (r, h) in enumerate(spare):
            g = plans[r][0]
            m, lo, _ = (float(x) for x in bootstrap_ci(spared[j] - joint_ld[g.name], bootstrap, seed=seed))
            row = rows[g.name]
            row["marginal"] = (row["marginal"] or []) + [m]
            if m >= th.noise * clean_ld and lo > 0:
                row["credited"] = row["credited"] + [str(h)]
    schema = {"marginal": pl.List(pl.Float64), "credited": pl.List(pl.Utf8), "heads": pl.List(pl.Utf8),
              "control_mean": pl.Float64, "control_p05": pl.Float64, "control_p50": pl.Float64,
              "control_p95": pl.Float64, "control_p": pl.Float64, "beyond_control": pl.Boolean,
              "rel_drop": pl.Float64, "d_acc": pl.Float64, "controls_drawn": pl.Boolean}
    ordered = [rows[g.name] for g in groups if g.name in rows]
    if not ordered:
        return pl.DataFrame(schema=schema)
    return pl.DataFrame(ordered, schema_overrides=schema, infer_schema_length=None)
