"""What a reader sees first: one line of model facts, the verdict, the effect map and the ranked heads.

The verdict is :class:`discovery.rank.verdict.Verdict`, read from ``summary.json``'s ``verdict`` field or
decided by :func:`discovery.rank.verdict.decide`; the report only renders it (outcome, sentence,
confidence, the heads it names) and never recomputes it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from discovery.artifacts import Scan, missing_stages
from discovery.evidence.roles import WHERE_SCOPES
from discovery.rank.verdict import Verdict, decide, drop
from discovery.report.common import Figure, Table, drop_ci, fmt, head_label, parse_head, signed
from discovery.report.figures import effect_map_figure

MAX_RANKED = 10
OUTCOME_WORDS = {"verified": "G&A verified", "ga_like": "G&A-like, not verified", "none": "no G&A",
                 "not_scored": "not scored"}
ROLE_ORDER = {"gather": 0, "aggregate": 1, "decoy": 2, "other_important": 3}


def scan_verdict(scan: Scan) -> tuple[Verdict | None, str]:
    """The scan's verdict and, when there is none, why: ``summary["verdict"]`` when the scan stored one,
    else :func:`decide` on the summary and the pair table."""
    stored = scan.summary.get("verdict")
    if isinstance(stored, Mapping):
        return Verdict.from_dict(stored), ""
    pairs = scan.pairs.to_dicts() if scan.pairs is not None else []
    try:
        return decide(scan.summary, pairs), ""
    except NotImplementedError as err:  # an install whose decide() is not written yet: report without it
        return None, f"no verdict: {err}"


@dataclass
class VerdictLine:
    task: str
    outcome: str  # OUTCOME_WORDS key
    words: str  # the outcome in words
    sentence: str
    confidence: str


@dataclass
class FirstScreen:
    title: str
    facts: str
    verdicts: list[VerdictLine] = field(default_factory=list)
    note: str = ""  # when there is no verdict
    figure: Figure | None = None
    figure_note: str = ""
    table: Table | None = None
    table_note: str = ""
    incomplete: str = ""  # the report's first line when stages of the scan did not finish


def incomplete_line(scan: Scan) -> str:
    """"Incomplete scan: ..." naming the stages that did not finish ("" for a complete scan). The report
    stage is being written, so it is not one of them."""
    missing = missing_stages(scan.summary, skip=("report",))
    if not missing:
        return ""
    names = ", ".join(missing)
    return (f"Incomplete scan: the {names} stage{'s' if len(missing) > 1 else ''} did not finish, so this report "
            f"lacks {'their' if len(missing) > 1 else 'its'} results. Rerun the same gascan scan command with this "
            "--out to resume.")


def facts_line(scan: Scan) -> str:
    """Model, architecture, size, and per task the clean accuracy and logit difference, in one line."""
    s = scan.summary
    n_heads = s.get("n_heads") or {}
    heads = ", ".join(f"{v} {'attention' if k == 'attn' else 'SSM' if k == 'ssm' else k} heads"
                      for k, v in n_heads.items() if v) or "? heads"
    parts = [str(s.get("architecture", "?")), f"{s.get('n_layers', '?')} layers", heads]
    for task in scan.tasks:
        c = scan.clean(task)
        chance = c.get("chance")
        acc = f"accuracy {fmt(c.get('acc'), 2)}" + (f" (chance {fmt(chance, 2)})" if chance is not None else "")
        parts.append(f"{task}: {acc}, clean logit diff {fmt(c.get('logit_diff'), 2)}")
    if s.get("checkpoint"):
        parts.append(f"checkpoint {str(s['checkpoint'])[:12]}")
    return " · ".join(parts)


def head_roles(verdict: Verdict | None, heads: pl.DataFrame) -> dict[tuple[str, int, int, str], str]:
    """(task, layer, head, kind) -> role: the verdict's gather/aggregate/decoy heads, else the evidence
    stage's ``role`` column."""
    out: dict[tuple[str, int, int, str], str] = {}
    if "role" in heads.columns:
        for r in heads.select("task", "layer", "head", "kind", "role").iter_rows():
            if r[4] and r[4] != "none":
                out[r[:4]] = r[4]
    for t in (verdict.tasks if verdict else ()):
        for role, names in (("decoy", t.decoys), ("aggregate", t.aggregate_heads), ("gather", t.gather_heads)):
            for name in names:
                h = parse_head(name)
                if h:
                    out[(t.task, *h)] = role
    return out


