"""The sweep stage: per task the pattern pass, direct logit attribution, the attribution screen and the
chosen ablation sweep over every head, as one head table (``heads.parquet``) and the scan summary.

``scan_task`` takes a layer range so the batch layer can shard a model's heads over workers and merge
the tables afterwards; :mod:`pipelines.pipeline` puts this stage first.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import polars as pl
import torch

from discovery.errors import GascanError
from discovery.heads import HeadGroup, HeadId
from discovery.measure.ablation import AblationEngine, Progress, single_head_ablations, stage_ticker
from discovery.measure.attribution import atp_effects, rank_agreement
from discovery.measure.cost import Cost, Meter
from discovery.measure.dla import head_dla
from discovery.measure.engines import EngineCache
from discovery.model.loading import LoadedModel
from discovery.stats import bootstrap_ci
from discovery.tasks import build_task
from discovery.tasks.base import AnnotatedBatch, annotate
from pipelines.options import TABLE_VERSION, ScanOptions, resolve_ablation

EFFECT_METRICS = {"logit_diff": "ld", "acc": "acc", "gold_logprob": "lp"}
# ablation mode -> the single-head sweeps it runs: (scope name, position classes)
SWEEPS: dict[str, list[tuple[str, tuple[str, ...]]]] = {"exact": [("all", ("all",)), ("query", ("query",))],
                                                        "query": [("query", ("query",))]}
# (--ablation screened runs the screen, then the all-position sweep on the screen's top-k: _screened_sweep)



def task_batch(lm: LoadedModel, task_spec: str, options: dict[str, Any]) -> AnnotatedBatch:
    """The task's prompts, annotated for this model's tokenizer (left-padded, checked against context)."""
    task = build_task(task_spec, options)
    prompts = task.prompts()
    max_len = getattr(lm.model.config, "max_position_embeddings", None)
    batch = annotate(prompts, lm.tokenizer, padding_side="left", max_length=max_len)
    first = batch.cand_first_token  # [batch, cand]
    mask = batch.cand_mask if batch.cand_mask is not None else torch.ones_like(first, dtype=torch.bool)
    for row in range(first.shape[0]):
        tokens = first[row][mask[row]].tolist()
        if len(set(tokens)) != len(tokens):
            raise GascanError(
                f"the candidates of {task_spec} prompt {row} start with the same token in this tokenizer, so "
                "ablation effects (scored on the candidates' first tokens) would be meaningless",
                "use candidates that start differently (e.g. --task-option query_space=true for kv style=named)")
    return batch


def _depth(layer: int, n_layers: int) -> float:
    return layer / (n_layers - 1) if n_layers > 1 else 0.0


def _pattern_metrics(lm: LoadedModel, batch: AnnotatedBatch, groups: list[HeadGroup], chunk: int,
                     progress: Progress | None, engine: AblationEngine
                     ) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Per group, per metric: the per-head mean over prompts ``[head]`` (NaN where undefined)."""
    from discovery.measure import metrics
    from discovery.measure.patterns import pattern_metric_values

    tick = stage_ticker(progress, "patterns", len(groups) * math.ceil(len(batch) / chunk))
    values = pattern_metric_values(lm, batch, layers=sorted({g.layer for g in groups}),
                                   kinds=sorted({g.kind for g in groups}), chunk_prompts=chunk,
                                   on_chunk=lambda: tick(1), engine=engine)
    return {key: metrics.summarise(named) for key, named in values.items()}


def _effect_columns(columns: dict[HeadId, dict[str, Any]], heads: Sequence[HeadId], scope_name: str,
                    effects: Any, options: ScanOptions) -> None:
    """Each head's mean effect per metric at ``scope_name`` with its bootstrap interval, into ``columns``."""
    for metric, short in EFFECT_METRICS.items():
        mean, lo, hi = bootstrap_ci(effects[metric], options.bootstrap, seed=options.seed)
        for i, h in enumerate(heads):
            columns[h][f"d_{short}_{scope_name}"] = mean[i].item()
            columns[h][f"d_{short}_{scope_name}_lo"] = lo[i].item()
            columns[h][f"d_{short}_{scope_name}_hi"] = hi[i].item()


