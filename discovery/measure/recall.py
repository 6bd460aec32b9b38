"""How well a cheap screen finds the heads that matter: recall of the exact top heads, measured.

The reference is the exact all-position zero-ablation sweep (``d_ld_all``: the mean change of the
logit difference when one head is ablated at every real position). A screen is any cheaper
per-head score; it is judged by where it ranks the ``top`` heads with the largest ``|d_ld_all|``:

- ``recall_at_k[k]``: the share of those heads among the screen's ``k`` largest ``|score|``;
- ``k_for_recall``: the smallest ``k`` whose recall reaches ``target`` (0.9: 9 of the top 10);
- Spearman (signed and of magnitudes), from :func:`~discovery.measure.attribution.rank_agreement`.

:func:`measure_screens` runs the reference and the screens on one batch and meters each one's
compute (matmul FLOPs over one clean forward's: forward-equivalents). Screens:

- ``atp``: plain AtP; ``atp_qk``: AtP with the QK fix (the sweep's ``atp_ld``);
- ``graddrop``: AtP* GradDrop (:mod:`discovery.measure.graddrop`), per-prompt magnitudes averaged;
  ``graddrop_mean_first``: the same reruns, each layer's estimate averaged over prompts before its
  magnitude is taken (no extra compute; closer to ranking by ``|mean effect|``);
- ``query``: the exact sweep at the query position only (``d_ld_query``), ~1/T of a position per head.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine, single_head_ablations
from discovery.measure.attribution import atp_effects, rank_agreement
from discovery.measure.cost import Meter
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch

SCREENS = ("atp", "atp_qk", "graddrop", "graddrop_mean_first", "query")
SCREEN_NAMES = {"atp": "AtP", "atp_qk": "AtP + QK fix", "graddrop": "AtP* GradDrop",
                "graddrop_mean_first": "GradDrop, prompt mean first", "query": "query-position exact sweep"}
TOP = 10  # the exact top heads a screen must find
TARGET = 0.9  # the recall a screen's top-k must reach
MAJOR = 0.1  # a head is "major" when its |exact effect| is at least this share of the largest


@dataclass(frozen=True)
class ScreenChoice:
    """A screen and how many of its top heads the exact sweep then measures; ``measured``: the evidence."""

    screen: str
    k: int
    measured: dict[str, Any]


DEFAULT_SCREEN = ScreenChoice(screen="atp_qk", k=30, measured={
    "table": "reports/screen-recall/README.md", "runs": 9, "worst_k_for_recall": 23, "target": TARGET, "top": TOP})
"""The screen of ``--ablation screened`` and how many of its top heads get the exact all-position sweep.

Chosen from the measured table in ``reports/screen-recall/README.md`` (``gascan screens``, zero ablation,
logit difference; 6 bundled toys at 64 prompts, SmolLM2-135M kv named at 16 and at 32 prompts,
Gemma3-270M kv lines at 32): AtP with the QK fix has the smallest worst-case k whose top-k holds 9 of
the exact top 10 (k = 15 mc-transformer, 9 mc1-transformer, 11 mc3-transformer, 14 mc-mamba2,
14 mc-mamba2-k2, 11 mc-hybrid, 13 and 23 SmolLM2 at 16 and 32 prompts, 11 Gemma3-270M), at 2.0-3.3
forward-equivalents. Worst cases of the others: plain AtP 50, GradDrop 31 (at 16 fwd-eq on SmolLM2),
the query-position sweep 97. k = 30 leaves a margin over the worst measured 23; on SmolLM2 the exact
part then costs 30/270 of the full sweep."""


def screen_recall(exact: torch.Tensor, score: torch.Tensor, *, top: int = TOP, target: float = TARGET,
                  ks: Sequence[int] = (5, 10, 15, 20, 30, 40, 50)) -> dict[str, Any]:
    """Recall of the ``top`` heads with the largest ``|exact|`` ``[head]`` within the screen's top-k by ``|score|`` ``[head]``.

    Returns ``recall_at_k`` (for each of ``ks`` up to the head count, and ``top``), ``k_for_recall`` (the
    smallest k reaching ``target``), ``ranks`` (1-based screen rank of each exact top head, best first),
    ``k_for_major`` (the smallest k holding every one of the ``n_major`` heads whose ``|exact|`` is at least
    :data:`MAJOR` of the largest: on a model with few heads the exact top 10 can include negligible ones)
    and the Spearman correlations of :func:`rank_agreement`. Ties go to the lower head index."""
    exact, score = exact.detach().double().flatten().cpu(), score.detach().double().flatten().cpu()
    if exact.shape != score.shape or exact.numel() == 0:
        raise ValueError(f"exact and score need the same non-empty shape, got {exact.shape} and {score.shape}")
    if torch.isnan(exact).any() or torch.isnan(score).any():
        raise ValueError("exact and score must be finite (score only the heads that were measured)")
    n = exact.numel()
    top = max(1, min(top, n))
    best = torch.argsort(-exact.abs(), stable=True)[:top]  # [top] exact top heads, largest first
    rank = torch.empty(n, dtype=torch.long)
    rank[torch.argsort(-score.abs(), stable=True)] = torch.arange(1, n + 1)
    ranks = rank[best].tolist()  # [top]
    need = math.ceil(target * top - 1e-9)
    major = exact.abs() >= MAJOR * exact.abs().max()  # [head]: the heads whose effect is not negligible
    agreement = rank_agreement(score, exact, k=top)
    return {
        "top": top, "target": target, "n_heads": n,
        "recall_at_k": {int(k): sum(r <= k for r in ranks) / top for k in sorted({*ks, top}) if k <= n},
        "k_for_recall": sorted(ranks)[need - 1],
        "ranks": ranks,
        "n_major": int(major.sum()), "k_for_major": int(rank[major].max()) if bool(major.any()) else None,
        "spearman": agreement["spearman"], "spearman_abs": agreement["spearman_abs"],
    }


def _sweep(engine: AblationEngine, heads: Sequence[HeadId], scope: str) -> Any:
    """Per-prompt effects (``Scores`` of ``[head, prompt]``) of zero-ablating each head at ``scope``."""
    ablations = single_head_ablations(heads, "zero", (scope,))
    return engine.effects(ablations)


def _graddrop_scores(result: Any, name: str) -> torch.Tensor:
    """``[head]`` from a GradDrop result: ``graddrop`` (per-prompt magnitudes, then the prompt mean) or
    ``graddrop_mean_first`` (per layer the prompt mean, then its magnitude, then the mean over layers)."""
    if name == "graddrop":
        return result.estimate.float().mean(-1)
    from discovery.measure.graddrop import graddrop_score

    return graddrop_score(result.dropped.mean(-1, keepdim=True), result.plain.mean(-1, keepdim=True))[:, 0]


def screen_scores(lm: LoadedModel, batch: AnnotatedBatch, engine: AblationEngine, heads: Sequence[HeadId],
                  name: str) -> tuple[torch.Tensor, Any]:
    """One screen's score per head ``[head]`` (rank by magnitude) and what it came from: the query sweep's
    per-prompt effects (``Scores``) or the attribution screen's result."""
    if name == "query":
        effects = _sweep(engine, heads, "query")
        return effects.logit_diff.float().mean(-1), effects
    if name not in SCREENS:
        raise ValueError(f"unknown screen {name!r}; known: {', '.join(SCREENS)}")
    if name.startswith("graddrop"):
        from discovery.measure.graddrop import graddrop_screen

        result = graddrop_screen(lm, batch, heads=list(heads), method="zero", scope=("all",), metric="logit_diff")
        return _graddrop_scores(result, name), result
    result = atp_effects(lm, batch, heads=list(heads), method="zero", scope=("all",), metric="logit_diff",
                         qk_fix=name == "atp_qk")
    return result.estimate.float().mean(-1), result


