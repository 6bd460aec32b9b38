"""Evidence standards: a head is a gather or aggregate head only when its pattern *and* its causal effect
at the right positions agree (DESIGN.md, "What a trained toy model taught us").

Small models trained here reach 99% accuracy with heads that put 82% of the query's attention on the
correct option and whose removal, alone or with every other selective head, changes nothing. A ranking
by pattern would name them; this module asks the causal questions the roles imply, every ablation going
through the one :class:`~discovery.ablation.AblationEngine`:

- :func:`position_effects`: each head's zero-ablation effect at all positions, at the query only, at the
  segment positions only and at the summary tokens only, plus mean ablation at all positions, with
  bootstrap intervals over prompts. An aggregate head's effect must live at the query; a gather head's
  at the segments (and a later head must read it, :func:`read_test`).
- :func:`depth_profile`, :func:`minimal_depth`, :func:`minimal_model_effects`: the paper's minimal model,
  automated. The task score of the model cut after each layer (read out through the final norm and the
  unembedding), the shallowest depth that keeps a chosen share of the clean score, and the head
  ablations repeated inside that truncated model, where redundancy from later layers is gone.
- :func:`group_ablations`: heads that share a role by pattern (every selective head; the gatherers of a
  layer) and the top-k heads by effect, ablated together, each against random controls of the same size
  from the same layers; members are credited by sparing them one at a time. Redundant circuits show up;
  decoys are exposed.
- :func:`read_test`: knock out a gather candidate at the segment positions and watch each later
  aggregate head: its selectivity / ``agg_select`` and its direct logit effect at the query.
- :func:`verdicts`: a role per head (``gather``, ``aggregate``, ``other_important``, ``decoy``, ``none``)
  with the evidence behind it, and one verdict per model: ``clean``, ``distributed`` or ``none``.
- :func:`evidence_report`: all of the above for one task of a scan; ``EvidenceReport.write`` writes
  ``evidence.parquet`` (per head), ``evidence_groups.parquet`` and ``evidence_depth.parquet``.

Effects are in units of the model's own clean logit difference (gold minus the mean of the other
candidates at the query): ablated minus clean, negative = the head helps. "Drop" below is minus that.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import torch

from discovery.errors import GascanError
from discovery.heads import HeadId
from discovery.measure.ablation import (
    Ablation,
    AblationEngine,
    Progress,
    query_scores,
    single_head_ablations,
    stage_ticker,
)
from discovery.measure.metrics import SELECTION_METRICS, linearised_norm_scale, selection
from discovery.model.loading import LoadedModel
from discovery.stats import bootstrap_ci
from discovery.tasks.base import AnnotatedBatch

ROLES = ("gather", "aggregate", "other_important", "decoy", "none")
VERDICTS = ("clean", "distributed", "none")
# scope name -> (method, position classes): the position-resolved single-head ablations
SCOPE_ABLATIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "all": ("zero", ("all",)),
    "query": ("zero", ("query",)),
    "segment": ("zero", ("segment",)),
    "summary": ("zero", ("summary",)),
    "mean_all": ("mean", ("all",)),
}
MINIMAL_SCOPES = ("all", "query", "segment")
SHORT = {"logit_diff": "ld", "acc": "acc", "gold_logprob": "lp"}


@dataclass
class EvidenceThresholds:
    """When a pattern counts, when an effect counts, and when a group beats its controls.

    Effect thresholds are fractions of the model's own clean logit difference (``clean_ld``); an effect
    "counts" only when its bootstrap interval also excludes 0. Group thresholds compare a group with
    random controls of the same size drawn from the same layers.
    """

    selectivity: float = 0.6  # aggregate-like pattern: query mass on the gold segment / on all segments
    agg_select: float = 0.6  # ... or the gold segment gets the most query mass on this share of prompts
    # (or this much query mass sits on the two tokens right after it: agg_after, an SSM reading late)
    gather_score: float = 0.5  # gather-like pattern: summary-token mass on its own segment's other tokens
    effect: float = 0.1  # important: drop >= effect * clean_ld (interval excluding 0)
    noise: float = 0.05  # no effect: |effect| < noise * clean_ld, or the interval includes 0, at every scope
    located: float = 0.5  # an effect "lives" at a position class when ablating there gives this share of all
    group: float = 0.2  # a group matters: joint drop >= group * clean_ld ...
    control_quantile: float = 0.95  # ... beyond this quantile of its controls' drops, interval excluding 0
    n_controls: int = 30  # random control draws per group (all distinct draws when fewer exist)
    top_k: int = 5  # size of the top-k-by-effect group
    max_gather_groups: int | None = 8  # cost cap: test the layers whose gatherers' summed segment drop is largest
    read: float = 0.3  # a later head reads a gatherer: its direct logit effect falls by this share ...
    read_select: float = 0.1  # ... or its selectivity / agg_select falls by this much (absolute)
    keep: float = 0.9  # the minimal model keeps this share of the clean score (above chance for accuracy)
    depth_metric: str = "acc"  # score the minimal model keeps: acc (chance-corrected) or logit_diff
    min_margin: float = 0.05  # the task is "done" when clean accuracy beats chance by this much

    def __post_init__(self) -> None:
        if self.depth_metric not in ("acc", "logit_diff"):
            raise GascanError(f"unknown depth metric {self.depth_metric!r}", "use acc or logit_diff")
        for name in ("selectivity", "agg_select", "gather_score", "located", "control_quantile", "keep", "read"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise GascanError(f"evidence threshold {name}={value} is outside 0..1", "pass a fraction")
        if self.n_controls < 1 or self.top_k < 1 or (self.max_gather_groups is not None and self.max_gather_groups < 0):
            raise GascanError("n_controls and top_k must be at least 1, max_gather_groups at least 0",
                              "pass positive counts")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _heads_of(frame: pl.DataFrame) -> list[HeadId]:
    return [HeadId(int(r[0]), int(r[1]), str(r[2])) for r in frame.select("layer", "head", "kind").rows()]


def _num(value: Any) -> float | None:
    """A finite float or None (NaN, null and missing become None)."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