def scan_task(lm: LoadedModel, task_spec: str, options: ScanOptions, *, layers: Sequence[int] | None = None,
              progress: Progress | None = None, engines: EngineCache | None = None
              ) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Scan one task on the heads of ``layers`` (default all): the head table rows and task summary.

    The summary's ``forward_flops`` is the matmul FLOPs of one clean forward over the task's prompts (the
    unit of forward-equivalents) and ``parts`` the cost of each part: clean forward, patterns (with direct
    logit attribution), each ablation sweep, the attribution screen, the Mamba-1 channel refinement. ``engines``:
    keeps the task's engine (its clean pass) for the later stages of the same process."""
    inv = lm.inventory
    requested = options.ablation
    options = replace(options, ablation=resolve_ablation(requested, [h.layer for h in inv.heads()], inv.n_layers,
                                                         sharded=layers is not None))
    with Meter() as total:
        batch = task_batch(lm, task_spec, options.options_for(task_spec))
        wanted = set(range(inv.n_layers) if layers is None else layers)
        groups = [g for g in inv.groups if g.layer in wanted]
        heads = [h for g in groups for h in g.heads()]
        parts: dict[str, Cost] = {}
        with Meter() as meter:
            engine = (engines.engine(task_spec, lm, batch, max_memory_mb=options.max_memory_mb) if engines is not None
                      else AblationEngine(lm, batch, max_memory_mb=options.max_memory_mb))
        parts["clean"] = meter.cost
        clean = {m: float(engine.clean[m].mean()) for m in EFFECT_METRICS}
        columns: dict[HeadId, dict[str, Any]] = {h: {} for h in heads}

        if progress:
            progress("patterns", 0, 1)
        with Meter() as meter:
            pattern_values = _pattern_metrics(lm, batch, groups, options.chunk_prompts, progress, engine)
            dla_values = head_dla(lm, batch, groups, engine)
        parts["patterns"] = meter.cost
        for g in groups:
            for h in g.heads():
                for name, values in pattern_values[(g.layer, g.kind)].items():
                    columns[h][name] = values[h.index].item()
                columns[h]["dla"] = dla_values[(g.layer, g.kind)][h.index].item()

        measured = {}
        for scope_name, scope in SWEEPS.get(options.ablation, []):
            ablations = single_head_ablations(heads, "zero", scope)
            tick = stage_ticker(progress, f"ablation ({scope_name})", len(ablations))
            with Meter() as meter:
                measured[scope_name] = engine.effects(ablations, engine.run(ablations, progress=tick))
            parts[f"ablation_{scope_name}"] = meter.cost
            _effect_columns(columns, heads, scope_name, measured[scope_name], options)
        screened = None
        if options.ablation == "screened":
            screened = _screened_sweep(lm, batch, engine, heads, columns, options, parts, measured, progress)
        sweep_rows = engine.layer_rows

        screen = None
        if screened and screened["screen"] == "atp_qk":  # the report's screen line: agreement on the swept heads
            screen = {"method": "AtP with the QK fix, zero ablation at all positions, logit difference "
                      f"(screen of --ablation screened: exact sweep on its top {screened['k']})",
                      "forward_equivalents": screened["forward_equivalents"], "agreement": screened["agreement"]}
        if options.ablation in ("exact", "query", "atp"):
            # AtP with the QK fix: every head's all-position zero-ablation effect, ~3.5 forward-equivalents
            if progress:
                progress("attribution", 0, 1)
            with Meter() as meter:
                result = atp_effects(lm, batch, heads=heads, method="zero", scope=("all",), metric="logit_diff",
                                     qk_fix=True)
            parts["attribution"] = meter.cost
            estimate = result.estimate.mean(-1)  # [head]
            if progress:
                progress("attribution", 1, 1)
            for i, h in enumerate(result.heads):
                columns[h]["atp_ld"] = estimate[i].item()
            screen = {"method": "AtP with the QK fix, zero ablation at all positions, logit difference",
                      "forward_equivalents": round(result.forward_equivalents, 3), "agreement": None}
            if options.ablation == "exact":  # the exact sweep ran on the same ablation: how well does AtP rank heads?
                exact = torch.tensor([columns[h]["d_ld_all"] for h in result.heads])
                screen["agreement"] = rank_agreement(estimate, exact, k=min(10, len(heads)))

        with Meter() as meter:
            refined, refinement = refine_stage(engine, heads, measured, columns, options, progress)
        if refinement.get("status") == "done":
            parts["refinement"] = meter.cost
        rows = []
        checkpoint = lm.checkpoint_hash()
        for h in [*heads, *refined]:
            start, end, parent = refined.get(h, (None, None, None))
            row = {"model": lm.name, "checkpoint": checkpoint, "task": task_spec, "layer": h.layer, "head": h.index,
                   "kind": h.kind, "depth": _depth(h.layer, inv.n_layers), "channel_start": start,
                   "channel_end": end, "parent_head": parent}
            for key, value in columns[h].items():
                row[key] = None if value is None or (isinstance(value, float) and math.isnan(value)) else value
            rows.append(row)
        frame = pl.DataFrame(rows, infer_schema_length=None).with_columns(
            pl.col("channel_start", "channel_end", "parent_head").cast(pl.Int64))
    unit = parts["clean"].flops
    summary = {"task": task_spec, "options": options.options_for(task_spec), "ablation": options.ablation,
               "ablation_requested": requested, "n_prompts": len(batch),
               "clean": clean, "seconds": round(total.cost.wall_s, 2), "screen": screened,
               "layer_rows": sweep_rows, "attribution": screen, "refinement": refinement, "forward_flops": unit,
               "cost": total.cost.record(unit), "parts": {k: c.record(unit) for k, c in parts.items()}}
    return frame, summary


