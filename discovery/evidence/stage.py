"""One task's evidence for the scan (:func:`evidence_report`), and every task of a finished scan
(:func:`scan_evidence`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import torch

from discovery.errors import GascanError
from discovery.evidence.budget import Ledger, candidate_counts, choose_candidates, fit, resolve_budget
from discovery.evidence.common import _clean, _heads_of, _num
from discovery.evidence.groups import group_ablations, role_groups
from discovery.evidence.minimal import depth_profile, minimal_depth, minimal_model_effects
from discovery.evidence.positions import position_effects
from discovery.evidence.reads import read_test, read_test_cost
from discovery.evidence.roles import lives_at, task_done, verdicts
from discovery.evidence.thresholds import MINIMAL_SCOPES, SCOPE_ABLATIONS, SHORT, EvidenceThresholds
from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine, Progress, single_head_ablations
from discovery.measure.engines import EngineCache
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch


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


def _strongest(frame: pl.DataFrame, clean_ld: float, th: EvidenceThresholds, heads: list[HeadId],
               n: int) -> list[HeadId]:
    """The ``n`` of ``heads`` the candidate rule ranks first (all of them when ``n`` covers them)."""
    if n >= len(heads):
        return list(heads)
    keep = set(heads)
    rows = [i for i, h in enumerate(_heads_of(frame)) if h in keep]
    return choose_candidates(frame[rows], clean_ld, th, n)[0]


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
                    progress: Progress | None = None, ledger: Ledger | None = None) -> EvidenceReport:
    """Position-resolved effects, the minimal model, group ablations, read tests and verdicts for one
    task of a scan.

    ``frame`` is the scan's head table for this task (``scan_task``'s first result): its pattern metrics
    are used as they are; effect columns it already has (``d_*_all``, ``d_*_query``) are kept and only
    the missing scopes are run. ``engine`` may be the scan's engine for the same batch (saves its clean
    pass). ``ledger`` (:class:`~discovery.evidence.budget.Ledger`) bounds the tests' cost: the heads tested beyond
    the sweep follow the candidate rule of :mod:`discovery.evidence.budget` (unbounded: every head of ``frame``);
    groups and controls draw from the whole model.
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
    ledger = ledger or Ledger(None)
    clean = _clean(engine)
    if not task_done(clean, th):
        return _not_done(frame, clean, th, ledger, tasks)
    heads = _heads_of(frame)

    have = [s for s in SCOPE_ABLATIONS if all(f"d_{short}_{s}{end}" in frame.columns
                                               for short in SHORT.values() for end in ("", "_lo", "_hi"))]
    todo = [s for s in SCOPE_ABLATIONS if s not in have]
    table = frame
    # the candidates: every head when unbounded, else the rule's strongest that the allowance affords
    allowed = ledger.allowance("position effects")
    limits = [None] if ledger.budget is None else [None, *candidate_counts(len(heads))]

    def tested(limit: int | None) -> list[HeadId]:
        return choose_candidates(frame, clean["logit_diff"], th, limit)[0]

    def position_cost(limit: int | None) -> float:
        return engine.predicted_forward_equivalents(
            [a for s in todo for a in single_head_ablations(tested(limit), *SCOPE_ABLATIONS[s])])

    limit, cost, fits = fit(limits, position_cost, allowed)
    candidates, why = choose_candidates(frame, clean["logit_diff"], th, limit)
    ledger.charge("position effects", allowed, cost, heads=len(candidates), of=len(heads), fits=fits)
    if todo:
        effects = position_effects(engine, candidates, scopes=todo, bootstrap=bootstrap, seed=seed, progress=progress)
        table = table.join(effects, on=["layer", "head", "kind"], how="left")
    chosen = {str(h) for h in candidates}
    table = table.with_columns(pl.Series("tested", [str(h) in chosen for h in heads], dtype=pl.Boolean),
                               pl.Series("tested_because", [why.get(h) if str(h) in chosen else None for h in heads],
                                         dtype=pl.Utf8))

    groups = group_ablations(engine, table, th, bootstrap=bootstrap, seed=seed, progress=progress, ledger=ledger)
    ran = set(groups["group"].to_list()) if groups.height else set()
    unresolved = frozenset(  # members of groups the budget left untested or unresolved: never decoys
        [str(h) for g in role_groups(table, th, clean_ld=clean["logit_diff"]) if g.name not in ran for h in g.heads]
        + [h for g in (groups.iter_rows(named=True) if groups.height else [])
           if g["significant"] and g["n"] >= 2 and g["marginal"] is None for h in g["heads"]])
    profile = depth_profile(lm, batch, engine)  # from the engine's clean pass: no forward of its own
    ledger.charge("depth profile", None, 0.0)
    depth = minimal_depth(profile, th)
    minimal: dict[str, Any] = {"depth": depth, "n_layers": lm.inventory.n_layers, "metric": th.depth_metric,
                               "keep": th.keep}
    if depth is not None and depth < lm.inventory.n_layers:
        mm_engine = AblationEngine(lm, batch, readout_layer=depth - 1, max_memory_mb=max_memory_mb)
        below = [h for h in candidates if h.layer < depth]
        allowed = ledger.allowance("minimal model")
        sizes = [len(below), *candidate_counts(len(below))]

        def mm_heads(n: int) -> list[HeadId]:
            return _strongest(frame, clean["logit_diff"], th, below, n)

        def mm_cost(n: int) -> float:
            return mm_engine.predicted_forward_equivalents(
                [a for s in MINIMAL_SCOPES for a in single_head_ablations(mm_heads(n), *SCOPE_ABLATIONS[s])])

        n_mm, cost, fits = fit(sizes or [0], mm_cost, allowed)
        ledger.charge("minimal model", allowed, cost + depth / lm.inventory.n_layers, heads=n_mm, of=len(below),
                      fits=fits)
        mm, mm_clean = minimal_model_effects(lm, batch, depth, mm_heads(n_mm), bootstrap=bootstrap, seed=seed,
                                             max_memory_mb=max_memory_mb, progress=progress, engine=mm_engine)
        table = table.join(mm, on=["layer", "head", "kind"], how="left")
        clean["mm_logit_diff"] = mm_clean["logit_diff"]
        minimal["clean"] = mm_clean
    elif depth is not None:  # the minimal model is the whole model: its effects are the full ones
        for s in MINIMAL_SCOPES:
            for end in ("", "_lo", "_hi"):
                table = table.with_columns(pl.col(f"d_ld_{s}{end}").alias(f"mm_d_ld_{s}{end}"))
        clean["mm_logit_diff"] = clean["logit_diff"]
        minimal["clean"] = {k: v for k, v in clean.items() if k != "mm_logit_diff"}

    # first pass: which heads aggregate; then read tests of gather candidates against them
    roles, _ = verdicts(table, groups, th, clean=clean, minimal=minimal, unresolved=unresolved)
    aggregates = [HeadId(r["layer"], r["head"], r["kind"]) for r in roles.iter_rows(named=True)
                  if r["role"] == "aggregate"]
    pre = {r["name"]: r for r in roles.iter_rows(named=True)}
    readers = []  # gather candidates for the read test, strongest gather pattern first
    for row in sorted(table.iter_rows(named=True), key=lambda r: -(_num(r.get("gather_score")) or 0.0)):
        h = HeadId(int(row["layer"]), int(row["head"]), str(row["kind"]))
        gs = _num(row.get("gather_score"))
        seg = lives_at(row, "segment", th, clean["logit_diff"], clean.get("mm_logit_diff"))
        credited = "gatherers" in (pre[str(h)]["credited_by"] or "")
        if gs is not None and gs >= th.gather_score and (seg or credited) and any(a.layer > h.layer for a in aggregates):
            readers.append(h)
    # the read tests are never cut: a pass per gather candidate, and without them no head can be a gather head
    gathers = readers
    ledger.charge("read tests", ledger.allowance("read tests"), read_test_cost(engine, gathers, aggregates),
                  gathers=len(gathers))
    if progress:
        progress("read tests", 0, len(gathers))
    reads = read_test(engine, gathers, aggregates, th)
    if progress:
        progress("read tests", len(gathers), len(gathers))
    roles, verdict = verdicts(table, groups, th, clean=clean, reads=reads, minimal=minimal, unresolved=unresolved)
    return _evidence(table, roles, verdict, groups, profile, reads, minimal, th, ledger, heads, chosen, tasks)


