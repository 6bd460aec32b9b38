"""Evidence on a budget: which heads the evidence stage tests, how many controls it draws, and what that costs.

The sweep measures every head at all positions and at the query. The evidence stage's other tests (the
segment and summary scopes, mean ablation, the minimal model, group ablations with random controls, read
tests) and the pair stage's tests (mediation, patterns under ablation, verification against random pairs)
cost, unbounded, 5-20x the sweep (the bundled toy: sweep 17.5, evidence 94, pairs 226 forward-equivalents).
They need not run on every head:

**The candidate rule** (:func:`choose_candidates`). A head is tested beyond the sweep when

1. its sweep effect counts at the noise level: at a scope the sweep measured (``d_ld_all``, ``d_ld_query``)
   ``|effect| >= noise * clean logit difference`` with a bootstrap interval that excludes 0 (strongest
   first, by its largest share of the clean logit difference); or
2. it has a G&A-like pattern (the role thresholds: selectivity or selection, gather score), strongest
   pattern first (so the decoys, patterns without an effect, are tested, not only heads rule 1 took).

Without sweep effects (``--ablation atp``) rule 1 ranks by ``|atp_ld|``.

At most ``limit`` heads: two thirds of the places go to rule 1, the rest to rule 2, and places one rule
leaves free go to the other. Every other head keeps its sweep columns and null evidence columns: its role
comes from the sweep's scopes alone (an aggregate-like head with its own query effect is still an
aggregate head; a pattern head without a sweep effect is not called a decoy, since its other scopes were
not measured), and the report lists it as untested.

**The budget** (:class:`Ledger`), in forward-equivalents (one clean forward over the scan's prompts),
bounds evidence and pairs together. Costs are predicted exactly before anything runs
(:meth:`~discovery.measure.ablation.AblationEngine.predicted_forward_equivalents`: the layers each ablation
recomputes, each layer and the unembedding weighed by its measured FLOPs; a pattern or read pass costs the
layers from the first it edits or reads to the last it reads); each part is shrunk to what is left of its share
(:data:`SHARES`): fewer candidates, fewer group controls (never under :data:`MIN_DRAWS`), fewer groups, fewer
pair candidates, fewer top pairs verified; the read tests (a pass per gather candidate) and each verified
pair's random controls (the test's statistics: with 19 instead of 50 the mc toy "verified" a pair the full
test rejects) are never cut. What was cut is recorded and reported. The default budget
(:func:`default_budget`) is 1.5x the sweep's cost, so a whole scan costs at most about 2.5x its sweep,
but at least :data:`MIN_BUDGET`: on small models (the toys, Gemma3-270M) the floor decides, since the tests'
controls cost the same whatever the number of heads.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from discovery.evidence.common import _heads_of, _num
from discovery.evidence.thresholds import EvidenceThresholds
from discovery.heads import HeadId
from discovery.measure.metrics import selection

MIN_DRAWS = 19  # random controls a group or pair test keeps at least: the smallest count with p <= 0.05 possible
DEFAULT_FACTOR = 1.5  # default budget: evidence + pairs cost at most this many sweeps
MIN_BUDGET = 200.0  # ... and at least this many: the tests' fixed cost (controls) does not shrink with the model;
# at 40 the mc toy lost its gather head, at 100 the mc-mamba2 toy lost the group credit of an aggregate head,
# at 79 (1.5x its sweep) Gemma3-270M lost its gather head L5H3 (5 candidates; it needs 12, from 141.5): docs/scale.md
# shares of the budget: the evidence stage's parts, in the order they run; the pair stage gets the rest
SHARES = {"position effects": 0.15, "group ablations": 0.35, "minimal model": 0.05, "read tests": 0.05}
CANDIDATE_LIMITS = (24, 16, 12, 8, 5)  # candidate counts tried, largest first


def default_budget(sweep_fe: float | None) -> float | None:
    """``DEFAULT_FACTOR`` x the sweep's forward-equivalents, at least ``MIN_BUDGET``; None when unknown."""
    if not sweep_fe:
        return None
    return max(DEFAULT_FACTOR * float(sweep_fe), MIN_BUDGET)