def _metered(fn: Callable[[], Any]) -> tuple[Any, Any]:
    with Meter() as meter:
        out = fn()
    return out, meter.cost


def measure_screens(lm: LoadedModel, batch: AnnotatedBatch, *, heads: Sequence[HeadId] | None = None,
                    screens: Sequence[str] = SCREENS, top: int = TOP, target: float = TARGET,
                    max_memory_mb: float | None = None, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The exact all-position sweep and each of ``screens`` on ``heads`` (default: every head), with each
    screen's recall of the exact top heads, and every part's wall time and forward-equivalents."""
    unknown = [s for s in screens if s not in SCREENS]
    if unknown:
        raise ValueError(f"unknown screen {unknown[0]!r}; known: {', '.join(SCREENS)}")
    heads = list(lm.inventory.heads() if heads is None else heads)
    say = log or (lambda line: None)
    engine, clean_cost = _metered(lambda: AblationEngine(lm, batch, max_memory_mb=max_memory_mb))
    unit = clean_cost.flops

    started = time.perf_counter()
    exact, exact_cost = _metered(lambda: _sweep(engine, heads, "all").logit_diff.float().mean(-1))  # [head]
    say(f"exact all-position sweep: {len(heads)} heads, {time.perf_counter() - started:.1f} s")
    scores: dict[str, torch.Tensor] = {}
    costs: dict[str, Any] = {}
    graddrop = None
    for name in screens:
        started = time.perf_counter()
        if name.startswith("graddrop"):  # both GradDrop scores come from one run
            if graddrop is None:
                graddrop, graddrop_cost = _metered(lambda: screen_scores(lm, batch, engine, heads, "graddrop")[1])
            scores[name], costs[name] = _graddrop_scores(graddrop, name), graddrop_cost
        else:
            (scores[name], _), costs[name] = _metered(lambda name=name: screen_scores(lm, batch, engine, heads, name))
        say(f"screen {name}: {time.perf_counter() - started:.1f} s")
    out_screens = {}
    for name in screens:
        record = screen_recall(exact, scores[name], top=top, target=target)
        record |= {"name": SCREEN_NAMES[name], "forward_equivalents": costs[name].flops / unit if unit else None,
                   "seconds": round(costs[name].wall_s, 3),
                   "scores": {str(h): float(v) for h, v in zip(heads, scores[name].tolist(), strict=True)}}
        out_screens[name] = record
    order = torch.argsort(-exact.abs(), stable=True)[:top].tolist()
    return {
        "model": lm.name, "n_layers": lm.inventory.n_layers, "n_heads": len(heads), "n_prompts": len(batch),
        "positions": int(batch.input_ids.shape[1]),
        "clean": {m: float(engine.clean[m].float().mean()) for m in ("acc", "logit_diff")},
        "reference": {"name": "exact all-position zero-ablation sweep (d_ld_all)",
                      "forward_equivalents": exact_cost.flops / unit if unit else None,
                      "seconds": round(exact_cost.wall_s, 3),
                      "top": [{"head": str(heads[i]), "d_ld_all": float(exact[i])} for i in order],
                      "d_ld_all": {str(h): float(v) for h, v in zip(heads, exact.tolist(), strict=True)}},
        "clean_forward": {"flops": unit, "seconds": round(clean_cost.wall_s, 3)},
        "screens": out_screens,
    }
