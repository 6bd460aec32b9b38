"""Ground truth for a model small enough to ablate exhaustively (the toy models, planted circuits).

Every head is zero-ablated alone, at all positions, at the query position only and at the segment
positions only; its pattern metrics are computed; and every candidate gather→aggregate pair is put
through the interaction test (ablate the gather head at the segment positions, watch the aggregate
head). The rules are deliberately simple and written down, so the truth does not depend on the
classifier it is used to train and test:

- a head *breaks the task* when ablating it everywhere costs at least ``break_fraction`` of the clean
  logit difference (or ``break_acc`` accuracy);
- it *aggregates* when it breaks the task, its effect lives at the query position (at least half the
  break threshold there) and its query selects the gold segment: its ``selection``, the larger of
  ``agg_select`` (the gold option's own tokens get the most weight) and ``agg_after`` (the query row's
  mass on the two tokens right after the gold option), reaches ``agg_select``. ``agg_after`` counts
  because an SSM head can only read a finished option where the state already holds it: the width-2
  Mamba-2 toy's query heads put 0.93 of their row there and 0.12 on the option itself;
- heads that share that work redundantly (a toy with several heads copying the gold label) each fall
  short of the break threshold, so they are tested as a *set*: every head that attends selectively,
  costs at least ``set_fraction`` of the clean logit difference at the query on its own and is not an
  aggregate head by the rule above is ablated together at the query position; if that joint ablation
  breaks the task, each of them aggregates (``aggregate_set`` records the set and its joint effect);
- it *gathers* when it breaks the task, its effect lives at the segment positions, its summary tokens
  attend within their own segment (``gather_score``), and a later aggregate head depends on it (the
  pair is then *confirmed*): with the gather head ablated at the segment positions, the aggregate
  head's selection falls by ``interaction_drop`` (it no longer finds the gold option), or holding
  the aggregate head at its clean output at the query gives back at least ``mediation`` of the
  gather head's cost (what it reads is what the gather head wrote: the mediated share,
  ``1 - effect with the aggregate held / effect``). In the width-2 Mamba-2 toy the gather head
  changes what the query heads read, not where (another head steers that), so only the second test
  sees the pair. Heads labelled aggregate as a redundant *set* are tested as a set here too, since
  each alone mediates little when the others carry the same label (the transformer toy's seven: 0.02 to
  0.19 each, 0.87 together): holding the set's members that come after the gather head at once must
  give back at least ``mediation`` (``set_mediated``), and then each of them pairs with it.
  ``joint_mediation`` records, per gather candidate, the share given back by holding every later
  aggregate head at once and by holding the later set members at once.

``pattern_margin`` compares each role's weakest head on its defining metric (``selection``,
``gather_score``) with the strongest other head whose ablation costs at least ``set_fraction``.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from discovery.heads import HeadId
from discovery.measure.ablation import Ablation, AblationEngine, mediated_share, single_head_ablations
from discovery.measure.metrics import selection
from discovery.measure.patterns import pattern_metric_values
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch


@dataclass(frozen=True)
class TruthRules:
    """Thresholds of the ground-truth labels (see the module docstring)."""

    break_fraction: float = 0.2
    break_acc: float = 0.1
    agg_select: float = 0.5
    gather_score: float = 0.3
    interaction_drop: float = 0.2
    mediation: float = 0.25
    set_fraction: float = 0.02


def _metric_table(lm: LoadedModel, batch: AnnotatedBatch, edits_for=None, layers=None) -> dict[HeadId, dict[str, float]]:
    from discovery.measure import metrics

    values = pattern_metric_values(lm, batch, layers=layers, edits_for=edits_for)
    out: dict[HeadId, dict[str, float]] = {}
    for (layer, kind), named in values.items():
        for name, means in metrics.summarise(named).items():
            for index, value in enumerate(means.tolist()):
                out.setdefault(HeadId(layer, index, kind), {})[name] = value
    return out


def ground_truth(lm: LoadedModel, batch: AnnotatedBatch, rules: TruthRules = TruthRules()) -> dict[str, Any]:
    """Exhaustive single-head evidence and the labels it implies (JSON-ready)."""
    engine = AblationEngine(lm, batch)
    heads = lm.inventory.heads()
    clean_ld = float(engine.clean.logit_diff.mean())
    clean_acc = float(engine.clean.acc.mean())
    effects: dict[str, dict[str, torch.Tensor]] = {}
    for scope in ("all", "query", "segment"):
        eff = engine.effects(single_head_ablations(heads, "zero", (scope,)))
        effects[scope] = {"ld": eff.logit_diff.mean(1), "acc": eff.acc.mean(1)}
    pattern = _metric_table(lm, batch)
    threshold = rules.break_fraction * abs(clean_ld)
    rows = []
    for i, h in enumerate(heads):
        m = pattern.get(h, {})
        row = {"layer": h.layer, "head": h.index, "kind": h.kind,
               **{f"d_ld_{s}": float(effects[s]["ld"][i]) for s in effects},
               **{f"d_acc_{s}": float(effects[s]["acc"][i]) for s in effects},
               **{k: (None if math.isnan(v) else float(v)) for k, v in m.items()}}
        breaks = row["d_ld_all"] <= -threshold or row["d_acc_all"] <= -rules.break_acc
        row["selection"] = selection(row)
        row["breaks_task"] = bool(breaks)
        row["aggregate_set_member"] = False
        row["aggregate"] = bool(breaks and row["d_ld_query"] <= -threshold / 2
                                and row["selection"] >= rules.agg_select)
        row["gather_candidate"] = bool(breaks and row["d_ld_segment"] <= -threshold / 2
                                       and (row.get("gather_score") or 0.0) >= rules.gather_score)
        rows.append(row)
    aggregate_set = _redundant_aggregates(engine, heads, rows, clean_ld, threshold, rules)
    aggregates = [HeadId(r["layer"], r["head"], r["kind"]) for r in rows if r["aggregate"]]
    set_members = {HeadId(r["layer"], r["head"], r["kind"]) for r in rows if r["aggregate"] and r["aggregate_set_member"]}
    pairs, joint_mediation = [], []
    for r in rows:
        if not r["gather_candidate"]:
            continue
        g = HeadId(r["layer"], r["head"], r["kind"])
        later = [a for a in aggregates if a.layer > g.layer]
        if not later:
            continue
        without = Ablation((g,), "zero", ("segment",))
        under = _metric_table(lm, batch, layers=sorted({a.layer for a in later}),
                              edits_for=lambda rows, without=without: engine.plan([without], rows))
        # the gather head's cost with every later aggregate head held clean at the query, then with each
        # alone, then with the later members of the redundant aggregate set held together (if two or more)
        set_later = [a for a in later if a in set_members]
        set_holds = [set_later] if len(set_later) >= 2 else []
        cost, (all_held, *rest) = engine.mediation(without, [later, *((a,) for a in later), *set_holds])
        held_alone = rest[:len(later)]
        set_mediated = mediated_share(cost, rest[len(later)]) if set_holds else None
        joint_mediation.append({"gather": g.as_dict(), "aggregates": [a.as_dict() for a in later],
                                "effect_gather": cost, "effect_gather_with_aggregates_held": all_held,
                                "mediated": mediated_share(cost, all_held),
                                "set": [a.as_dict() for a in set_later] if set_mediated is not None else None,
                                "set_mediated": set_mediated})
        for a, held in zip(later, held_alone):
            before, after = selection(pattern[a]), selection(under[a])
            mediated = mediated_share(cost, held)
            through_set = set_mediated if a in set_later else None
            pairs.append({"gather": g.as_dict(), "aggregate": a.as_dict(), "selection_clean": before,
                          "selection_without_gather": after, "effect_gather": cost,
                          "effect_gather_with_aggregate_held": held, "mediated": mediated,
                          "set_mediated": through_set,
                          "confirmed": bool(before - after >= rules.interaction_drop
                                            or (mediated is not None and mediated >= rules.mediation)
                                            or (through_set is not None and through_set >= rules.mediation))})
    confirmed = {(p["gather"]["layer"], p["gather"]["head"], p["gather"]["kind"]) for p in pairs if p["confirmed"]}
    for r in rows:
        r["gather"] = bool(r["gather_candidate"] and (r["layer"], r["head"], r["kind"]) in confirmed)
        r["role"] = "aggregate" if r["aggregate"] else "gather" if r["gather"] else (
            "other_important" if r["breaks_task"] else "none")
    labelled = [r for r in rows if r["role"] in ("gather", "aggregate")]
    others = [r for r in rows if r["role"] not in ("gather", "aggregate")]
    weakest = max((r["d_ld_all"] for r in labelled), default=None)  # least negative effect among G&A heads
    strongest_other = min((r["d_ld_all"] for r in others), default=None)
    # heads whose ablation costs at least set_fraction anywhere: the ones a pattern margin is taken against
    matter = [r for r in rows if r["d_ld_all"] <= -rules.set_fraction * abs(clean_ld)]
    return {
        "clean": {"acc": clean_acc, "logit_diff": clean_ld, "n_prompts": len(batch)},
        "rules": asdict(rules),
        "gather": [{"layer": r["layer"], "head": r["head"], "kind": r["kind"]} for r in rows if r["role"] == "gather"],
        "aggregate": [{"layer": r["layer"], "head": r["head"], "kind": r["kind"]} for r in rows if r["role"] == "aggregate"],
        "pairs": pairs,
        "joint_mediation": joint_mediation,
        "margin": None if weakest is None or strongest_other is None else {
            "weakest_ga_effect": weakest, "strongest_other_effect": strongest_other,
            "ratio": (weakest / strongest_other) if strongest_other < 0 else None},
        "pattern_margin": {
            "aggregate": _pattern_margin(rows, matter, "aggregate", "selection"),
            "gather": _pattern_margin(rows, matter, "gather", "gather_score"),
        },
        "aggregate_set": aggregate_set,
        "heads": rows,
    }


def _redundant_aggregates(engine: AblationEngine, heads: list[HeadId], rows: list[dict[str, Any]], clean_ld: float,
                          threshold: float, rules: TruthRules) -> dict[str, Any] | None:
    """The joint query-position test of selective heads that each fall short of breaking the task.

    Marks the set's rows ``aggregate`` when ablating them together breaks the task; returns the set
    and its joint effect (None when there are fewer than two such heads).
    """
    members = [i for i, r in enumerate(rows)
               if not r["aggregate"] and r["selection"] >= rules.agg_select
               and r["d_ld_query"] <= -rules.set_fraction * abs(clean_ld)]
    if len(members) < 2:
        return None
    joint = engine.effects([Ablation(tuple(heads[i] for i in members), "zero", ("query",))])
    joint_ld, joint_acc = float(joint.logit_diff.mean()), float(joint.acc.mean())
    breaks = joint_ld <= -threshold or joint_acc <= -rules.break_acc
    for i in members:
        rows[i]["aggregate"] = breaks
        rows[i]["aggregate_set_member"] = True
    return {"heads": [heads[i].as_dict() for i in members], "d_ld_query_joint": joint_ld,
            "d_acc_query_joint": joint_acc, "breaks_task": bool(breaks)}


def _pattern_margin(rows: list[dict[str, Any]], matter: list[dict[str, Any]], role: str,
                    metric: str) -> dict[str, Any] | None:
    """The role's defining pattern metric: its weakest labelled head against the strongest other head
    among those whose ablation matters (None when the role is empty)."""
    labelled = [r.get(metric) or 0.0 for r in rows if r["role"] == role]
    if not labelled:
        return None
    others = [r.get(metric) or 0.0 for r in matter if r["role"] != role]
    strongest = max(others, default=None)
    return {"metric": metric, "weakest_labelled": min(labelled), "strongest_other": strongest,
            "difference": None if strongest is None else min(labelled) - strongest}


def channel_view(lm: LoadedModel) -> LoadedModel:
    """The same model with every Mamba-1 channel its own head (group width 1)."""
    from dataclasses import replace

    from discovery.model.adapter import adapter_for

    return replace(lm, adapter=adapter_for(lm.model, 1))


def channel_truth(lm: LoadedModel, batch: AnnotatedBatch, *, scopes: tuple[str, ...] = ("all", "query"),
                  effect: float = 0.1) -> dict[str, Any]:
    """Exhaustive channel-level truth of a (small) Mamba-1 model: every channel of every Mamba-1 layer
    zero-ablated alone at each of ``scopes`` (batched through the engine), and each channel's implicit-
    attention pattern metrics. ``important``: the channels whose drop at the first scope is at least
    ``effect`` of the clean logit difference (the evidence stage's threshold), largest first; ``cost``:
    the sweep's forward-equivalents (layer-rows recomputed / (prompts x layers))."""
    from discovery.measure import metrics

    view = channel_view(lm)
    engine = AblationEngine(view, batch)
    clean_ld = float(engine.clean.logit_diff.mean())
    groups = [g for g in view.inventory.groups if g.pattern == "mamba1"]
    channels = [h for g in groups for h in g.heads()]
    rows = [{"layer": h.layer, "channel": h.index} for h in channels]
    before = engine.layer_rows
    for scope in scopes:
        eff = engine.effects(single_head_ablations(channels, "zero", (scope,)))
        for row, ld, acc in zip(rows, eff.logit_diff.mean(1).tolist(), eff.acc.mean(1).tolist()):
            row[f"d_ld_{scope}"], row[f"d_acc_{scope}"] = ld, acc
    cost = (engine.layer_rows - before) / (engine.n_prompts * engine.n_active_layers)
    values = pattern_metric_values(view, batch, layers=sorted({g.layer for g in groups}), kinds=["ssm"])
    for (layer, _kind), named in values.items():
        means = metrics.summarise(named)
        for row in rows:
            if row["layer"] == layer:
                for name, v in means.items():
                    value = float(v[row["channel"]])
                    row[name] = None if math.isnan(value) else value
    key = f"d_ld_{scopes[0]}"
    important = sorted((r for r in rows if -r[key] >= effect * abs(clean_ld)), key=lambda r: r[key])
    return {"clean": {"acc": float(engine.clean.acc.mean()), "logit_diff": clean_ld, "n_prompts": len(batch)},
            "scopes": list(scopes), "effect": effect, "forward_equivalents": cost, "n_channels": len(rows),
            "important": [{"layer": r["layer"], "channel": r["channel"], "drop": -r[key]} for r in important],
            "channels": rows}