def _screened_sweep(lm: LoadedModel, batch: AnnotatedBatch, engine: AblationEngine, heads: list[HeadId],
                    columns: dict[HeadId, dict[str, Any]], options: ScanOptions, parts: dict[str, Cost],
                    measured: dict[str, Any], progress: Progress | None) -> dict[str, Any]:
    """``--ablation screened``: the default screen (:data:`~discovery.measure.recall.DEFAULT_SCREEN`) over every
    head, then the exact all-position sweep on its top-k only; the other heads' ``d_*_all`` columns are null.
    Returns the summary's ``screen`` record: screen, k, the screened heads, cost, and the screen's agreement
    with the exact sweep on those heads."""
    from discovery.measure.recall import DEFAULT_SCREEN, SCREEN_NAMES, screen_scores

    choice = DEFAULT_SCREEN
    if progress:
        progress(f"screen ({choice.screen})", 0, 1)
    with Meter() as meter:
        score, source = screen_scores(lm, batch, engine, heads, choice.screen)  # [head]
    parts["screen"] = meter.cost
    if progress:
        progress(f"screen ({choice.screen})", 1, 1)
    if choice.screen == "query":  # the query sweep is exact at the query: its columns are the usual ones
        _effect_columns(columns, heads, "query", source, options)
    else:  # AtP with the QK fix is the sweep's usual atp_ld column
        column = "atp_ld" if choice.screen == "atp_qk" else f"screen_{choice.screen}"
        for h, value in zip(heads, score.tolist(), strict=True):
            columns[h][column] = value
    k = min(choice.k, len(heads))
    rows = sorted(torch.argsort(-score.abs(), stable=True)[:k].tolist())
    chosen = [heads[i] for i in rows]
    ablations = single_head_ablations(chosen, "zero", ("all",))
    tick = stage_ticker(progress, "ablation (all, screened)", len(ablations))
    with Meter() as meter:
        measured["all"] = engine.effects(ablations, engine.run(ablations, progress=tick))
    parts["ablation_all"] = meter.cost
    _effect_columns(columns, chosen, "all", measured["all"], options)
    kept = set(chosen)
    for h in heads:
        if h not in kept:
            for short in EFFECT_METRICS.values():
                for end in ("", "_lo", "_hi"):
                    columns[h][f"d_{short}_all{end}"] = None
    exact = measured["all"].logit_diff.float().mean(-1)  # [k]
    unit = parts["clean"].flops
    return {"screen": choice.screen, "method": SCREEN_NAMES[choice.screen], "k": k, "n_heads": len(heads),
            "heads": [str(h) for h in chosen],
            "forward_equivalents": round(parts["screen"].flops / unit, 3) if unit else None,
            "exact_forward_equivalents": round(parts["ablation_all"].flops / unit, 3) if unit else None,
            "measured_recall": choice.measured,
            "agreement": rank_agreement(score[rows], exact, k=min(10, k))}