def _strength(row: Mapping[str, Any], scopes: Sequence[str], clean_ld: float, fraction: float) -> float | None:
    """The largest share of the clean logit difference among the sweep scopes whose effect counts
    (``|mean| >= fraction * clean_ld``, interval excluding 0); None when none counts."""
    best = None
    for s in scopes:
        mean, lo, hi = (_num(row.get(f"d_ld_{s}{end}")) for end in ("", "_lo", "_hi"))
        if mean is None or lo is None or hi is None or clean_ld <= 0:
            continue
        if (hi < 0 or lo > 0) and abs(mean) >= fraction * clean_ld:
            share = abs(mean) / clean_ld
            best = share if best is None else max(best, share)
    return best


def pattern_strength(row: Mapping[str, Any], th: EvidenceThresholds) -> float | None:
    """How far above its role threshold a head's G&A-like pattern is (None: no G&A-like pattern)."""
    scores = []
    sel = _num(row.get("selectivity"))
    if sel is not None and sel >= th.selectivity:
        scores.append(sel - th.selectivity)
    if selection(row) >= th.agg_select:
        scores.append(selection(row) - th.agg_select)
    gs = _num(row.get("gather_score"))
    if gs is not None and gs >= th.gather_score:
        scores.append(gs - th.gather_score)
    return max(scores) if scores else None


def choose_candidates(frame: pl.DataFrame, clean_ld: float, th: EvidenceThresholds | None = None,
                      limit: int | None = None) -> tuple[list[HeadId], dict[HeadId, str]]:
    """The heads the evidence stage tests beyond the sweep (see module docstring) and why each was chosen
    (``effect`` or ``pattern``); all heads when ``limit`` is None or not smaller than the table."""
    th = th or EvidenceThresholds()
    heads = _heads_of(frame)
    rows = list(frame.iter_rows(named=True))
    scopes = [s for s in ("all", "query") if f"d_ld_{s}" in frame.columns]
    effect, pattern = [], []
    for h, row in zip(heads, rows):
        strength = _strength(row, scopes, clean_ld, th.noise)
        if not scopes and _num(row.get("atp_ld")) is not None and clean_ld > 0:
            atp = abs(_num(row.get("atp_ld")) or 0.0) / clean_ld
            strength = atp if atp >= th.noise else None
        looks = pattern_strength(row, th)
        if strength is not None:
            effect.append((-strength, h))
        if looks is not None:
            pattern.append((-looks, -(strength or 0.0), h))
    effect_order = [h for _, h in sorted(effect)]
    pattern_order = [h for *_, h in sorted(pattern)]
    why: dict[HeadId, str] = {}
    if limit is None or limit >= len(heads):
        for h in effect_order:
            why.setdefault(h, "effect")
        for h in pattern_order:
            why.setdefault(h, "pattern")
        return heads, why
    take_effect = math.ceil(limit * 2 / 3)
    chosen: list[HeadId] = []

    def take(order: Iterable[HeadId], n: int, reason: str) -> None:
        for h in order:
            if len(chosen) >= limit or n <= 0:
                return
            if h not in why:
                chosen.append(h)
                why[h] = reason
                n -= 1

    take(effect_order, take_effect, "effect")
    take(pattern_order, limit - len(chosen), "pattern")
    take(effect_order, limit - len(chosen), "effect")  # places the pattern rule left free
    return sorted(chosen), why