def refined_parents(heads: pl.DataFrame) -> dict[tuple[str, int, int, str], int]:
    """(task, layer, head, kind) of each refined Mamba-1 channel head -> the group head that holds it."""
    if "parent_head" not in heads.columns:
        return {}
    rows = heads.filter(pl.col("parent_head").is_not_null()).select("task", "layer", "head", "kind", "parent_head")
    return {r[:4]: int(r[4]) for r in rows.iter_rows()}


def marks(verdict: Verdict | None, heads: pl.DataFrame) -> dict[str, list[tuple[int, int, str, str]]]:
    """Per task the heads to mark on the effect map: the gather (G) and aggregate (A) heads the verdict's
    sentence names, in lower case (g, a) the other heads with those roles by the evidence standards (all in
    upper case when there is no verdict). A refined channel head is marked on the cell of the group
    that holds it, starred (``A*``); a group refined to channels that have no role gets ``c``."""
    parents = refined_parents(heads)
    cells: dict[tuple[str, int, int, str], set[str]] = {}
    for key, parent in parents.items():
        cells.setdefault((key[0], key[1], parent, key[3]), set()).add("c")
    named = {(t.task, *h) for t in (verdict.tasks if verdict else ()) for h in map(parse_head, t.named_heads) if h}
    for key, role in head_roles(verdict, heads).items():
        if role not in ("gather", "aggregate"):
            continue
        text = "G" if role == "gather" else "A"
        if verdict is not None and key not in named:
            text = text.lower()
        if key in parents:
            key, text = (key[0], key[1], parents[key], key[3]), text + "*"
        cells.setdefault(key, set()).add(text)
    out: dict[str, list[tuple[int, int, str, str]]] = {}
    for (task, layer, head, kind), texts in sorted(cells.items()):
        starred = sorted(t for t in texts if t.endswith("*"))
        shown = starred or sorted(t for t in texts if t != "c") or ["c"]
        out.setdefault(task, []).append((layer, head, kind, "".join(dict.fromkeys(t[0] for t in shown))
                                         + ("*" if starred else "")))
    return out


def marks_legend(verdict: Verdict | None, shown: Mapping[str, Sequence[tuple[int, int, str, str]]]) -> str:
    """What the letters of :func:`marks` mean, for a figure's caption."""
    source = "the verdict's" if verdict is not None else "the evidence stage's"
    text = f"G / A: {source} gather and aggregate heads."
    if any(m[3][0] in "ga" for ms in shown.values() for m in ms):  # not "c", a refined group's mark
        text += " g / a: heads with that role by the evidence standards that the verdict does not name."
    return text


def _pattern_metric(r: Mapping[str, Any], role: str | None) -> str:
    g, a = r.get("gather_score"), r.get("agg_select")
    if role == "gather" or (role != "aggregate" and g is not None and (a is None or g >= a)):
        return f"gather {fmt(g, 2)}" if g is not None else "–"
    return f"select {fmt(a, 2)}" if a is not None else "–"


_WHERE_OF_SCOPE = {scope: where for where, scope in WHERE_SCOPES.items()}
NBSP = "\u00a0"


def acts_at(r: Mapping[str, Any], role: str | None, space: str = " ") -> str:
    """The drop at the positions where the head acts: a gather head at its segments, an aggregate head at
    the query, any other head where the evidence stage placed its drop (``where``, else ``mm_where``,
    marked "†": the evidence stage's truncated model). A gather head can hurt the task when ablated
    everywhere and still carry it at its segments, so the first screen shows both. ``space`` joins the
    positions to their drop and the interval's ends (a no-break space keeps a narrow cell from splitting
    them)."""
    scope = {"gather": "segment", "aggregate": "query"}.get(role or "")
    full, minimal = WHERE_SCOPES.get(r.get("where") or ""), WHERE_SCOPES.get(r.get("mm_where") or "")
    scope = scope or full or minimal
    if scope is None:
        return "–"
    use_minimal = full != scope and minimal == scope and r.get(f"mm_d_ld_{scope}") is not None
    column = f"mm_d_ld_{scope}" if use_minimal else f"d_ld_{scope}"
    if r.get(column) is None:
        return "–"
    text = drop_ci(r, column, 2).replace(", ", "," + space)
    return f"{_WHERE_OF_SCOPE[scope]}{space}{text}" + (" †" if use_minimal else "")


