"""A hand-written stand-in for :func:`discovery.rank.verdict.decide` for the report's tests: the report
only renders a Verdict, so its tests build one from the evidence stage's roles and the pair table
(this is not the verdict rule; decide() is)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from discovery.rank.verdict import HeadRef, PairCall, TaskVerdict, Verdict, drop


def _name(h: HeadRef) -> str:
    return h.name


def standin_verdict(summary: Mapping[str, Any], pairs: Sequence[Mapping[str, Any]] = (),
                    sentence: str | None = None) -> Verdict:
    tasks = []
    for task in (summary.get("tasks") or {}):
        details = (((summary.get("evidence") or {}).get(task) or {}).get("details") or {})
        calls = []
        for p in sorted((p for p in pairs if p.get("task", task) == task), key=lambda p: p["rank"]):
            if p.get("joint_effect") is None:
                continue
            status = ("not_testable" if (p.get("control_n") or 0) < 19 else
                      "verified" if p.get("verified") else "not_significant")
            calls.append(PairCall(
                task, int(p["rank"]), HeadRef(p["gather_layer"], p["gather_head"], p["gather_kind"]),
                HeadRef(p["aggregate_layer"], p["aggregate_head"], p["aggregate_kind"]), status,
                drop(p["joint_effect"]), drop(p.get("joint_effect_hi")), drop(p.get("joint_effect_lo")),
                drop(p.get("control_mean")), drop(p.get("control_q05")), int(p.get("control_n") or 0),
                p.get("control_p"), p.get("gather_role"), p.get("aggregate_role"), p.get("p_gather"),
                p.get("p_aggregate")))
        gather, aggregate = tuple(details.get("gather_heads") or ()), tuple(details.get("aggregate_heads") or ())
        verified = [c for c in calls if c.status == "verified" and c.ga_roles]
        if verified:
            v = verified[0]
            outcome, conf = "verified", "high"
            text = (f"G&A verified: gather {v.gather.name} → aggregate {v.aggregate.name}; ablating both drops the "
                    f"logit difference by {v.joint_drop:.2f}, more than every random same-layer pair.")
        elif gather or aggregate:
            outcome, conf = "ga_like", "medium"
            text = (f"G&A-like heads (gather {', '.join(gather[:3]) or 'none'}; aggregate "
                    f"{', '.join(aggregate[:3]) or 'none'}), but no tested pair beats random same-layer pairs.")
        else:
            outcome, conf, text = "none", "medium", "No G&A: no head has a gather or aggregate role."
        tasks.append(TaskVerdict(task, outcome, sentence or text, conf, "stand-in rule for the report's tests",
                                 tuple(calls), gather, aggregate, tuple(details.get("decoys") or ())))
    return Verdict(tuple(tasks))