def _direct_change(drop: float | None) -> str:
    """A reader's relative direct-effect drop in words ("direct effect falls 19%")."""
    if drop is None:
        return "direct effect n/a"
    return f"direct effect {'falls' if drop >= 0 else 'rises'} {abs(drop):.0%}"


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _check_candidates(batch: AnnotatedBatch) -> None:
    """The engine scores the candidates' first tokens: they must be distinct within every prompt."""
    cand = batch.cand_first_token
    mask = batch.cand_mask if batch.cand_mask is not None else torch.ones_like(cand, dtype=torch.bool)
    for i in range(len(batch)):
        firsts = cand[i][mask[i]].tolist()
        if len(set(firsts)) != len(firsts):
            raise GascanError(
                f"the candidates of prompt {i} share their first token, so effects on the answer cannot be read",
                "use a task form with single-token answers (e.g. --task-option query_space=true for kv named)",
            )


def _chance(batch: AnnotatedBatch) -> float:
    """Accuracy of a uniform guess among each prompt's candidates, averaged over prompts."""
    if batch.cand_mask is not None:
        counts = batch.cand_mask.sum(1).clamp(min=1).float()
    else:
        counts = torch.full((len(batch),), float(batch.cand_first_token.shape[1]))
    return float((1.0 / counts).mean())


def _clean(engine: AblationEngine) -> dict[str, float]:
    return {"acc": float(engine.clean.acc.mean()), "logit_diff": float(engine.clean.logit_diff.mean()),
            "gold_logprob": float(engine.clean.gold_logprob.mean()), "chance": _chance(engine.batch)}


# ---------------------------------------------------------------------------------------------
# 1. Position-resolved effects
# ---------------------------------------------------------------------------------------------


def position_effects(engine: AblationEngine, heads: Iterable[HeadId] | None = None, *,
                     scopes: Sequence[str] = tuple(SCOPE_ABLATIONS), bootstrap: int = 1000, seed: int = 0,
                     prefix: str = "", progress: Progress | None = None) -> pl.DataFrame:
    """Every head's effect per scope, in one batched ``engine.run``.

    Columns ``layer, head, kind`` and, per scope ``s`` of ``scopes`` (keys of :data:`SCOPE_ABLATIONS`:
    ``all``, ``query``, ``segment``, ``summary`` zero-ablate there; ``mean_all`` mean-ablates everywhere)
    and metric, ``{prefix}d_{ld|acc|lp}_{s}`` with ``_lo``/``_hi`` bootstrap bounds over prompts (the
    scan's naming and bootstrap, so the numbers agree with its ``d_ld_all``/``d_ld_query``).
    """
    heads = list(engine.inventory.heads() if heads is None else heads)
    heads = [h for h in heads if h.layer < engine.n_active_layers]
    bad = [s for s in scopes if s not in SCOPE_ABLATIONS]
    if bad:
        raise GascanError(f"unknown effect scope {bad[0]!r}", f"use some of: {', '.join(SCOPE_ABLATIONS)}")
    ablations: list[Ablation] = []
    for s in scopes:
        method, where = SCOPE_ABLATIONS[s]
        ablations += single_head_ablations(heads, method, where)
    tick = stage_ticker(progress, f"{prefix}position effects", len(ablations))
    effects = engine.effects(ablations, engine.run(ablations, progress=tick))
    columns: dict[str, list[Any]] = {"layer": [h.layer for h in heads], "head": [h.index for h in heads],
                                     "kind": [h.kind for h in heads]}
    n = len(heads)
    for k, s in enumerate(scopes):
        for metric, short in SHORT.items():
            mean, lo, hi = bootstrap_ci(effects[metric][k * n:(k + 1) * n], bootstrap, seed=seed)
            name = f"{prefix}d_{short}_{s}"
            columns[name] = mean.tolist()
            columns[f"{name}_lo"] = lo.tolist()
            columns[f"{name}_hi"] = hi.tolist()
    return pl.DataFrame(columns, schema_overrides={"layer": pl.Int64, "head": pl.Int64, "kind": pl.Utf8})