@dataclass
class Ledger:
    """The evidence and pair stages' spending against one budget in forward-equivalents (None: unbounded).

    ``parts``: what each part was allowed, predicted and cut; the summary's ``evidence_budget`` record, which the
    pair stage (possibly in a later process) reads back with :meth:`from_record`."""

    budget: float | None
    spent: float = 0.0
    parts: list[dict[str, Any]] = field(default_factory=list)

    def allowance(self, part: str) -> float | None:
        """What ``part`` may spend: its share of the budget plus what earlier parts left unspent (the pair
        stage, or any part not in :data:`SHARES`: everything left). None when unbounded."""
        if self.budget is None:
            return None
        names = list(SHARES)
        if part in SHARES:
            planned = sum(self.budget * SHARES[n] for n in names[: names.index(part) + 1])
            return max(0.0, planned - self.spent)
        return max(0.0, self.budget - self.spent)

    def charge(self, part: str, allowance: float | None, predicted: float, **notes: Any) -> None:
        """Record ``part``: what it was allowed, what it runs (predicted forward-equivalents), what was cut."""
        self.spent += predicted
        self.parts.append({"part": part, "allowance": _round(allowance), "predicted": round(predicted, 3), **notes})

    def record(self) -> dict[str, Any]:
        """The summary's ``evidence_budget`` record."""
        return {"budget": _round(self.budget), "spent": round(self.spent, 3), "parts": self.parts,
                "rule": RULE_TEXT}

    @classmethod
    def from_record(cls, record: Mapping[str, Any] | None, budget: float | None) -> Ledger:
        """The ledger the evidence stage left (its spending counts against the same budget)."""
        if not record:
            return cls(budget)
        return cls(budget, float(record.get("spent") or 0.0), list(record.get("parts") or []))


RULE_TEXT = ("tested beyond the sweep: heads whose sweep effect (all positions or the query) is at least "
             "the noise share of the clean logit difference with an interval excluding 0, strongest first, "
             "and heads with a G&A-like pattern, strongest pattern first (two thirds of the places to the first "
             "rule); the others keep their sweep effects only")


def _round(x: float | None) -> float | None:
    return None if x is None else round(float(x), 3)


def fit(options: Sequence[Any], cost: Any, allowance: float | None) -> tuple[Any, float, bool]:
    """The first of ``options`` (largest first) whose ``cost(option)`` fits ``allowance``; else the last.
    Returns the option, its cost and whether it fits."""
    for option in options:
        c = cost(option)
        if allowance is None or c <= allowance + 1e-9:
            return option, c, True
    return options[-1], cost(options[-1]), False


def all_position_sweep_fe(layers: Sequence[int], n_layers: int) -> float:
    """The exact all-position sweep's cost in forward-equivalents, counted in layers: a head of layer l
    recomputes layers l..L-1 (from the inventory alone, so a scan and a sharded batch agree on it)."""
    return sum((n_layers - layer) / n_layers for layer in layers)


def _screened_layers(task_summary: Mapping[str, Any] | None) -> list[int] | None:
    """The layers of the heads a screened scan swept at all positions (its task summary's ``screen`` record,
    head names such as ``L3H1``), or None for a scan that swept every head."""
    heads = ((task_summary or {}).get("screen") or {}).get("heads")
    if not heads:
        return None
    return [int(re.match(r"L(\d+)", name).group(1)) for name in heads]


def resolve_budget(unit: str, amount: float | None, layers: Sequence[int], n_layers: int,
                   task_summary: Mapping[str, Any] | None = None) -> float | None:
    """The evidence + pairs budget of one task in forward-equivalents (None: unbounded), from a parsed
    ``--budget`` (``unit`` auto, none, fe or s; :func:`pipelines.validate.budget`). ``auto``:
    :func:`default_budget` of the all-position sweep's layer count (the sweep's dominant part; deterministic):
    every head's, or for ``--ablation screened`` the swept heads' only."""
    if unit == "none":
        return None
    swept = _screened_layers(task_summary)
    if swept is not None:  # --ablation screened: the all-position sweep covered the screen's top heads only
        layers = swept
    if unit == "auto":
        return default_budget(all_position_sweep_fe(layers, n_layers))
    if unit == "fe":
        return amount
    info = task_summary or {}
    seconds, fe = info.get("seconds"), ((info.get("cost") or {}).get("forward_equivalents"))
    if not seconds or not fe:  # no measured rate (a sharded sweep): fall back to the default rule
        return default_budget(all_position_sweep_fe(layers, n_layers))
    return amount * float(fe) / float(seconds)
