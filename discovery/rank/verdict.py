"""The one verdict: what a scan concludes about G&A, per task, decided in one place.

Every part of a report (the verdict line, the pair table, the role lists, ``summary.json``'s
``verdict`` field, the placement advice) renders the :class:`Verdict` that :func:`decide` returns;
nothing else restates or recomputes the decision.

Sign convention (everywhere in gascan's reports): a **drop** is the fall of the logit difference
caused by an ablation, clean − ablated, so a head that helps the task has a positive drop. The head
table's raw ``d_ld_*`` columns stay ablated − clean (negative = helps); :func:`drop` converts.

The rules, in the order :func:`decide` applies them to each task (the tasks of ``summary["tasks"]``,
then any other task of the evidence stage or the pair table):

1. **A pair's status** (:func:`pair_status`, the one rule; :mod:`discovery.rank.pairs` writes its
   ``verified`` column with it and nothing else restates it). ``n`` = ``control_n``, the random control
   pairs drawn for the pair's joint ablation; ``p`` = ``control_p`` = (1 + #controls whose joint effect
   is at most the pair's) / (1 + n).
   - ``verified`` iff n >= MIN_CONTROLS (19) and p <= ALPHA (0.05) and the pair's joint effect's upper
     95% bound ``joint_effect_hi`` < the controls' 5th percentile ``control_q05`` (in drops: the pair's
     lower bound above the controls' 95th percentile);
   - ``not_testable`` iff n < 19 or the joint ablation did not run (with 19 controls the smallest
     possible p is 1/20 = 0.05; with 9 it is 0.1, so nothing could reach 5%);
   - ``not_significant`` otherwise.
   The status is recomputed from these columns, so a table written under an older rule (``verified``
   from 3 controls) is judged by this one.
2. **G&A roles** (:func:`has_ga_roles`): a pair joins G&A heads iff its gather head has the role
   ``gather`` and its aggregate head the role ``aggregate`` by the evidence standards (the evidence
   stage: pattern and effect at the right positions). Classifier probabilities alone never make a pair
   G&A (on a toy Mamba-2 the classifier gave P >= 0.5 to important SSM heads with unselective patterns).
   The roles are ``summary["evidence"][task]``'s, else (a summary without that field) those the pair
   rows carry in ``gather_role`` / ``aggregate_role``.
   A **verified pair** has status ``verified`` and G&A roles (:attr:`TaskVerdict.verified_pairs`).
3. ``not_scored`` when the scan ran no ablation (``options.ablation == "none"``), or neither the evidence
   stage nor a joint ablation of any pair ran for the task: nothing causal to decide on.
4. ``none`` ("no G&A here") when the model does not do the task: clean logit difference <= 0, or clean
   accuracy less than ``min_margin`` (the evidence thresholds', 0.05) above chance (the evidence
   stage's ``task_done`` where it writes one); or when no head has a gather or aggregate role by the
   evidence standards (without the evidence stage: no tested pair whose heads both have classifier
   P >= CONFIDENT_P, 0.5).
5. ``verified`` when at least one verified pair exists. The sentence names only the verified pairs:
   "G&A verified: gather X → aggregate Y (joint drop D [lo, hi] vs control mean C, p = P, n = N
   controls)", pairs joined by "; ". Every head it names as G&A is in a verified pair.
6. ``ga_like`` otherwise: G&A-like heads, but no pair of them beats the controls ("G&A-like heads
   (gather …; aggregate …), but no pair of them beats the controls (best: …)"), or none could be
   tested ("…, but not testable: …"), or no tested pair joins a gather and an aggregate head.
7. Decoys (pattern without effect, by the evidence standards) are listed in ``decoys`` and, when there
   are any, in a last sentence "Decoys (G&A-like pattern, no effect): …" that names them as not G&A
   (the first :data:`MAX_NAMED_DECOYS`, then how many more: the full list is in ``decoys``).

Confidence (``TaskVerdict.confidence``; ``reason`` says which rule applied):
``verified``: ``high`` when the evidence stage also found a verified pair's aggregate head reading its
gather head with each head's own ablation mattering (its clean pair), else ``medium``;
``ga_like``: ``low``; ``none``: ``high`` when the model does not do the task, ``medium`` when the
evidence stage found no G&A role, ``low`` without the evidence stage; ``not_scored``: ``none``.

8. Refined Mamba-1 channels (``summary["tasks"][task]["refinement"]["leaves"]`` below group level): every
   one the sentence names carries its channels, in the report tables' wording (``L1S32 (ch 195)``), and
   those that matter without a G&A role (by the evidence stage, ``other_important``; without the stage,
   a leaf whose drop counts by the refinement's own threshold) are named, largest drop first, with their
   drops in a sentence of every outcome before the decoys: "Refined channels that matter without a G&A
   role: …" ("… that carry the task …" under ``none``). The group names alone (``L1S24``) would hide which
   channel the evidence found, and the refined heads' numbers (``L1S32``) are only inventory slots.
   They are listed in ``channels``; none is a G&A claim.

The evidence stage's own label (``summary["evidence"][task]["verdict"]``: clean / distributed / none)
is an input here (its roles, reads and clean scores), never a verdict to print.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from discovery.heads import channel_label

OUTCOMES = ("verified", "ga_like", "none", "not_scored")
PAIR_STATUSES = ("verified", "not_significant", "not_testable")
"""A tested pair's status: ``verified`` when its permutation p-value against the control pairs is at
most :data:`ALPHA` (which needs at least :data:`MIN_CONTROLS` controls) and the upper end of its joint
effect's 95% interval lies below the control's 5th percentile (the joint drop's lower end above the
control's 95th percentile of drops); ``not_testable`` when fewer controls could be drawn;
``not_significant`` otherwise."""
ALPHA = 0.05
MAX_NAMED_DECOYS = 5  # the verdict sentence names this many decoys, then counts the rest
MIN_CONTROLS = 19  # (1 + 0) / (1 + 19) = 0.05: the smallest permutation p-value that can reach ALPHA
CONFIDENT_P = 0.5  # without the evidence stage: both classifier probabilities for "G&A-like" (never verified)
MIN_MARGIN = 0.05  # the evidence thresholds' default: the task is done when accuracy beats chance by this much


def drop(delta: float | None) -> float | None:
    """Drop in logit difference (clean − ablated, positive = the ablated heads helped) from a raw
    ``d_ld_*`` delta (ablated − clean)."""
    return None if delta is None else -float(delta)


@dataclass(frozen=True)
class HeadRef:
    """A head as reports name it (``L3H1`` attention, ``L2S6`` SSM)."""

    layer: int
    head: int
    kind: str

    @property
    def name(self) -> str:
        return f"L{self.layer}{'H' if self.kind == 'attn' else 'S'}{self.head}"


@dataclass(frozen=True)
class PairCall:
    """One tested gather → aggregate pair and what its joint ablation showed (drops, positive = helps)."""

    task: str
    rank: int
    gather: HeadRef
    aggregate: HeadRef
    status: str  # one of PAIR_STATUSES
    joint_drop: float | None
    joint_drop_lo: float | None
    joint_drop_hi: float | None
    control_mean_drop: float | None
    control_q95_drop: float | None  # the control's 95th percentile of drops (its 5th of raw effects)
    control_n: int
    p_value: float | None
    gather_role: str | None  # by the evidence standards: "gather", "aggregate", ... or None
    aggregate_role: str | None
    p_gather: float | None
    p_aggregate: float | None
    control_layers: str | None = None  # where the controls came from: "same layers", "±1 layer", ...

    @property
    def ga_roles(self) -> bool:
        """Both heads have their role by the evidence standards."""
        return has_ga_roles(self.gather_role, self.aggregate_role)


@dataclass(frozen=True)
class TaskVerdict:
    """The decision for one task, with the sentence every renderer prints."""

    task: str
    outcome: str  # one of OUTCOMES
    sentence: str  # one or two sentences, plain text (renderers escape it)
    confidence: str  # "high" | "medium" | "low" | "none", with the rule in ``reason``
    reason: str
    pairs: tuple[PairCall, ...] = ()  # every tested pair, best first
    gather_heads: tuple[str, ...] = ()  # by the evidence standards
    aggregate_heads: tuple[str, ...] = ()
    decoys: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()  # rule 8: the refined channels named as mattering, labelled (L1S32 (ch 195))

    @property
    def verified_pairs(self) -> tuple[PairCall, ...]:
        return tuple(p for p in self.pairs if p.status == "verified" and p.ga_roles)

    @property
    def named_heads(self) -> tuple[str, ...]:
        """The heads the sentence names as gather or aggregate heads: a verified verdict's verified pairs
        (rule 5), any other outcome's heads with a G&A role (rule 6)."""
        if self.outcome == "verified":
            return tuple(dict.fromkeys(h.name for p in self.verified_pairs for h in (p.gather, p.aggregate)))
        return self.gather_heads + self.aggregate_heads


@dataclass(frozen=True)
class Verdict:
    """The verdict of a whole scan: one :class:`TaskVerdict` per task."""

    tasks: tuple[TaskVerdict, ...] = field(default_factory=tuple)

    @property
    def headline(self) -> str:
        """The sentences of every task, prefixed by the task name when there are several."""
        if len(self.tasks) == 1:
            return self.tasks[0].sentence
        return " ".join(f"{t.task}: {t.sentence}" for t in self.tasks)

    def for_task(self, task: str) -> TaskVerdict | None:
        return next((t for t in self.tasks if t.task == task), None)

    def as_dict(self) -> dict[str, Any]:
        return {"headline": self.headline, "tasks": [asdict(t) for t in self.tasks]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        def head(d: Mapping[str, Any]) -> HeadRef:
            return HeadRef(int(d["layer"]), int(d["head"]), str(d["kind"]))

        tasks = []
        for t in data.get("tasks") or []:
            pairs = tuple(PairCall(**{**p, "gather": head(p["gather"]), "aggregate": head(p["aggregate"])})
                          for p in t.get("pairs") or [])
            tasks.append(TaskVerdict(**{**t, "pairs": pairs, "gather_heads": tuple(t.get("gather_heads") or ()),
                                        "aggregate_heads": tuple(t.get("aggregate_heads") or ()),
                                        "decoys": tuple(t.get("decoys") or ()),
                                        "channels": tuple(t.get("channels") or ())}))
        return cls(tuple(tasks))


def _num(x: Any) -> float | None:
    """A finite float, or None (nulls, NaN and non-numbers)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _g(x: float | None) -> str:
    return "–" if x is None else f"{x:.3g}"


def pair_status(row: Mapping[str, Any]) -> str:
    """Rule 1 of the module docstring, the only place it is written: ``verified``, ``not_significant`` or
    ``not_testable`` from a pair row's ``control_n``, ``control_p``, ``joint_effect_hi`` and ``control_q05``."""
    n = int(_num(row.get("control_n")) or 0)
    p, hi, q05 = _num(row.get("control_p")), _num(row.get("joint_effect_hi")), _num(row.get("control_q05"))
    if n < MIN_CONTROLS or p is None or hi is None or q05 is None:
        return "not_testable"
    return "verified" if p <= ALPHA and hi < q05 else "not_significant"


def verified_flag(row: Mapping[str, Any]) -> bool | None:
    """The ``verified`` column of ``pairs.parquet``: True / False by :func:`pair_status`, None when not testable."""
    status = pair_status(row)
    return None if status == "not_testable" else status == "verified"


def has_ga_roles(gather_role: str | None, aggregate_role: str | None) -> bool:
    """Rule 2: the gather head is ``gather`` and the aggregate head ``aggregate`` by the evidence standards."""
    return gather_role == "gather" and aggregate_role == "aggregate"


def is_ga_pair(row: Mapping[str, Any]) -> bool:
    """A verified pair (rules 1 and 2) from a pair row or a ``top_pairs`` entry."""
    return pair_status(row) == "verified" and has_ga_roles(row.get("gather_role"), row.get("aggregate_role"))


def _head(row: Mapping[str, Any], which: str) -> HeadRef:
    nested = row.get(which)
    if isinstance(nested, Mapping):  # a summary ``top_pairs`` entry
        return HeadRef(int(nested["layer"]), int(nested["head"]), str(nested["kind"]))
    return HeadRef(int(row[f"{which}_layer"]), int(row[f"{which}_head"]), str(row[f"{which}_kind"]))


def pair_call(row: Mapping[str, Any]) -> PairCall:
    """A pair row (``pairs.parquet`` as a dict, or a ``top_pairs`` entry) in the drop convention."""
    lo, hi = _num(row.get("joint_effect_lo")), _num(row.get("joint_effect_hi"))
    control_mean = _num(row.get("control_mean", row.get("control_effect")))
    return PairCall(
        task=str(row.get("task") or ""), rank=int(_num(row.get("rank")) or 0),
        gather=_head(row, "gather"), aggregate=_head(row, "aggregate"), status=pair_status(row),
        joint_drop=drop(_num(row.get("joint_effect"))), joint_drop_lo=drop(hi), joint_drop_hi=drop(lo),
        control_mean_drop=drop(control_mean), control_q95_drop=drop(_num(row.get("control_q05"))),
        control_n=int(_num(row.get("control_n")) or 0), p_value=_num(row.get("control_p")),
        gather_role=row.get("gather_role"), aggregate_role=row.get("aggregate_role"),
        p_gather=_num(row.get("p_gather")), p_aggregate=_num(row.get("p_aggregate")),
        control_layers=row.get("control_layers"),
    )


def _pair_numbers(p: PairCall) -> str:
    where = f", controls from {p.control_layers}" if p.control_layers and p.control_layers != "same layers" else ""
    return (f"joint drop {_g(p.joint_drop)} [{_g(p.joint_drop_lo)}, {_g(p.joint_drop_hi)}] vs control mean "
            f"{_g(p.control_mean_drop)}, p = {_g(p.p_value)}, n = {p.control_n} controls{where}")


def _pair_text(p: PairCall, label: Callable[[str], str] = str) -> str:
    return f"gather {label(p.gather.name)} → aggregate {label(p.aggregate.name)} ({_pair_numbers(p)})"


@dataclass(frozen=True)
class _Channels:
    """Rule 8: a task's refined Mamba-1 channel heads (name -> channel span and drop) and which of them count."""

    spans: dict[str, tuple[int, int]]
    drops: dict[str, float | None]
    counting: tuple[str, ...]  # leaves whose drop counts by the refinement's own threshold

    def label(self, name: str, note: str = "") -> str:
        """``name`` with its channels when it is a refined channel head (``L1S32 (ch 195)``)."""
        start, end = self.spans.get(name, (None, None))
        return channel_label(name, start, end, note)

    def labelled(self, names: Sequence[str]) -> str:
        return ", ".join(self.label(n) for n in names)

    def mattering(self, ev: Mapping[str, Any] | None) -> tuple[str, ...]:
        """The refined channels that matter without a G&A role, largest drop first: the evidence stage's
        ``other_important`` ones, or (without the stage) those whose drop counts."""
        names = [str(h) for h in ev.get("other_important") or ()] if ev is not None else list(self.counting)
        return tuple(sorted((n for n in names if n in self.spans), key=lambda n: -(self.drops.get(n) or 0.0)))

    def sentence(self, names: Sequence[str], outcome: str, evidence: bool) -> str:
        """Rule 8's sentence (empty without such channels)."""
        if not names:
            return ""
        lead = "carry the task" if outcome == "none" else "matter"
        items = ", ".join(self.label(n, f", drop {_g(self.drops.get(n))}") for n in names)
        return f" Refined channels that {lead}{' without a G&A role' if evidence else ''}: {items}."


def _refined_channels(summary: Mapping[str, Any], task: str) -> _Channels:
    """Rule 8's input: the leaves of the task's refinement record below group level (a whole group left as
    a redundant set is a group head, not a refined one)."""
    info = (summary.get("tasks") or {}).get(task) or {}
    record = info.get("refinement") or {}
    leaves = [leaf for leaf in record.get("leaves") or () if _num(leaf.get("level")) != 0  # older records: no level
              and leaf.get("channel_start") is not None and leaf.get("channel_end") is not None]
    clean, effect = _num((info.get("clean") or {}).get("logit_diff")), _num(record.get("effect"))
    threshold = None if clean is None or effect is None else effect * abs(clean)
    counting = tuple(str(leaf["head"]) for leaf in leaves if threshold is not None
                     and (_num(leaf.get("drop")) or 0.0) >= threshold and (_num(leaf.get("drop_lo")) or 0.0) > 0)
    return _Channels({str(leaf["head"]): (int(leaf["channel_start"]), int(leaf["channel_end"])) for leaf in leaves},
                     {str(leaf["head"]): _num(leaf.get("drop")) for leaf in leaves}, counting)


def _task_done(ev: Mapping[str, Any] | None, clean: Mapping[str, Any]) -> bool | None:
    """Rule 4's first half: the evidence stage's ``task_done`` when written, else its test on the clean scores
    (None when there are no clean scores)."""
    if ev is not None and isinstance(ev.get("task_done"), bool):
        return ev["task_done"]
    ld, acc, chance = _num(clean.get("logit_diff")), _num(clean.get("acc")), _num(clean.get("chance"))
    if ld is None:
        return None
    margin = _num(((ev or {}).get("thresholds") or {}).get("min_margin"))
    margin = MIN_MARGIN if margin is None else margin
    if acc is not None and chance is not None:
        return ld > 0 and acc - chance >= margin
    return ld > 0


def _evidence_details(summary: Mapping[str, Any], task: str) -> Mapping[str, Any] | None:
    """The evidence stage's fields for a task: its ``details`` (roles, reads, clean scores) merged over
    its top level (``verdict``, ``reason``, ``thresholds``), or None when the stage did not run."""
    ev = (summary.get("evidence") or {}).get(task)
    if not isinstance(ev, Mapping):
        return None
    details = ev.get("details")
    return {**ev, **details} if isinstance(details, Mapping) else ev


def _roles_from_pairs(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The evidence roles the pair rows carry, in the evidence summary's shape (for a summary without its
    ``evidence`` field, e.g. one written before the stage existed, over a pair table that has the roles)."""
    found: dict[str, list[str]] = {"gather": [], "aggregate": [], "decoy": [], "other_important": []}
    for r in rows:
        for which in ("gather", "aggregate"):
            role, name = r.get(f"{which}_role"), _head(r, which).name
            if role in found and name not in found[role]:
                found[role].append(name)
    return {"gather_heads": found["gather"], "aggregate_heads": found["aggregate"], "decoys": found["decoy"],
            "other_important": found["other_important"]}


def _decide_task(task: str, summary: Mapping[str, Any], rows: list[Mapping[str, Any]]) -> TaskVerdict:
    info = (summary.get("tasks") or {}).get(task) or {}
    tested = [pair_call(r) for r in sorted(rows, key=lambda r: _num(r.get("rank")) or 0)
              if _num(r.get("joint_effect")) is not None]
    ev = _evidence_details(summary, task)
    if ev is None and any(r.get("gather_role") is not None or r.get("aggregate_role") is not None for r in rows):
        ev = _roles_from_pairs(rows)  # the evidence stage ran (its roles reached the pair table)
    clean = {**(info.get("clean") or {}), **((ev or {}).get("clean") or {})}
    gathers = tuple(str(h) for h in (ev or {}).get("gather_heads") or ())
    aggregates = tuple(str(h) for h in (ev or {}).get("aggregate_heads") or ())
    decoys = tuple(str(h) for h in (ev or {}).get("decoys") or ())
    refined = _refined_channels(summary, task)
    lab, channels = refined.label, refined.mattering(ev)
    base = dict(task=task, pairs=tuple(tested), gather_heads=gathers, aggregate_heads=aggregates, decoys=decoys,
                channels=tuple(lab(n) for n in channels))
    shown = refined.labelled(decoys[:MAX_NAMED_DECOYS]) + (f" and {len(decoys) - MAX_NAMED_DECOYS} more"
                                                           if len(decoys) > MAX_NAMED_DECOYS else "")
    decoy_text = f" Decoys (G&A-like pattern, no effect): {shown}." if decoys else ""

    def verdict(outcome: str, claim: str, confidence: str, reason: str) -> TaskVerdict:
        """The task's verdict: its claim, then rule 8's refined channels, then rule 7's decoys."""
        sentence = claim + refined.sentence(channels, outcome, ev is not None) + decoy_text
        return TaskVerdict(outcome=outcome, sentence=sentence, confidence=confidence, reason=reason, **base)

    # rule 3
    ablation = (summary.get("options") or {}).get("ablation")
    if ablation == "none" or (ev is None and not tested):
        why = ("the scan ran no ablation (--ablation none)" if ablation == "none"
               else "neither the evidence stage nor a pair's joint ablation ran for this task")
        return verdict("not_scored", f"Not scored: {why}, so nothing can be decided about G&A.", "none",
                       f"not_scored (rule 3): {why}")
    # rule 4
    done = _task_done(ev, clean)
    if done is False:
        acc, chance, ld = _num(clean.get("acc")), _num(clean.get("chance")), _num(clean.get("logit_diff"))
        scores = f"clean accuracy {_g(acc)}" + (f" vs chance {_g(chance)}" if chance is not None else "") \
            + f", logit difference {_g(ld)}"
        return verdict("none", f"No G&A here: the model does not do the task ({scores}).", "high",
                       f"none (rule 4): the task is not done ({scores}), so no head can carry it")
    beats = [p for p in tested if p.status == "verified"]
    important = (f" ({lab(beats[0].gather.name)} → {lab(beats[0].aggregate.name)} beats the controls, but as "
                 "important heads, not G&A heads)") if beats and not beats[0].ga_roles else ""
    if ev is not None and not gathers and not aggregates:
        others = [str(h) for h in ev.get("other_important") or ()]
        carried = f"; important heads without a G&A role: {refined.labelled(others)}" if others else ""
        return verdict("none", "No G&A here: no head has a gather or aggregate role by the evidence standards"
                       f"{important}.", "medium", f"none (rule 4): the evidence stage gave no head a G&A role{carried}")
    if ev is None:
        like = [p for p in tested if (p.p_gather or 0.0) >= CONFIDENT_P and (p.p_aggregate or 0.0) >= CONFIDENT_P]
        if not like:
            return verdict("none", "No G&A here: no tested pair's heads look like G&A heads (classifier P < "
                           f"{CONFIDENT_P:g}); the evidence stage did not run{important}.", "low",
                           "none (rule 4): no evidence stage, and no tested pair with P(gather) and P(aggregate) >= "
                           f"{CONFIDENT_P:g}")
        best = like[0]
        return verdict("ga_like", f"G&A-like heads by the classifier (gather {lab(best.gather.name)}, aggregate "
                       f"{lab(best.aggregate.name)}), but not verified: the evidence stage did not run, so no role is "
                       f"confirmed ({_pair_numbers(best)}).", "low",
                       "ga_like (rule 6): without the evidence stage no pair can be verified (rule 2)")
    # rule 5
    verified = [p for p in tested if p.status == "verified" and p.ga_roles]
    if verified:
        clean_pairs = {(str(p.get("gather")), str(p.get("aggregate"))) for p in ev.get("pairs") or ()
                       if isinstance(p, Mapping) and p.get("single_head_evidence")}
        high = [p for p in verified if (p.gather.name, p.aggregate.name) in clean_pairs]
        confidence = "high" if high else "medium"
        rule = (f"the evidence stage's read test also confirms {lab(high[0].gather.name)} → "
                f"{lab(high[0].aggregate.name)}" if high
                else "the evidence stage's read test did not confirm a verified pair as a clean pair")
        return verdict("verified", "G&A verified: " + "; ".join(_pair_text(p, lab) for p in verified) + ".",
                       confidence, f"verified (rule 5): {len(verified)} pair(s) with both G&A roles and p <= "
                       f"{ALPHA:g} against >= {MIN_CONTROLS} controls, interval clear of the controls; "
                       f"{confidence}: {rule}")
    # rule 6
    roles = "; ".join(x for x in (f"gather {refined.labelled(gathers)}" if gathers else "",
                                  f"aggregate {refined.labelled(aggregates)}" if aggregates else "") if x)
    ga_pairs = [p for p in tested if p.ga_roles]
    if any(p.status == "not_significant" for p in ga_pairs):
        best = next(p for p in ga_pairs if p.status == "not_significant")
        tail = f"but no pair of them beats the controls (best: {_pair_text(best, lab)})"
        why = "no G&A pair beats the controls"
    elif ga_pairs:
        best = ga_pairs[0]
        tail = (f"but not testable: gather {lab(best.gather.name)} → aggregate {lab(best.aggregate.name)} has "
                f"{best.control_n} control pairs ({MIN_CONTROLS} needed for p <= {ALPHA:g})")
        why = "no G&A pair could be tested against enough controls"
    elif tested:
        tail = f"but no tested pair joins a gather and an aggregate head{important}"
        why = "no tested pair has both G&A roles"
    else:
        tail, why = "but no pair was tested by joint ablation", "no pair was tested"
    return verdict("ga_like", f"G&A-like heads ({roles}), {tail}.", "low",
                   f"ga_like (rule 6): roles by the evidence standards, but {why}")


def decide(summary: Mapping[str, Any], pairs: Sequence[Mapping[str, Any]] | None = None) -> Verdict:
    """The verdict of a scan from its ``summary.json`` (the evidence stage's roles per task) and its
    pair table rows (``pairs.parquet`` as dicts; without them, ``summary["top_pairs"]``). The rules are
    the module docstring's."""
    rows = list(pairs) if pairs is not None else list(summary.get("top_pairs") or [])
    order: list[str] = []
    for task in [*(summary.get("tasks") or {}), *(summary.get("evidence") or {}),
                 *(str(r.get("task") or "") for r in rows)]:
        if task not in order:
            order.append(task)
    return Verdict(tuple(_decide_task(t, summary, [r for r in rows if str(r.get("task") or "") == t])
                         for t in order))


def decide_scan(scan: Any) -> Verdict:
    """:func:`decide` on a :class:`discovery.artifacts.Scan` (its summary and ``pairs.parquet``)."""
    pairs = scan.pairs.to_dicts() if getattr(scan, "pairs", None) is not None and scan.pairs.height else None
    return decide(scan.summary, pairs)