def _not_done(frame: pl.DataFrame, clean: Mapping[str, float], th: EvidenceThresholds, ledger: Ledger,
              tasks: list[str]) -> EvidenceReport:
    """The evidence of a task the model does not do: no test runs (with no task done, no head can get a G&A
    role, and rule 4 of the verdict says "no G&A here" whatever the tests show), every head keeps its sweep
    effects only, and the summary says why nothing was tested."""
    table = frame.with_columns(pl.lit(False).alias("tested"), pl.lit(None, dtype=pl.Utf8).alias("tested_because"))
    roles, verdict = verdicts(table, None, th, clean=clean)
    report = _evidence(table, roles, verdict, pl.DataFrame(), pl.DataFrame(), pl.DataFrame(), {}, th, ledger,
                       _heads_of(frame), set(), tasks)
    report.summary["task_done"] = False
    report.summary["skipped"] = (f"{verdict['reason']}; the evidence and pair tests did not run (they explain an "
                                 "effect the model does not show)")
    return report


def _evidence(table: pl.DataFrame, roles: pl.DataFrame, verdict: Mapping[str, Any], groups: pl.DataFrame,
              profile: pl.DataFrame, reads: pl.DataFrame, minimal: Mapping[str, Any], th: EvidenceThresholds,
              ledger: Ledger, heads: list[HeadId], chosen: set[str], tasks: list[str]) -> EvidenceReport:
    """The stage's tables and summary field for one task, from the roles :func:`verdicts` gave."""
    heads_out = table.join(roles.drop("name"), on=["layer", "head", "kind"], how="left")
    if tasks:  # name the task in every table, so several tasks' tables concatenate
        groups, profile, reads = (f.with_columns(pl.lit(tasks[0]).alias("task")) if f.width else f
                                  for f in (groups, profile, reads))
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
        "budget": ledger.record(),
        "untested": [str(h) for h in heads if str(h) not in chosen],
    }
    return EvidenceReport(_jsonable(summary), heads_out, groups, profile, reads)


