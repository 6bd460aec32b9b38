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
(:func:`default_budget`) is 1.5x the all-position sweep's cost, but at least :data:`MIN_PASSES` average
single-head passes: the tests' controls are as many passes whatever the number of heads, so on models under
94 heads (Gemma3-270M) the floor decides; and a model whose forward is so cheap that 200 fe cost at most a
teraFLOP (the bundled toys) gets 200.
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
MIN_PASSES = 140  # ... and at least this many average single-head passes: the tests' statistics fix how many
# ablations they run, not how many heads the model has. The smallest complete set: one pair verified against
# its 50 controls (51), two groups against MIN_DRAWS controls each (40), spare-one (~5), position effects and
# minimal model of MIN_CANDIDATES heads at 3 scopes each (30), read tests (~2), a 2x2 pair ranking (~8): ~136.
# (The fixed floor of 200 fe this replaces gave Gemma3-270M 5.3x its 38 fe all-position sweep: docs/scale.md.)
# A model so small that 200 fe cost at most 1 TFLOP (seconds on a CPU: the bundled toys, 0.3-0.6 TFLOP) gets 200 fe:
# there a budget saves nothing, and the toys' group tests (layer-spanning groups, each control a near-full forward
# of a 4-layer model) need 110-130 fe to keep their unbounded verdicts (at 87.5 fe mc-mamba2 lost an aggregate head)
SMALL_MODEL_BUDGET, SMALL_MODEL_FLOPS = 200.0, 1e12
# shares of the budget: the evidence stage's parts, in the order they run; the pair stage gets the rest. From
# what each part planned in the six committed default scans (toys, Gemma3-270M, SmolLM2-135M; 2026-12-07):
# position effects 14-24% (median 22), groups 18-45% (29), minimal model 0-10% (9.5), read tests 0-2%, pairs
# 30-50% (42): each share near its median, reads with room, and the pairs get what the others leave
SHARES = {"position effects": 0.22, "group ablations": 0.30, "minimal model": 0.10, "read tests": 0.03}
MAX_CANDIDATES, MIN_CANDIDATES = 24, 5  # a bounded evidence stage tests between these many heads


def candidate_counts(n_heads: int) -> list[int]:
    """The candidate counts a bounded part tries, largest first: every count from :data:`MAX_CANDIDATES` (or
    one under ``n_heads``) down to :data:`MIN_CANDIDATES`, so a part takes as many heads as its allowance
    affords (steps of 4 left Gemma3-270M 2 heads short of the gather head L5H3)."""
    return list(range(min(MAX_CANDIDATES, n_heads - 1), MIN_CANDIDATES - 1, -1))


def default_budget(sweep_fe: float | None, n_heads: int, forward_flops: float | None = None) -> float | None:
    """``DEFAULT_FACTOR`` x the all-position sweep's forward-equivalents over ``n_heads`` heads, at least
    :data:`MIN_PASSES` of its average single-head pass (``sweep_fe / n_heads``), and :data:`SMALL_MODEL_BUDGET`
    where that costs at most :data:`SMALL_MODEL_FLOPS` (``forward_flops``: one clean forward over the task's
    prompts); None when unknown."""
    if not sweep_fe or n_heads < 1:
        return None
    budget = float(sweep_fe) * max(DEFAULT_FACTOR, MIN_PASSES / n_heads)
    if forward_flops and SMALL_MODEL_BUDGET * float(forward_flops) <= SMALL_MODEL_FLOPS:
        budget = max(budget, SMALL_MODEL_BUDGET)
    return budget


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
    every head's, or for ``--ablation screened`` the swept heads' only, and of the task's ``forward_flops``."""
    if unit == "none":
        return None
    swept = _screened_layers(task_summary)
    if swept is not None:  # --ablation screened: the all-position sweep covered the screen's top heads only
        layers = swept
    flops = (task_summary or {}).get("forward_flops")
    if unit == "auto":
        return default_budget(all_position_sweep_fe(layers, n_layers), len(layers), flops)
    if unit == "fe":
        return amount
    info = task_summary or {}
    seconds, fe = info.get("seconds"), ((info.get("cost") or {}).get("forward_equivalents"))
    if not seconds or not fe:  # no measured rate (a sharded sweep): fall back to the default rule
        return default_budget(all_position_sweep_fe(layers, n_layers), len(layers), flops)
    return amount * float(fe) / float(seconds)
