"""The appendix in reading order: the verdict's reasons and pairs, roles, effects, decoys, then clean
scores, figures of every metric, the example pattern, placement advice and published heads."""
from __future__ import annotations

from typing import Any

import polars as pl

from discovery.artifacts import Scan, stage_rows
from discovery.rank.verdict import Verdict
from discovery.report.common import Figure, Section, Table, drop_ci, head_name, show_token
from discovery.report.example import example_for_report
from discovery.report.figures import (
    depth_profile_figure,
    heatmap_figure,
    minimal_depth_figure,
    pattern_figure,
)
from discovery.report.first_screen import marks, marks_legend
from discovery.report.sections import (
    classifier_section,
    decoys_section,
    refinement_section,
    roles_section,
    top_heads_section,
    verdict_section,
)


def clean_section(scan: Scan) -> Section:
    rows = []
    for task in scan.tasks:
        info = (scan.summary.get("tasks") or {}).get(task) or {}
        c = info.get("clean") or {}
        rows.append([task, info.get("n_prompts"), c.get("acc"), c.get("logit_diff"), c.get("gold_logprob"),
                     info.get("seconds")])
    return Section("Clean scores", tables=[Table(["task", "prompts", "accuracy", "logit diff", "gold log-prob",
                                                  "seconds"], rows)])


def cost_section(scan: Scan) -> Section | None:
    """What each stage cost (summary.json's stages); None for a scan from before stages were recorded."""
    def num(value: float | None, digits: int) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    rows = [[f"sweep: {name.strip()}" if name.startswith(" ") else name, num(wall, 2), num(fe, 1), num(peak, 0)]
            for name, wall, fe, peak in stage_rows(scan.summary)]
    if not rows:
        return None
    return Section("Cost per stage", [(
        "Wall seconds, forward-equivalents (counted matmul FLOPs over one clean forward over the scan's prompts) "
        "and peak memory in MiB (CUDA peak when the scan ran there, else the process's resident high-water mark) "
        "of each stage, then the sweep's parts. The report stage's own cost is recorded in summary.json once "
        "it is written.")], tables=[Table(["stage", "wall s", "forward-equivalents", "peak MiB"], rows)])


def budget_section(scan: Scan) -> Section | None:
    """The evidence budget per task: the rule, what each part was allowed and ran, and the untested heads."""
    from discovery.evidence.budget import DEFAULT_FACTOR, MIN_PASSES, SMALL_MODEL_BUDGET, SMALL_MODEL_FLOPS
    from discovery.report.first_screen import budget_cuts, budget_record, evidence_skipped

    rows, paragraphs, rule = [], [], ""
    for task in scan.tasks:
        record, untested = budget_record(scan, task)
        skipped = evidence_skipped(scan, task)
        if skipped:
            paragraphs.append(f"{task}: {skipped}.")
            continue
        if not record:
            continue
        for part in record.get("parts") or []:
            rows.append([task, part["part"], "–" if part.get("allowance") is None else f"{part['allowance']:.1f}",
                         f"{part['predicted']:.1f}", "yes" if part.get("fits", True) else "no (smallest plan ran)"])
        limit = record.get("budget")
        cuts = budget_cuts(record)
        paragraphs.append(
            f"{task}: budget {'none (every head tested)' if limit is None else f'{limit:.1f} forward-equivalents'}, "
            f"planned {record.get('spent', 0):.1f}. Cuts: {'; '.join(cuts) if cuts else 'none'}. Untested beyond "
            f"the sweep ({len(untested)}): " + (", ".join(untested[:60]) + (f" and {len(untested) - 60} more"
                                                                            if len(untested) > 60 else "")
                                               if untested else "none") + ".")
        rule = record.get("rule") or rule
    if not rows and not paragraphs:
        return None
    return Section("Evidence budget", [
        "The evidence and pair tests run within a budget of forward-equivalents per task (gascan scan --budget; "
        f"default {DEFAULT_FACTOR:g}x the exact all-position sweep, at least {MIN_PASSES} of its average single-head "
        f"passes, and {SMALL_MODEL_BUDGET:g} where that costs at most {SMALL_MODEL_FLOPS / 1e12:g} TFLOP). "
        f"Candidate rule: {rule}. Each part's allowance (its share plus what earlier parts left) and what it ran (predicted "
        "from the layers each ablation recomputes, one per pattern or read pass):", *paragraphs],
        tables=[Table(["task", "part", "allowance", "ran", "fits"], rows)])


def _rank_in(frame: pl.DataFrame, column: str, value: float | None) -> int | None:
    """1 + how many rows of ``frame`` score above ``value`` in ``column``."""
    if value is None or column not in frame.columns:
        return None
    return int((frame[column] > value).sum()) + 1


def published_section(heads: pl.DataFrame) -> Section | None:
    """Where the paper's G&A heads rank in this scan, when this model is one of the paper's."""
    from discovery.rank.classifier import label_rows, published_labels

    try:
        labels = published_labels()
    except (OSError, ValueError, KeyError):  # a broken install: report without this section
        return None
    labelled = label_rows(heads, labels)
    known = labelled.filter(pl.col("role_label").is_in(["gather", "aggregate"])) if labelled.height else labelled
    if known.height == 0:
        return None
    sec = Section("Published G&A heads (Bick et al. 2025)",
                  ["This model matches a checkpoint with published G&A heads; where they rank here:"])
    rows = []
    for r in known.iter_rows(named=True):
        task_rows = heads.filter(pl.col("task") == r["task"])
        column = f"p_{r['role_label']}"
        rows.append([r["task"], r["role_label"], head_name(r["layer"], r["head"], r["kind"]),
                     r.get(column), _rank_in(task_rows, column, r.get(column)), drop_ci(r, "d_ld_all")])
    sec.tables.append(Table(["task", "role", "head", "P(role)", "rank by P", "drop, all positions"], rows))
    return sec