def refine_stage(engine: AblationEngine, heads: Sequence[HeadId], measured: dict[str, Any],
                 columns: dict[HeadId, dict[str, Any]], options: ScanOptions, progress: Progress | None = None
                 ) -> tuple[dict[HeadId, tuple[int, int, int]], dict[str, Any]]:
    """Mamba-1 channel refinement after the group sweep (:mod:`discovery.measure.refine`): the refined heads
    with ``(channel_start, channel_end, parent group head)``, their columns filled in ``columns`` like any
    swept head's (pattern metrics, DLA, every scope of the sweep), and the summary's ``refinement`` record
    (``status`` done or skipped, with the reason)."""
    from discovery.evidence.thresholds import EvidenceThresholds
    from discovery.measure.refine import RefineSettings, refine_channels, summary_fields

    inv = engine.inventory
    mamba1 = [g for g in inv.groups if g.pattern == "mamba1" and any(h.layer == g.layer for h in heads)]
    reason = None
    if not mamba1:
        reason = "no Mamba-1 layers"
    elif not options.refine_channels:
        reason = "turned off (--no-refine-channels)"
    elif not measured:
        reason = f"--ablation {options.ablation} measures no single-head effects to refine"
    elif options.ablation == "screened":
        reason = "--ablation screened sweeps only the screen's top heads (refine after an exact scan)"
    elif all(g.width == 1 for g in mamba1):
        reason = "the heads are single channels already (--mamba1-group-width 1)"
    if reason is not None:
        return {}, {"status": "skipped", "reason": reason}
    scope_name, scope = SWEEPS[options.ablation][0]
    th = EvidenceThresholds()
    settings = RefineSettings(effect=th.effect, scope=scope, bootstrap=options.bootstrap, seed=options.seed)
    index = {h: i for i, h in enumerate(heads)}
    starts = [h for g in mamba1 if g.width > 1 for h in g.heads() if h in index]
    effects = measured[scope_name]
    rows = [index[h] for h in starts]
    start_effects = type(effects)(*(effects[m][rows] for m in ("acc", "logit_diff", "gold_logprob")))
    if progress:
        progress("channel refinement", 0, 1)
    rows_before = engine.layer_rows
    ref = refine_channels(engine, starts, start_effects, settings)
    refined = {h: ref.leaf_node(h) for h in ref.leaves if h.index >= inv.group(h.layer, h.kind).count}
    out = {h: (n.start, n.end, n.group) for h, n in refined.items()}
    for h, n in refined.items():
        columns[h] = {k: v for k, v in n.metrics.items()}
    extra = list(refined)
    if extra:
        leaf_rows = [ref.leaves.index(h) for h in extra]
        _effect_columns(columns, extra, scope_name,
                        {m: ref.leaf_effects[m][leaf_rows] for m in EFFECT_METRICS}, options)
        for other_name, other_scope in SWEEPS[options.ablation][1:]:
            ablations = single_head_ablations(extra, "zero", other_scope)
            _effect_columns(columns, extra, other_name, engine.effects(ablations), options)
    fields = summary_fields(ref, engine, settings)
    # the tree's ablations plus the refined heads' other scopes, in forward-equivalents of this batch
    fields["forward_equivalents_with_scopes"] = round(
        (engine.layer_rows - rows_before) / (engine.n_prompts * engine.n_active_layers), 3)
    if progress:
        progress("channel refinement", 1, 1)
    return out, fields


def top_effects(frame: pl.DataFrame, k: int = 10) -> list[dict[str, Any]]:
    """The heads with the largest logit-difference drops (most negative effect), per task."""
    column = next((c for c in ("d_ld_all", "d_ld_query", "atp_ld") if c in frame.columns), None)
    if column is None:
        return []
    best = frame.filter(pl.col(column).is_not_null()).sort(column).head(k)
    return [{"task": r["task"], "layer": r["layer"], "head": r["head"], "kind": r["kind"], "effect": r[column],
             "effect_column": column} for r in best.iter_rows(named=True)]


def scan_model(lm: LoadedModel, options: ScanOptions, *, layers: Sequence[int] | None = None,
               progress: Progress | None = None) -> tuple[pl.DataFrame, dict[str, Any]]:
    """Scan every task of ``options``; one table for all tasks and the model summary."""
    frames, tasks = [], {}
    for task in options.tasks:
        frame, tasks[task] = scan_task(lm, task, options, layers=layers, progress=progress)
        frames.append(frame)
    return model_scan(lm, options, frames, tasks)


def model_scan(lm: LoadedModel, options: ScanOptions, frames: Sequence[pl.DataFrame],
               tasks: dict[str, dict[str, Any]]) -> tuple[pl.DataFrame, dict[str, Any]]:
    """The tasks' head tables as one table, and the model summary around their task summaries."""
    heads = pl.concat(list(frames), how="diagonal_relaxed") if frames else pl.DataFrame()
    summary = {
        "model": lm.name, "spec": lm.spec, "checkpoint": lm.checkpoint_hash(),
        "architecture": lm.inventory.architecture, "n_layers": lm.inventory.n_layers,
        "n_heads": lm.inventory.n_heads(), "options": options.as_dict(), "tasks": tasks,
        "top_effects": top_effects(heads), "table_version": TABLE_VERSION,
    }
    return heads, summary