# ---------------------------------------------------------------------------------------------
# 2. The minimal model
# ---------------------------------------------------------------------------------------------


def _readout_logits(lm: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Logits from residual states ``[batch, d_model]`` through the model's final norm and unembedding."""
    adapter = lm.adapter
    with torch.no_grad():
        x = adapter.final_norm()(hidden[:, None, :])  # [batch, 1, d_model]
        logits = adapter.unembed()(x)[:, 0].float()  # [batch, vocab]
    cap = getattr(lm.model.config, "final_logit_softcapping", None)
    if cap:  # Gemma 2/3 squash the final logits
        logits = torch.tanh(logits / cap) * cap
    return logits


def depth_profile(lm: LoadedModel, batch: AnnotatedBatch) -> pl.DataFrame:
    """The task score of the model truncated after each layer: one row per depth ``1..n_layers``.

    Each layer's output at the query position is captured in one clean pass (the Intervener's
    ``layer_sinks``) and read out through the final norm and the unembedding; the last depth is the
    model itself. Columns: ``depth`` (layers kept), ``layer`` (the last one), ``acc``, ``logit_diff``,
    ``gold_logprob`` (means over prompts), ``chance`` and the shares of the clean score ``acc_frac``
    (above chance: ``(acc - chance) / (clean acc - chance)``, null when the clean model is not above
    chance by a margin) and ``ld_frac`` (``logit_diff / clean logit_diff``, null when that is <= 0).
    """
    from discovery.measure.patterns import model_inputs
    from discovery.model.intervene import Intervener, PassConfig

    device = next(lm.model.parameters()).device
    part = batch.to(device)
    rows = torch.arange(len(part), device=device)
    n_layers = lm.inventory.n_layers
    captured: dict[int, torch.Tensor] = {}
    sinks = {i: (lambda h, i=i: captured.__setitem__(i, h[rows, part.query_pos].detach())) for i in range(n_layers)}
    with torch.no_grad(), Intervener(lm.adapter).run(PassConfig(layer_sinks=sinks)):
        lm.model(**model_inputs(lm.model, part))
    scores = [query_scores(_readout_logits(lm, captured[i])[None], part) for i in range(n_layers)]
    chance = _chance(batch)
    last = scores[-1]
    clean_acc, clean_ld = float(last.acc.mean()), float(last.logit_diff.mean())
    out = []
    for i, s in enumerate(scores):
        acc, ld = float(s.acc.mean()), float(s.logit_diff.mean())
        out.append({
            "depth": i + 1, "layer": i, "acc": acc, "logit_diff": ld, "gold_logprob": float(s.gold_logprob.mean()),
            "chance": chance,
            "acc_frac": (acc - chance) / (clean_acc - chance) if clean_acc - chance > 1e-9 else None,
            "ld_frac": ld / clean_ld if clean_ld > 1e-9 else None,
        })
    return pl.DataFrame(out, schema_overrides={"acc_frac": pl.Float64, "ld_frac": pl.Float64})


def minimal_depth(profile: pl.DataFrame, thresholds: EvidenceThresholds | None = None) -> int | None:
    """The shallowest depth whose score keeps ``thresholds.keep`` of the clean score (None: the clean
    model does not do the task, so there is no minimal model)."""
    th = thresholds or EvidenceThresholds()
    last = profile.row(profile.height - 1, named=True)
    if th.depth_metric == "acc" and last["acc"] - last["chance"] < th.min_margin:
        return None
    if last["logit_diff"] <= 0:
        return None
    column = "acc_frac" if th.depth_metric == "acc" else "ld_frac"
    for row in profile.iter_rows(named=True):
        if row[column] is not None and row[column] >= th.keep - 1e-9 and row["logit_diff"] > 0:
            return int(row["depth"])
    return int(last["depth"])


def minimal_model_effects(lm: LoadedModel, batch: AnnotatedBatch, depth: int, heads: Iterable[HeadId] | None = None,
                          *, scopes: Sequence[str] = MINIMAL_SCOPES, bootstrap: int = 1000, seed: int = 0,
                          max_memory_mb: float | None = None, progress: Progress | None = None
                          ) -> tuple[pl.DataFrame, dict[str, float]]:
    """Head ablations repeated inside the model truncated to ``depth`` layers.

    Returns the :func:`position_effects` table with columns prefixed ``mm_`` (heads of the kept layers
    only) and the truncated model's clean scores (``acc``, ``logit_diff``, ``gold_logprob``, ``chance``).
    """
    n_layers = lm.inventory.n_layers
    if not 1 <= depth <= n_layers:
        raise GascanError(f"minimal-model depth {depth} is outside 1..{n_layers}", "pass a depth from the profile")
    engine = AblationEngine(lm, batch, readout_layer=depth - 1, max_memory_mb=max_memory_mb)
    frame = position_effects(engine, heads, scopes=scopes, bootstrap=bootstrap, seed=seed, prefix="mm_",
                             progress=progress)
    return frame, _clean(engine)


# ---------------------------------------------------------------------------------------------
# 3. Group ablations
# ---------------------------------------------------------------------------------------------


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


def group_ablations(engine: AblationEngine, frame: pl.DataFrame, thresholds: EvidenceThresholds | None = None, *,
                    groups: Sequence[Group] | None = None, bootstrap: int = 1000, seed: int = 0,
                    progress: Progress | None = None) -> pl.DataFrame:
    """Each group's joint effect against random controls, and which members it needs.

    One row per group: ``group, role, scope, heads`` (names), ``n``, the joint effect ``effect`` (logit
    difference) with ``effect_lo/_hi`` and ``d_acc``, ``rel_drop`` (drop / clean logit difference), the
    controls' ``control_n, control_mean, control_p05, control_p50, control_p95`` (drops are minus these),
    ``control_p`` = (1 + #controls at least as harmful) / (1 + #controls), ``beyond_control``,
    ``significant`` (large, beyond the controls' quantile, interval below 0), and for significant groups
    of two or more heads the spare-one test: ``marginal`` (per member: the drop lost when that member
    alone is spared, in logit difference) and ``credited`` (members whose marginal is >= noise * clean
    with an interval above 0).
    """
    th = thresholds or EvidenceThresholds()
    clean_ld = float(engine.clean.logit_diff.mean())
    groups = list(groups) if groups is not None else role_groups(frame, th, clean_ld=clean_ld)
    pool = [h for h in engine.inventory.heads() if h.layer < engine.n_active_layers]
    plans: list[tuple[Group, list[tuple[HeadId, ...]]]] = []
    ablations: list[Ablation] = []
    for g in groups:
        draws = control_draws(g.heads, pool, th.n_controls, seed)
        plans.append((g, draws))
        ablations.append(Ablation(g.heads, "zero", g.scope, label=g.name))
        ablations += [Ablation(d, "zero", g.scope, label=f"control:{g.name}") for d in draws]
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
    if spare:
        spare_abl = []
        for r, h in spare:
            g = plans[r][0]
            spare_abl.append(Ablation(tuple(x for x in g.heads if x != h), "zero", g.scope, label=f"spare:{h}"))
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


# ---------------------------------------------------------------------------------------------
# Read test: does a later head read what a gather candidate wrote?
# ---------------------------------------------------------------------------------------------


def _reader_values(engine: AblationEngine, readers: Sequence[HeadId], ablation: Ablation | None
                   ) -> dict[HeadId, dict[str, float | None]]:
    """Selectivity, agg_select (attention readers) and direct logit effect at the query of each reader,
    in one pass with ``ablation`` applied (None: clean)."""
    from discovery.measure.patterns import model_inputs

    batch = engine.batch
    rows = torch.arange(len(batch), device=engine.device)
    config = engine.plan([ablation]) if ablation is not None else engine.plan([])
    by_group: dict[tuple[int, str], list[HeadId]] = {}
    for h in readers:
        by_group.setdefault((h.layer, h.kind), []).append(h)
    inputs: dict[tuple[int, str], torch.Tensor] = {}
    probs: dict[tuple[int, str], torch.Tensor] = {}  # [batch, head, q, k] per reader group
    for (layer, kind) in by_group:
        previous = config.proj_edits.get((layer, kind))

        def grab(x: torch.Tensor, key=(layer, kind), previous=previous) -> torch.Tensor:  # x [batch, pos, in]
            x = previous(x) if previous is not None else x
            inputs[key] = x[rows, batch.query_pos].detach().float()  # [batch, in]
            return x

        config.proj_edits[(layer, kind)] = grab
        group = engine.inventory.group(layer, kind)
        if group.pattern == "attention":
            config.prob_sinks[layer] = lambda p, key=(layer, kind): probs.__setitem__(key, p.detach().float())
        else:  # SSM readers: their implicit attention, as the pattern pass computes it
            config.mixer_sinks[layer] = _implicit_sink(engine, group, probs, config.mixer_sinks.get(layer))
    with torch.no_grad(), engine.intervener.run(config):
        engine.model(**model_inputs(engine.model, batch))
    with torch.no_grad():
        return _reader_readout(engine, by_group, inputs, probs)


def _implicit_sink(engine: AblationEngine, group: Any, probs: dict, previous: Callable | None) -> Callable:
    """A mixer sink that stores an SSM group's implicit attention ``[batch, head, q, k]`` in ``probs``."""
    from discovery.model import ssm

    mixer = engine.lm.adapter.mixer(group.layer, group.kind)

    def sink(hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        if previous is not None:
            previous(hidden, mask)
        comp = ssm.ssm_components(mixer, hidden, mask)
        pattern = (ssm.implicit_attention(comp, channel_group=group.width) if group.pattern == "mamba1"
                   else ssm.implicit_attention(comp))
        probs[(group.layer, group.kind)] = pattern.detach().float()

    return sink


def _reader_readout(engine: AblationEngine, by_group: Mapping[tuple[int, str], list[HeadId]],
                    inputs: Mapping[tuple[int, str], torch.Tensor],
                    probs: Mapping[tuple[int, str], torch.Tensor]
                    ) -> dict[HeadId, dict[str, float | None]]:
    """The readers' values from the captured out-projection inputs and attention probabilities."""
    from discovery.measure import metrics

    lm, batch = engine.lm, engine.batch
    rows = torch.arange(len(batch), device=engine.device)
    last = engine.n_active_layers - 1
    resid = engine.hidden[last][rows, batch.query_pos].float()  # clean final residual [batch, d_model]
    norm = lm.adapter.final_norm()
    scale = linearised_norm_scale(norm, resid)  # [batch, d_model]
    unembed = lm.adapter.unembed().weight.float()  # [vocab, d_model]
    out: dict[HeadId, dict[str, float | None]] = {}
    for (layer, kind), heads in by_group.items():
        group = engine.inventory.group(layer, kind)
        head_out = metrics.head_outputs(inputs[(layer, kind)], lm.adapter.out_proj_weight(layer, kind).float(),
                                        group.count, group.width)  # [batch, head, d_model]
        dla = metrics.dla(head_out * scale[:, None, :], unembed, batch.cand_first_token, batch.gold, None,
                          center=isinstance(norm, torch.nn.LayerNorm), cand_mask=batch.cand_mask)  # [batch, head]
        found = metrics.pattern_metrics(probs[(layer, kind)], batch) if (layer, kind) in probs else {}
        for h in heads:
            values: dict[str, float | None] = {"dla": _num(dla[:, h.index].mean())}
            for name in ("selectivity", *SELECTION_METRICS):
                values[name] = _num(torch.nanmean(found[name][:, h.index])) if name in found else None
            values["selection"] = selection(values) if found else None
            out[h] = values
    return out


def read_test(engine: AblationEngine, gathers: Sequence[HeadId], readers: Sequence[HeadId],
              thresholds: EvidenceThresholds | None = None, *, scope: Sequence[str] = ("segment",)) -> pl.DataFrame:
    """Knock out each gather candidate at ``scope`` (default: the segment positions) and watch every
    reader in a later layer: its selectivity and ``agg_select`` (attention readers) and its direct logit
    effect at the query (final norm frozen at the clean run). One row per (gather, reader) pair;
    ``reads`` is true when the reader's direct effect falls by ``thresholds.read`` of its clean value
    (which must itself be >= noise * clean logit difference) or its selectivity / selection
    (:func:`~discovery.metrics.selection`) falls by ``thresholds.read_select``."""
    th = thresholds or EvidenceThresholds()
    clean_ld = float(engine.clean.logit_diff.mean())
    pairs = [(g, r) for g in gathers for r in readers if r.layer > g.layer and r.layer < engine.n_active_layers]
    columns = ["gather", "reader", "select_clean", "select_ablated", "agg_select_clean", "agg_select_ablated",
               "dla_clean", "dla_ablated", "dla_drop", "reads"]
    if not pairs:
        return pl.DataFrame(schema={c: (pl.Utf8 if c in ("gather", "reader") else
                                        pl.Boolean if c == "reads" else pl.Float64) for c in columns})
    watch = sorted({r for _, r in pairs})
    clean = _reader_values(engine, watch, None)
    rows = []
    for g in sorted({g for g, _ in pairs}):
        mine = [r for gg, r in pairs if gg == g]
        under = _reader_values(engine, mine, Ablation((g,), "zero", tuple(scope), label=f"read:{g}"))
        for r in mine:
            c, u = clean[r], under[r]
            dla_drop = None
            if c["dla"] is not None and u["dla"] is not None and c["dla"] > max(th.noise * clean_ld, 1e-9):
                dla_drop = (c["dla"] - u["dla"]) / c["dla"]
            sel_fall = [c[k] - u[k] for k in ("selectivity", "selection") if c[k] is not None and u[k] is not None]
            reads = (dla_drop is not None and dla_drop >= th.read) or any(f >= th.read_select for f in sel_fall)
            rows.append({"gather": str(g), "reader": str(r), "select_clean": c["selectivity"],
                         "select_ablated": u["selectivity"], "agg_select_clean": c["agg_select"],
                         "agg_select_ablated": u["agg_select"], "dla_clean": c["dla"], "dla_ablated": u["dla"],
                         "dla_drop": dla_drop, "reads": bool(reads)})
    return pl.DataFrame(rows, schema_overrides={c: pl.Float64 for c in columns[2:-1]}, infer_schema_length=None)


# ---------------------------------------------------------------------------------------------
# 4. Verdicts
# ---------------------------------------------------------------------------------------------


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


def _where(row: Mapping[str, Any], th: EvidenceThresholds, ref: float, prefix: str = "") -> str:
    """Where a head's all-position drop lives: query, summary tokens, segments, elsewhere, or none (a drop
    under ``noise`` of ``ref``, the clean logit difference)."""
    total = _num(row.get(f"{prefix}d_ld_all"))
    if total is None or ref <= 0 or -total < th.noise * ref:
        return "none"
    shares = {name: (_num(row.get(f"{prefix}d_ld_{scope}")) or 0.0) / total
              for name, scope in (("query", "query"), ("summary tokens", "summary"), ("segments", "segment"))}
    for name in ("query", "summary tokens", "segments"):
        if shares[name] >= th.located:
            return name
    return "elsewhere"


def verdicts(frame: pl.DataFrame, groups: pl.DataFrame | None, thresholds: EvidenceThresholds | None = None, *,
             clean: Mapping[str, float], reads: pl.DataFrame | None = None,
             minimal: Mapping[str, Any] | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
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
      difference or with an interval including 0), in the minimal model too, and no group credit;
    - ``none``: the rest.

    Group credit: a member of a significant group is credited when sparing it alone restores at least
    ``noise`` of the clean logit difference; when a significant role group of two or more heads credits
    nobody (an effect too spread to resolve), every member shares it ("jointly").

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
            if not g["credited"] and g["n"] >= 2 and g["role"] in ("aggregate", "gather"):
                # too spread for the spare-one test to resolve: every member shares the joint effect
                for h in g["heads"]:
                    credits.setdefault(h, []).append(f"{g['group']} (jointly)")
    read_by: dict[str, list[dict[str, Any]]] = {}
    for r in reads.iter_rows(named=True) if reads.height else []:
        if r["reads"]:
            read_by.setdefault(r["gather"], []).append(r)

    task_done = clean_ld > 0 and clean.get("acc", 1.0) - clean.get("chance", 0.0) >= th.min_margin
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
                     and not any(e.some(mm_ld, th.noise) for e in mm.values()) and not mine)
        info[name] = {"head": h, "agg_pattern": agg_pattern, "gather_pattern": gather_pattern, "q_single": q_single,
                      "q_group": q_group, "s_single": s_single, "s_group": s_group, "any_effect": any_effect,
                      "no_effect": no_effect, "credits": mine, "row": row, "sel_ok": sel_ok}

    # aggregate first: gather needs a later aggregate head that reads it
    for name, v in info.items():
        v["role"] = "aggregate" if task_done and v["agg_pattern"] and (v["q_single"] or v["q_group"]) else None
    aggregate_names = {n for n, v in info.items() if v["role"] == "aggregate"}
    for name, v in info.items():
        if v["role"] or not task_done:
            continue
        readers = [r for r in read_by.get(name, []) if r["reader"] in aggregate_names]
        v["readers"] = readers
        if v["gather_pattern"] and (v["s_single"] or v["s_group"]) and readers:
            v["role"] = "gather"
    for name, v in info.items():
        if v["role"]:
            continue
        if task_done and (v["any_effect"] or v["credits"]):
            v["role"] = "other_important"
        elif (v["agg_pattern"] or v["gather_pattern"]) and v["no_effect"]:
            v["role"] = "decoy"
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
    verdict = _model_verdict(info, sig_groups, read_by, th, clean, task_done, frame, minimal)
    return roles, verdict


EVIDENCE_PATTERN_METRICS = ("selectivity", "agg_select", "agg_after", "gather_score", "gather_cross")
"""The pattern metrics an evidence line quotes, in this order."""


def _evidence_text(v: Mapping[str, Any], th: EvidenceThresholds, clean_ld: float, mm_ld: float) -> str:
    """One line: the pattern numbers, the effects per scope (share of clean), credits and readers."""
    row = v["row"]

    def eff(column: str, ref: float) -> str:
        e = _effect(row, column)
        if e.mean is None:
            return "n/a"
        share = f" ({-e.mean / ref:+.0%})" if ref > 0 else ""
        return f"{e.mean:+.2f} [{_fmt(e.lo)}, {_fmt(e.hi)}]{share}"

    # only the columns the table has: tables from before agg_after or gather_cross existed lack them
    parts = [", ".join(f"{name} {_fmt(_num(row[name]))}" for name in EVIDENCE_PATTERN_METRICS if name in row)]
    parts.append("d_ld " + ", ".join(f"{s} {eff(f'd_ld_{s}', clean_ld)}" for s in SCOPE_ABLATIONS
                                     if f"d_ld_{s}" in row) + f" of clean {clean_ld:.2f}")
    if "mm_d_ld_all" in row:
        parts.append("minimal model " + ", ".join(f"{s} {eff(f'mm_d_ld_{s}', mm_ld)}" for s in MINIMAL_SCOPES
                                                   if f"mm_d_ld_{s}" in row))
    if v["credits"]:
        parts.append("needed by group " + ", ".join(v["credits"]))
    if v.get("readers"):
        parts.append("read by " + ", ".join(f"{r['reader']} ({_direct_change(r['dla_drop'])}, "
                                            f"selectivity {_fmt(r['select_clean'])}->{_fmt(r['select_ablated'])})"
                                            for r in v["readers"]))
    if v["role"] == "decoy":
        parts.append(f"pattern without effect: every |effect| < {th.noise:.0%} of clean or interval includes 0")
    return "; ".join(parts)


def _model_verdict(info: Mapping[str, Mapping[str, Any]], sig_groups: list[dict[str, Any]],
                   read_by: Mapping[str, list[dict[str, Any]]], th: EvidenceThresholds, clean: Mapping[str, float],
                   task_done: bool, frame: pl.DataFrame, minimal: Mapping[str, Any] | None) -> dict[str, Any]:
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
    if not task_done:
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


# ---------------------------------------------------------------------------------------------
# 5. One task's evidence, for the scan
# ---------------------------------------------------------------------------------------------


@dataclass
class EvidenceReport:
    """Everything :func:`evidence_report` found for one task."""

    summary: dict[str, Any]  # for summary.json: verdict, roles, depth_profile, groups, thresholds
    heads: pl.DataFrame  # per head: effects per scope, minimal-model effects, role and evidence
    groups: pl.DataFrame  # group ablations with controls
    profile: pl.DataFrame  # depth profile
    reads: pl.DataFrame = field(default_factory=pl.DataFrame)  # read tests

    def write(self, out_dir: str | Path, suffix: str = "") -> Path:
        """Write ``evidence{suffix}.parquet``, ``evidence_groups{suffix}.parquet``,
        ``evidence_depth{suffix}.parquet`` and ``evidence_reads{suffix}.parquet`` atomically."""
        from discovery.io import write_parquet

        out = Path(out_dir)
        write_parquet(out / f"evidence{suffix}.parquet", self.heads)
        write_parquet(out / f"evidence_groups{suffix}.parquet", self.groups)
        write_parquet(out / f"evidence_depth{suffix}.parquet", self.profile)
        write_parquet(out / f"evidence_reads{suffix}.parquet", self.reads)
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def evidence_report(lm: LoadedModel, batch: AnnotatedBatch, frame: pl.DataFrame,
                    thresholds: EvidenceThresholds | None = None, *, engine: AblationEngine | None = None,
                    bootstrap: int = 1000, seed: int = 0, max_memory_mb: float | None = None,
                    progress: Progress | None = None) -> EvidenceReport:
    """Position-resolved effects, the minimal model, group ablations, read tests and verdicts for one
    task of a scan.

    ``frame`` is the scan's head table for this task (``scan_task``'s first result): its pattern metrics
    are used as they are; effect columns it already has (``d_*_all``, ``d_*_query``) are kept and only
    the missing scopes are run. ``engine`` may be the scan's engine for the same batch (saves its clean
    pass). Every head of ``frame`` is tested; groups and controls draw from the whole model.
    """
    th = thresholds or EvidenceThresholds()
    _check_candidates(batch)
    tasks = frame["task"].unique().to_list() if "task" in frame.columns and frame.height else []
    if len(tasks) > 1:
        raise GascanError(f"the head table holds {len(tasks)} tasks", "pass one task's rows (one batch is one task)")
    missing = [c for c in ("selectivity", "agg_select", "gather_score") if c not in frame.columns]
    if missing:
        raise GascanError(f"the head table has no {missing[0]} column", "scan with the pattern pass enabled")
    engine = engine or AblationEngine(lm, batch, max_memory_mb=max_memory_mb)
    clean = _clean(engine)
    heads = _heads_of(frame)

    have = [s for s in SCOPE_ABLATIONS if all(f"d_{short}_{s}{end}" in frame.columns
                                               for short in SHORT.values() for end in ("", "_lo", "_hi"))]
    todo = [s for s in SCOPE_ABLATIONS if s not in have]
    table = frame
    if todo:
        effects = position_effects(engine, heads, scopes=todo, bootstrap=bootstrap, seed=seed, progress=progress)
        table = table.join(effects, on=["layer", "head", "kind"], how="left")

    profile = depth_profile(lm, batch)
    depth = minimal_depth(profile, th)
    minimal: dict[str, Any] = {"depth": depth, "n_layers": lm.inventory.n_layers, "metric": th.depth_metric,
                               "keep": th.keep}
    if depth is not None and depth < lm.inventory.n_layers:
        mm, mm_clean = minimal_model_effects(lm, batch, depth, [h for h in heads if h.layer < depth],
                                             bootstrap=bootstrap, seed=seed, max_memory_mb=max_memory_mb,
                                             progress=progress)
        table = table.join(mm, on=["layer", "head", "kind"], how="left")
        clean["mm_logit_diff"] = mm_clean["logit_diff"]
        minimal["clean"] = mm_clean
    elif depth is not None:  # the minimal model is the whole model: its effects are the full ones
        for s in MINIMAL_SCOPES:
            for end in ("", "_lo", "_hi"):
                table = table.with_columns(pl.col(f"d_ld_{s}{end}").alias(f"mm_d_ld_{s}{end}"))
        clean["mm_logit_diff"] = clean["logit_diff"]
        minimal["clean"] = {k: v for k, v in clean.items() if k != "mm_logit_diff"}

    groups = group_ablations(engine, table, th, bootstrap=bootstrap, seed=seed, progress=progress)
    # first pass: which heads aggregate; then read tests of gather candidates against them
    roles, _ = verdicts(table, groups, th, clean=clean, minimal=minimal)
    aggregates = [HeadId(r["layer"], r["head"], r["kind"]) for r in roles.iter_rows(named=True)
                  if r["role"] == "aggregate"]
    pre = {r["name"]: r for r in roles.iter_rows(named=True)}
    candidates = []
    for row in table.iter_rows(named=True):
        h = HeadId(int(row["layer"]), int(row["head"]), str(row["kind"]))
        gs = _num(row.get("gather_score"))
        seg = lives_at(row, "segment", th, clean["logit_diff"], clean.get("mm_logit_diff"))
        credited = "gatherers" in (pre[str(h)]["credited_by"] or "")
        if gs is not None and gs >= th.gather_score and (seg or credited) and any(a.layer > h.layer for a in aggregates):
            candidates.append(h)
    if progress:
        progress("read tests", 0, len(candidates))
    reads = read_test(engine, candidates, aggregates, th)
    if progress:
        progress("read tests", len(candidates), len(candidates))
    roles, verdict = verdicts(table, groups, th, clean=clean, reads=reads, minimal=minimal)
    heads_out = table.join(roles.drop("name"), on=["layer", "head", "kind"], how="left")
    if tasks:  # name the task in every table, so several tasks' tables concatenate
        groups, profile, reads = (f.with_columns(pl.lit(tasks[0]).alias("task")) for f in (groups, profile, reads))
    summary = {
        "verdict": verdict["verdict"],
        "reason": verdict["reason"],
        "details": verdict,
        "roles": [{"head": r["name"], "layer": r["layer"], "index": r["head"], "kind": r["kind"], "role": r["role"],
                   "where": r["where"], "evidence": r["evidence"]}
                  for r in roles.iter_rows(named=True) if r["role"] != "none"],
        "depth_profile": profile.to_dicts(),
        "minimal_model": minimal,
        "groups": groups.to_dicts(),
        "reads": reads.to_dicts(),
        "thresholds": th.as_dict(),
    }
    return EvidenceReport(_jsonable(summary), heads_out, groups, profile, reads)


def scan_evidence(lm: LoadedModel, heads: pl.DataFrame, summary: Mapping[str, Any],
                  thresholds: EvidenceThresholds | None = None, **kwargs: Any
                  ) -> tuple[dict[str, pl.DataFrame], dict[str, Any]]:
    """:func:`evidence_report` for every task of a finished scan (``heads.parquet`` + ``summary.json``),
    each task's batch rebuilt exactly as the scan built it. Returns the tables of all tasks concatenated
    (``evidence``, ``evidence_groups``, ``evidence_depth``, ``evidence_reads``; each row names its task)
    and the summary field ``{"evidence": {task: report summary}}``."""
    from discovery.tasks import build_task
    from discovery.tasks.base import annotate

    tables: dict[str, list[pl.DataFrame]] = {"evidence": [], "evidence_groups": [], "evidence_depth": [],
                                             "evidence_reads": []}
    per_task: dict[str, Any] = {}
    options = summary.get("options") or {}
    for task, info in (summary.get("tasks") or {}).items():
        task_options = dict(info.get("options") or {})
        prompts = build_task(task, task_options).prompts()
        max_len = getattr(lm.model.config, "max_position_embeddings", None)
        batch = annotate(prompts, lm.tokenizer, padding_side="left", max_length=max_len)
        frame = heads.filter(pl.col("task") == task) if "task" in heads.columns else heads
        kwargs.setdefault("bootstrap", int(options.get("bootstrap", 1000)))
        kwargs.setdefault("max_memory_mb", options.get("max_memory_mb"))
        report = evidence_report(lm, batch, frame, thresholds, seed=int(task_options.get("seed", 0)), **kwargs)
        per_task[task] = report.summary
        for name, table in (("evidence", report.heads), ("evidence_groups", report.groups),
                            ("evidence_depth", report.profile), ("evidence_reads", report.reads)):
            if table.height:
                tables[name].append(table)
    merged = {name: pl.concat(parts, how="diagonal_relaxed") if parts else pl.DataFrame()
              for name, parts in tables.items()}
    return merged, {"evidence": per_task}