def placement_section(scan: Scan, heads: pl.DataFrame) -> Section:
    """The placement ranking (discovery.rank.placement) with its scores; the evidence behind each choice is
    shown as this report's own columns (drop, role) rather than placement's reason text."""
    from discovery.rank.placement import default_budget, head_scores, place

    sec = Section("Where attention belongs (placement advice)")
    scores = head_scores(heads, scan.summary, scan.pairs)
    by_head = {(r["layer"], r["head"], r["kind"]): r for r in scores.iter_rows(named=True)} if scores.height else {}
    for unit in ("layer", "head"):
        budget = default_budget(scan.summary, unit)
        choices = place(heads, scan.summary, scan.pairs, budget=budget, unit=unit)
        if not choices:
            sec.paragraphs.append(f"No {unit}-level advice: the scan has no effects or probabilities to rank by.")
            continue
        rows = []
        for c in choices:
            best = ([h for h in by_head.values() if h["layer"] == c.layer] if c.unit == "layer" else
                    [by_head.get((c.layer, c.head, c.kind))])
            best = max((h for h in best if h), key=lambda h: h["score"], default=None)
            rows.append([c.name, c.action, c.score,
                         head_name(best["layer"], best["head"], best["kind"]) if best else "–",
                         (best["role"] if best else "–"), f"{best['role_evidence']:.2f}" if best else "–",
                         f"{best['importance']:+.2f}" if best else "–"])
        sec.tables.append(Table([f"{unit} (budget {budget})", "action", "score", "best head", "role",
                                 "role evidence", "drop / clean (clipped to 0–1)"], rows))
    sec.paragraphs.append("Score = 0.5 × role evidence + 0.5 × drop relative to the clean logit difference + a pair "
                          "bonus. The command gascan place DIR --budget K --unit head|layer gives other budgets.")
    return sec


def figure_sections(scan: Scan, heads: pl.DataFrame, n_layers: int, verdict: Verdict | None) -> list[Section]:
    """The depth profile (with the minimal model) and the layer × head maps of every metric."""
    profile = Section("G&A depth profile",
                      [("Per layer, the strongest gather evidence (gather score × all-position drop) and "
                        "aggregate evidence (agg select × query-position drop), drops relative to the clean "
                        "logit difference; and the largest classifier probabilities.")])
    png = minimal_depth_figure(scan)
    if png:
        profile.figures.append(Figure("minimal_model", "Minimal model: accuracy of the truncated model", png))
    shown = marks(verdict, heads)
    maps = Section("Layer × head maps of every metric",
                   [("Red = ablating the head lowers the logit difference (a positive drop: the head helps); blue: "
                     "raises it. " + marks_legend(verdict, shown))])
    for t, task in enumerate(scan.tasks):
        frame = heads.filter(pl.col("task") == task)
        png = depth_profile_figure(frame, n_layers, f"{task}")
        if png:
            profile.figures.append(Figure(f"depth_profile_{t}", f"G&A depth profile: {task}", png))
        for kind in ("attn", "ssm"):
            part = frame.filter(pl.col("kind") == kind)
            if part.height == 0:
                continue
            km = [(layer, head, text) for layer, head, k, text in shown.get(task, ()) if k == kind]
            title = f"{task}: {'attention' if kind == 'attn' else 'SSM'} heads"
            png = heatmap_figure(part, n_layers, title, km)
            if png:
                maps.figures.append(Figure(f"heatmap_{t}_{kind}", title, png))
    return [profile, maps]


def example_section(scan: Scan, heads: pl.DataFrame, lm: Any) -> Section:
    pattern = Section("Example attention patterns")
    example, note = example_for_report(scan, heads, lm)
    if example is None:
        pattern.paragraphs.append(f"Skipped: {note}.")
        return pattern
    png = pattern_figure(example)
    if png:
        pattern.figures.append(Figure("example_patterns", "Top gather and aggregate heads on an example prompt", png))
    pattern.paragraphs.append(f"Task {example['task']}, prompt {example['prompt_index']}; heads "
                              + ", ".join(f"{r} {n}" for r, n in zip(example["roles"], example["names"]))
                              + ". Tokens of the prompt:")
    pattern.preformatted.append(" | ".join(show_token(t) for t in example["tokens"]))
    return pattern


def build_appendix(scan: Scan, heads: pl.DataFrame, n_layers: int, verdict: Verdict | None, note: str,
                   lm: Any = None) -> list[Section]:
    sections = [verdict_section(scan, verdict, note)]
    roles = roles_section(scan, heads, verdict)
    if roles:
        sections.append(roles)
    sections += [top_heads_section(scan, heads), decoys_section(scan, heads, verdict)]
    refined = refinement_section(scan, heads)
    sections += ([refined] if refined else []) + [clean_section(scan)]
    sections += [s for s in (cost_section(scan), budget_section(scan)) if s is not None]
    sections += figure_sections(scan, heads, n_layers, verdict)
    sections += [example_section(scan, heads, lm), placement_section(scan, heads), classifier_section(scan, heads)]
    published = published_section(heads)
    if published:
        sections.append(published)
    return sections

