"""Group ablations: heads that share a role by pattern, and the top-k by effect, ablated together against
random controls of the same size from the same layers; members credited by sparing them one at a time."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
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


def _budget_options(groups: Sequence[Group], n_controls: int) -> list[tuple[list[Group], int]]:
    """(groups kept, control draws) from the full test down to the smallest: fewer controls first (not under
    ``MIN_DRAWS``), then groups dropped, weak variants first, then gatherer layers, then the rest, last first."""
    draws = sorted({n_controls, *(n for n in (24, MIN_DRAWS) if n < n_controls)}, reverse=True)
    options = [(list(groups), n) for n in draws]
    order = ([g for g in groups if g.name.endswith("(weak)")][::-1]
             + [g for g in groups if g.role == "gather" and not g.name.endswith("(weak)")][::-1]
             + [g for g in groups if g.role != "gather" and not g.name.endswith("(weak)")][::-1])
    kept = list(groups)
    for g in order[:-1]:  # the last group is always tested
        kept = [x for x in kept if x is not g]
        options.append((kept, draws[-1]))
    return options


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
    with an interval above 0). With a ``ledger`` the tests fit its allowance: fewer controls, then fewer groups,
    then spare-one tests of fewer groups (each cut recorded in the ledger).
    """
    th = thresholds or EvidenceThresholds()
    clean_ld = float(engine.clean.logit_diff.mean())
    groups = list(groups) if groups is not None else role_groups(frame, th, clean_ld=clean_ld)
    pool = [h for h in engine.inventory.heads() if h.layer < engine.n_active_layers]

    def build(kept: Sequence[Group], n_draws: int) -> tuple[list[tuple[Group, list[tuple[HeadId, ...]]]], list[Ablation]]:
        plans, ablations = [], []
        for g in kept:
            draws = control_draws(g.heads, pool, n_draws, seed)
            plans.append((g, draws))
            ablations.append(Ablation(g.heads, "zero", g.scope, label=g.name))
            ablations += [Ablation(d, "zero", g.scope, label=f"control:{g.name}") for d in draws]
        return plans, ablations

    allowed = ledger.allowance("group ablations") if ledger is not None else None
    options = _budget_options(groups, th.n_controls)
    def cost_with_spares(option: tuple[list[Group], int]) -> float:
        """The groups and their controls, and every spare-one test they could need (the credits)."""
        plans, ablations = build(*option)
        rows = [i for i, (g, _) in enumerate(plans) if len(g.heads) >= 2]
        return engine.predicted_forward_equivalents(ablations) + engine.predicted_forward_equivalents(
            _spare_ablations(plans, rows))

    (kept, n_draws), _, fits = fit(options, cost_with_spares, allowed)
    plans, ablations = build(kept, n_draws)
    cost = engine.predicted_forward_equivalents(ablations)
    if ledger is not None:
        ledger.charge("group ablations", allowed, cost, groups=len(kept), of=len(groups), controls=n_draws,
                      untested=[g.name for g in groups if g not in kept], fits=fits)
    tick = stage_ticker(progress, "group ablations", len(ablations))
    effects = engine.effects(ablations, engine.run(ablations, progress=tick)) if ablations else None
    rows: list[dict[str, Any]] = []
    start = 0
    spare: list[tuple[int, HeadId]] = []  # (row, spared member)
    for g, draws in plans:
        ld = effects.logit_diff[start].double()  # [prompt]
        control = effects.logit_diff[start + 1:start + 1 + len(draws)].double().mean(-1)  # [draw]
        acc = float(effects.acc[start].double().mean())
        start += 1 + len(draws)
        mean, lo, hi = (float(x) for x in bootstrap_ci(ld, bootstrap, seed=seed))
        row: dict[str, Any] = {
            "group": g.name, "role": g.role, "scope": "+".join(g.scope), "heads": [str(h) for h in g.heads],
            "n": len(g.heads), "effect": mean, "effect_lo": lo, "effect_hi": hi, "d_acc": acc,
            "rel_drop": -mean / clean_ld if clean_ld > 0 else None, "control_n": len(draws),
            "control_mean": None, "control_p05": None, "control_p50": None, "control_p95": None,
            "control_p": None, "beyond_control": None, "significant": False, "marginal": None, "credited": [],
        }
        if len(draws):
            q = torch.quantile(control, torch.tensor([0.05, 0.5, 0.95, 1.0 - th.control_quantile],
                                                     dtype=control.dtype))
            row.update(control_mean=float(control.mean()), control_p05=float(q[0]), control_p50=float(q[1]),
                       control_p95=float(q[2]),
                       control_p=float((1 + (control <= mean).sum()) / (1 + len(draws))),
                       beyond_control=bool(mean < float(q[3])))
        row["significant"] = bool(row["beyond_control"] and clean_ld > 0 and -mean >= th.group * clean_ld
                                  and hi < 0)
        rows.append(row)
        if row["significant"] and len(g.heads) >= 2:
            spare += [(len(rows) - 1, h) for h in g.heads]
    if spare and ledger is not None:  # the spare-one tests of as many significant groups as the budget leaves
        allowed = ledger.allowance("group ablations")
        cost_of = lambda some: engine.predicted_forward_equivalents(_spare_ablations(plans, some))
        rows_with = sorted({r for r, _ in spare})
        keep, cost, fits = fit([rows_with[:n] for n in range(len(rows_with), -1, -1)], cost_of, allowed)
        ledger.charge("group ablations (spare one)", allowed, cost, groups=len(keep), of=len(rows_with), fits=fits)
        spare = [(r, h) for r, h in spare if r in set(keep)]
    if spare:
        spare_abl = _spare_ablations(plans, None, spare)
        tick = stage_ticker(progress, "group ablations (spare one)", len(spare_abl))
        spared = engine.effects(spare_abl, engine.run(spare_abl, progress=tick)).logit_diff.double()  # [spare, prompt]
        for j, (r, h) in enumerate(spare):
            g_start = sum(1 + len(d) for _, d in plans[:r])
            joint = effects.logit_diff[g_start].double()  # [prompt]
            m, lo, _ = (float(x) for x in bootstrap_ci(spared[j] - joint, bootstrap, seed=seed))
            row = rows[r]
            row["marginal"] = (row["marginal"] or []) + [m]
            if m >= th.noise * clean_ld and lo > 0:
                row["credited"] = row["credited"] + [str(h)]
    schema = {"marginal": pl.List(pl.Float64), "credited": pl.List(pl.Utf8), "heads": pl.List(pl.Utf8),
              "control_mean": pl.Float64, "control_p05": pl.Float64, "control_p50": pl.Float64,
              "control_p95": pl.Float64, "control_p": pl.Float64, "beyond_control": pl.Boolean,
              "rel_drop": pl.Float64}
    if not rows:
        return pl.DataFrame(schema=schema)
    return pl.DataFrame(rows, schema_overrides=schema, infer_schema_length=None)