def scan_evidence(lm: LoadedModel, heads: pl.DataFrame, summary: Mapping[str, Any],
                  thresholds: EvidenceThresholds | None = None, *, budget: tuple[str, float | None] = ("auto", None),
                  engines: EngineCache | None = None, **kwargs: Any) -> tuple[dict[str, pl.DataFrame], dict[str, Any]]:
    """:func:`evidence_report` for every task of a finished scan (``heads.parquet`` + ``summary.json``),
    each task's batch rebuilt exactly as the scan built it. Returns the tables of all tasks concatenated
    (``evidence``, ``evidence_groups``, ``evidence_depth``, ``evidence_reads``; each row names its task)
    and the summary field ``{"evidence": {task: report summary}}``. ``budget``: the parsed ``--budget``
    (:func:`~discovery.evidence.budget.resolve_budget`), one budget per task. ``engines``: the process's engines
    (the sweep's clean pass, reused when the batch is the same)."""
    from discovery.artifacts import restore_refined
    from discovery.tasks import build_task
    from discovery.tasks.base import annotate

    restore_refined(lm.inventory, heads)  # the sweep's refined channel heads, as the sweep numbered them
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
        fe = resolve_budget(*budget, [h.layer for h in lm.inventory.heads()], lm.inventory.n_layers, info)
        engine = engines.engine(task, lm, batch, max_memory_mb=kwargs["max_memory_mb"]) if engines is not None else None
        report = evidence_report(lm, batch, frame, thresholds, seed=int(task_options.get("seed", 0)),
                                 ledger=Ledger(fe), engine=engine, **kwargs)
        per_task[task] = report.summary
        for name, table in (("evidence", report.heads), ("evidence_groups", report.groups),
                            ("evidence_depth", report.profile), ("evidence_reads", report.reads)):
            if table.height:
                tables[name].append(table)
    merged = {name: pl.concat(parts, how="diagonal_relaxed") if parts else pl.DataFrame()
              for name, parts in tables.items()}
    return merged, {"evidence": per_task}