def _minimal_note(scan: Scan, tasks: set[str]) -> str:
    """What "†" means for the ``tasks`` whose rows use it: the depth and clean logit difference
    of the evidence stage's truncated model, whose drops are on that scale."""
    parts = []
    for task in sorted(tasks):
        record = ((scan.summary.get("evidence") or {}).get(task) or {}).get("minimal_model") or {}
        ld = (record.get("clean") or {}).get("logit_diff")
        if record.get("depth") is not None and ld is not None:
            parts.append(f"{record['depth']} of {record.get('n_layers', '?')} layers, clean logit difference "
                         f"{signed(ld, 2)}" + (f" ({task})" if len(scan.tasks) > 1 else ""))
    return f"; †: shown only by the truncated model ({'; '.join(parts)})" if parts else ""


def ranked_table(scan: Scan, heads: pl.DataFrame, verdict: Verdict | None, k: int = MAX_RANKED) -> tuple[Table | None, str]:
    """At most ``k`` heads by drop: every gather and aggregate head of the verdict (up to ``k``), the rest
    filled with the largest drops."""
    column = next((c for c in ("d_ld_all", "d_ld_query") if c in heads.columns and heads[c].drop_nulls().len()), None)
    if column is None:
        return None, "This scan ran no ablation: no causal effects to rank heads by."
    roles = head_roles(verdict, heads)
    rows = []
    for r in heads.filter(pl.col(column).is_not_null()).iter_rows(named=True):
        role = roles.get((r["task"], r["layer"], r["head"], r["kind"]))
        rows.append((drop(r[column]) or 0.0, role in ("gather", "aggregate"), r, role))
    ga = sorted((x for x in rows if x[1]), key=lambda x: -x[0])[:k]
    rest = sorted((x for x in rows if not x[1]), key=lambda x: -x[0])[:k - len(ga)]
    rows_shown = sorted(ga + rest, key=lambda x: -x[0])
    several = len(scan.tasks) > 1
    effect = "drop in logit diff [95% CI]" + ("" if column == "d_ld_all" else " (query)")
    columns = (["task"] if several else []) + ["head", "role (evidence)", effect, "drop where it acts",
                                               "P(gather)", "P(aggregate)", "pattern"]
    body, minimal_tasks = [], set()
    for _d, _ga, r, role in rows_shown:
        acts = acts_at(r, role, space=NBSP)
        if acts.endswith("†"):
            minimal_tasks.add(r["task"])
        body.append(([r["task"]] if several else []) + [
            head_label(r), (role or "none").replace("_", " "), drop_ci(r, column, 2), acts,
            fmt(r.get("p_gather"), 2), fmt(r.get("p_aggregate"), 2), _pattern_metric(r, role)])
    clean = ", ".join(f"{t} {signed(scan.clean(t).get('logit_diff'), 2)}" for t in scan.tasks)
    minimal = _minimal_note(scan, minimal_tasks)
    more = len(rows) - len(body)
    note = (f"Drop = clean − ablated logit difference (positive = the head helps; clean: {clean}). The "
            f"verdict's gather and aggregate heads and the largest drops, by drop; where it acts: the drop "
            f"when the head is ablated only at those positions (a gather head at its segments, an aggregate "
            f"head at the query){minimal}"
            + (f"; {more} more heads in the appendix and heads.parquet." if more > 0 else "."))
    return Table(columns, body, element_id="ranked", wrap=frozenset({"role (evidence)", "drop where it acts"})), note


