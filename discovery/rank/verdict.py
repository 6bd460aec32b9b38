"""The one verdict: what a scan concludes about G&A, per task, decided in one place.

Every part of a report (the verdict line, the pair table, the role lists, ``summary.json``'s
``verdict`` field, the placement advice) renders the :class:`Verdict` that :func:`decide` returns;
nothing else restates or recomputes the decision.

Sign convention (everywhere in gascan's reports): a **drop** is the fall of the logit difference
caused by an ablation, clean − ablated, so a head that helps the task has a positive drop. The head
table's raw ``d_ld_*`` columns stay ablated − clean (negative = helps); :func:`drop` converts.

Outcomes per task (``TaskVerdict.outcome``):

- ``verified``: at least one pair gather X → aggregate Y whose heads both have their role by the
  evidence standards *and* whose joint ablation beats the control pairs at the 5% level (see
  :data:`PAIR_STATUSES`).
- ``ga_like``: G&A-like heads exist (roles by the evidence standards, or candidate pairs), but no
  pair of them beats the controls, or none could be tested.
- ``none``: no G&A here (the model does not do the task, or no head has a G&A role).
- ``not_scored``: the scan ran no ablation, so nothing can be decided.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

OUTCOMES = ("verified", "ga_like", "none", "not_scored")
PAIR_STATUSES = ("verified", "not_significant", "not_testable")
"""A tested pair's status: ``verified`` when its permutation p-value against the control pairs is at
most :data:`ALPHA` (which needs at least :data:`MIN_CONTROLS` controls) and the upper end of its joint
effect's 95% interval lies below the control's 5th percentile (the joint drop's lower end above the
control's 95th percentile of drops); ``not_testable`` when fewer controls could be drawn;
``not_significant`` otherwise."""
ALPHA = 0.05
MIN_CONTROLS = 19  # (1 + 0) / (1 + 19) = 0.05: the smallest permutation p-value that can reach ALPHA


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

    @property
    def ga_roles(self) -> bool:
        """Both heads have their role by the evidence standards."""
        return self.gather_role == "gather" and self.aggregate_role == "aggregate"


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

    @property
    def verified_pairs(self) -> tuple[PairCall, ...]:
        return tuple(p for p in self.pairs if p.status == "verified" and p.ga_roles)


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
                                        "decoys": tuple(t.get("decoys") or ())}))
        return cls(tuple(tasks))


def decide(summary: Mapping[str, Any], pairs: Sequence[Mapping[str, Any]] | None = None) -> Verdict:
    """The verdict of a scan from its ``summary.json`` (the evidence stage's roles per task) and its
    pair table rows (``pairs.parquet`` as dicts). The rules are the module docstring's."""
    raise NotImplementedError("decide() is being written (issue 22)")