def screened_note(scan: Scan) -> str:
    """The map's note for a screened sweep: its grey cells were not swept exactly, not "no effect"."""
    notes = []
    for task in scan.tasks:
        record = ((scan.summary.get("tasks") or {}).get(task) or {}).get("screen") or {}
        if record.get("k") is not None and record.get("n_heads") is not None:
            notes.append(f"{record['k']} of {record['n_heads']} heads" + (f" ({task})" if len(scan.tasks) > 1 else ""))
    if not notes:
        return ""
    return (f" Grey: not swept at all positions; the attribution screen chose which heads were ({', '.join(notes)};"
            " appendix, Heads with the largest effects).")


def build_first_screen(scan: Scan, heads: pl.DataFrame, n_layers: int) -> tuple[FirstScreen, Verdict | None]:
    verdict, note = scan_verdict(scan)
    screen = FirstScreen(f"gascan report: {scan.summary.get('model', '?')}", facts_line(scan), note=note,
                         incomplete=incomplete_line(scan))
    for t in (verdict.tasks if verdict else ()):
        screen.verdicts.append(VerdictLine(t.task, t.outcome, OUTCOME_WORDS.get(t.outcome, t.outcome), t.sentence,
                                           t.confidence))
    shown = marks(verdict, heads)
    png = effect_map_figure(heads, n_layers, scan.tasks, shown)
    if png:
        screen.figure = Figure("effect_map", "Drop in logit difference when one head is ablated", png,
                               caption=("Drop in logit difference when the head is ablated (all positions; red = "
                                        "the head helps). " + marks_legend(verdict, shown)
                                        + (" Mamba-1 groups refined to channels: c, or G* / A* when a refined "
                                           "channel head of that group has the role (the ranked heads name its "
                                           "channels)." if refined_parents(heads) else "") + screened_note(scan)),
                               element_id="effect-map")
    else:
        screen.figure_note = "No effect map: this scan ran no ablation."
    screen.table, screen.table_note = ranked_table(scan, heads, verdict)
    budget = budget_line(scan)
    if budget:
        screen.table_note += " " + budget
    return screen, verdict


def evidence_skipped(scan: Scan, task: str) -> str | None:
    """Why the evidence stage ran no tests for ``task`` (the model does not do it), or None."""
    return ((scan.summary.get("evidence") or {}).get(task) or {}).get("skipped")


def budget_record(scan: Scan, task: str) -> tuple[Mapping[str, Any], list[str]]:
    """A task's evidence-budget record (after the pair stage when it ran, which adds its parts) and the heads
    the evidence stage left untested beyond the sweep."""
    ev = (scan.summary.get("evidence") or {}).get(task) or {}
    return ((scan.summary.get("budget") or {}).get(task) or ev.get("budget") or {}), list(ev.get("untested") or [])


def budget_cuts(record: Mapping[str, Any]) -> list[str]:
    """The parts of an evidence-budget record that ran less than all of their work, in words."""
    out = []
    for part in record.get("parts") or []:
        for unit in ("heads", "groups", "pairs", "gathers"):
            done, of = part.get(unit), part.get("of")
            if done is not None and of is not None and done < of:
                out.append(f"{part['part']}: {done} of {of} {unit}")
    return out


def budget_line(scan: Scan) -> str:
    """What the evidence budget left untested, and the tasks whose tests were skipped because the model does not
    do them, in one or two sentences ("" when every head was tested)."""
    parts, skipped = [], []
    for task in scan.tasks:
        if evidence_skipped(scan, task):
            skipped.append(task)
            continue
        record, untested = budget_record(scan, task)
        if not untested and not budget_cuts(record):
            continue
        n = int(scan.heads.filter(pl.col("task") == task).height) if "task" in scan.heads.columns else scan.heads.height
        limit = record.get("budget")
        parts.append((f"{task}: " if len(scan.tasks) > 1 else "")
                     + f"{n - len(untested)} of {n} heads tested beyond the sweep"
                     + (f" within an evidence budget of {limit:.0f} forward-equivalents" if limit else ""))
    text = ("No evidence or pair tests" + (f" for {', '.join(skipped)}" if len(scan.tasks) > 1 else "")
            + ": the model does not do the task, so every head has its sweep effects only.") if skipped else ""
    if not parts:
        return text
    return (text + (" " if text else "") + "Evidence budget: " + "; ".join(parts) + ". The others have their sweep "
            "effects only (list and cuts: appendix, Evidence budget; --budget none tests every head).")
