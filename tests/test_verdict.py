"""The one verdict (discovery.rank.verdict): its rules on hand-made summaries and pair rows."""
from __future__ import annotations

import json
import re

import pytest

from discovery.rank.verdict import (
    MIN_CONTROLS, Verdict, decide, decide_scan, drop, is_ga_pair, pair_call, pair_status, verified_flag,
)

TASK = "mc"


def _row(g=(0, 3), a=(3, 0), *, rank=1, n=40, p=1 / 41, effect=-6.0, lo=-6.5, hi=-5.5, q05=-0.4,
         roles=("gather", "aggregate"), verified=None, task=TASK, **extra):
    """One pairs.parquet row (raw effects: ablated - clean, negative = the pair helps)."""
    return {"task": task, "rank": rank, "gather_layer": g[0], "gather_head": g[1], "gather_kind": "attn",
            "aggregate_layer": a[0], "aggregate_head": a[1], "aggregate_kind": "attn", "p_gather": 0.1,
            "p_aggregate": 0.2, "gather_role": roles[0], "aggregate_role": roles[1], "joint_effect": effect,
            "joint_effect_lo": lo, "joint_effect_hi": hi, "control_mean": -0.1, "control_q05": q05,
            "control_q95": 0.2, "control_n": n, "control_p": p, "control_layers": "±1 layer",
            "verified": verified, **extra}


def _summary(gathers=("L0H3",), aggregates=("L3H0",), decoys=("L1H2",), others=(), *, acc=1.0, chance=0.25,
             ld=6.0, clean_pairs=(("L0H3", "L3H0"),), ablation="exact"):
    """A summary.json as the scan writes it: clean scores per task and the evidence stage's fields."""
    details = {"clean": {"logit_diff": ld, "acc": acc, "chance": chance}, "gather_heads": list(gathers),
               "aggregate_heads": list(aggregates), "decoys": list(decoys), "other_important": list(others),
               "pairs": [{"gather": g, "aggregate": a, "single_head_evidence": True} for g, a in clean_pairs]}
    return {"options": {"ablation": ablation},
            "tasks": {TASK: {"clean": {"logit_diff": ld, "acc": acc}, "n_prompts": 16}},
            "evidence": {TASK: {"verdict": "clean", "reason": "clean G&A: L0H3 gathers, L3H0 aggregates",
                                "details": details, "thresholds": {"min_margin": 0.05}}}}


def test_pair_status_needs_19_controls_and_p_at_most_5_percent():
    # 9 controls (3 x 3 same-layer heads): the smallest p is 1/10, nothing can reach 5%
    assert pair_status(_row(n=9, p=0.1)) == "not_testable" and verified_flag(_row(n=9, p=0.1)) is None
    assert pair_status(_row(n=18, p=1 / 19)) == "not_testable"
    assert pair_status(_row(n=19, p=1 / 20)) == "verified"  # the boundary: (1 + 0) / (1 + 19) = 0.05
    assert pair_status(_row(n=40, p=1 / 41)) == "verified" and verified_flag(_row()) is True
    assert pair_status(_row(n=40, p=3 / 41)) == "not_significant"  # 0.073 > 0.05
    # p small, but the interval reaches into the controls' 5th percentile
    assert pair_status(_row(n=40, p=1 / 41, hi=-0.3, q05=-0.4)) == "not_significant"
    assert verified_flag(_row(n=40, p=3 / 41)) is False
    # a row written under the old rule (verified from 3 controls) is judged by the new one
    assert pair_status(_row(n=3, p=0.25, verified=True)) == "not_testable"
    assert pair_status(_row(effect=None, lo=None, hi=None, n=0, p=None)) == "not_testable"
    assert MIN_CONTROLS == 19


def test_a_g_and_a_pair_is_verified_with_both_evidence_roles():
    assert is_ga_pair(_row())
    assert not is_ga_pair(_row(roles=("other_important", "other_important")))  # important heads, not G&A
    assert not is_ga_pair(_row(roles=(None, None), p_gather=0.9, p_aggregate=0.9))  # classifier alone: no
    assert not is_ga_pair(_row(n=9, p=0.1))


def test_pair_call_uses_the_drop_sign_convention():
    call = pair_call(_row())
    assert (call.joint_drop, call.joint_drop_lo, call.joint_drop_hi) == (6.0, 5.5, 6.5)
    assert call.control_mean_drop == pytest.approx(0.1) and call.control_q95_drop == pytest.approx(0.4)
    assert (call.control_n, call.status, call.control_layers) == (40, "verified", "±1 layer")
    assert call.p_value == pytest.approx(1 / 41) and call.gather.name == "L0H3" and call.aggregate.name == "L3H0"
    assert drop(-2.5) == 2.5 and drop(None) is None


def test_verified_names_only_verified_pairs():
    rows = [_row(),  # the G&A pair, 40 controls all weaker
            _row(g=(0, 3), a=(2, 1), rank=2, roles=("gather", "other_important")),  # beats controls, not G&A
            _row(g=(1, 0), a=(3, 0), rank=3, n=9, p=0.1, roles=("gather", "aggregate")),  # not testable
            _row(g=(1, 1), a=(2, 2), rank=4, effect=None, lo=None, hi=None, n=0, p=None)]  # not tested
    summary = _summary(gathers=("L0H3", "L1H0"))
    tv = decide(summary, rows).for_task(TASK)
    assert tv.outcome == "verified" and tv.confidence == "high"
    assert tv.sentence == ("G&A verified: gather L0H3 → aggregate L3H0 (joint drop 6 [5.5, 6.5] vs control mean "
                           "0.1, p = 0.0244, n = 40 controls, controls from ±1 layer). "
                           "Decoys (G&A-like pattern, no effect): L1H2.")
    assert [p.status for p in tv.pairs] == ["verified", "verified", "not_testable"]  # the untested row is left out
    assert [(p.gather.name, p.aggregate.name) for p in tv.verified_pairs] == [("L0H3", "L3H0")]
    # every head the sentence names as G&A is in a verified pair (the decoys clause names non-G&A heads)
    ga_part = tv.sentence.split("Decoys")[0]
    named = set(re.findall(r"L\d+[HS]\d+", ga_part))
    in_verified = {h for p in tv.verified_pairs for h in (p.gather.name, p.aggregate.name)}
    assert named == {"L0H3", "L3H0"} and named <= in_verified
    assert "L1H0" not in tv.sentence  # a gather head whose pair was not testable is not named
    assert tv.gather_heads == ("L0H3", "L1H0") and tv.aggregate_heads == ("L3H0",) and tv.decoys == ("L1H2",)
    assert "rule 5" in tv.reason
    # without the evidence stage's clean pair (read test) the confidence is medium
    assert decide(_summary(clean_pairs=()), rows).for_task(TASK).confidence == "medium"


def test_nine_controls_at_p_01_is_not_testable_not_verified():
    """The bug of issue 22: 'verified' from 9 controls at p = 0.1 (the old column says True)."""
    tv = decide(_summary(), [_row(n=9, p=0.1, verified=True)]).for_task(TASK)
    assert tv.outcome == "ga_like" and tv.confidence == "low" and tv.verified_pairs == ()
    assert tv.sentence == ("G&A-like heads (gather L0H3; aggregate L3H0), but not testable: gather L0H3 → "
                           "aggregate L3H0 has 9 control pairs (19 needed for p <= 0.05). "
                           "Decoys (G&A-like pattern, no effect): L1H2.")


def test_ga_like_when_no_pair_of_the_roles_beats_the_controls():
    tv = decide(_summary(decoys=()), [_row(p=0.3)]).for_task(TASK)
    assert tv.outcome == "ga_like" and tv.pairs[0].status == "not_significant"
    assert tv.sentence == ("G&A-like heads (gather L0H3; aggregate L3H0), but no pair of them beats the controls "
                           "(best: gather L0H3 → aggregate L3H0 (joint drop 6 [5.5, 6.5] vs control mean 0.1, "
                           "p = 0.3, n = 40 controls, controls from ±1 layer)).")
    # roles, but no tested pair joins them; an important pair beats the controls
    tv = decide(_summary(decoys=()), [_row(roles=("other_important", "aggregate"))]).for_task(TASK)
    assert tv.outcome == "ga_like"
    assert tv.sentence == ("G&A-like heads (gather L0H3; aggregate L3H0), but no tested pair joins a gather and an "
                           "aggregate head (L0H3 → L3H0 beats the controls, but as important heads, not G&A heads).")


def test_none_when_the_task_is_not_done_or_no_head_has_a_role():
    tv = decide(_summary(acc=0.27, chance=0.25, ld=0.1), [_row()]).for_task(TASK)
    assert tv.outcome == "none" and tv.confidence == "high" and tv.verified_pairs  # the pair's stats don't matter
    assert tv.sentence.startswith("No G&A here: the model does not do the task (clean accuracy 0.27 vs chance "
                                  "0.25, logit difference 0.1).")
    tv = decide(_summary(gathers=(), aggregates=(), decoys=(), others=("L2H0", "L3H1")),
                [_row(g=(2, 0), a=(3, 1), roles=("other_important", "other_important"))]).for_task(TASK)
    assert tv.outcome == "none" and tv.confidence == "medium"
    assert tv.sentence == ("No G&A here: no head has a gather or aggregate role by the evidence standards (L2H0 → "
                           "L3H1 beats the controls, but as important heads, not G&A heads).")
    assert "L2H0, L3H1" in tv.reason


def test_not_scored_without_ablation():
    tv = decide(_summary(ablation="none"), []).for_task(TASK)
    assert tv.outcome == "not_scored" and tv.confidence == "none"
    bare = {"tasks": {TASK: {"clean": {"logit_diff": 3.0, "acc": 1.0}}}}
    assert decide(bare, []).for_task(TASK).outcome == "not_scored"
    assert decide(bare).headline.startswith("Not scored: neither the evidence stage nor a pair's joint ablation")


def test_without_the_evidence_field_the_pair_rows_roles_decide_and_the_classifier_never_verifies():
    bare = {"tasks": {TASK: {"clean": {"logit_diff": 3.0, "acc": 1.0}}}}
    tv = decide(bare, [_row()]).for_task(TASK)
    assert tv.outcome == "verified" and tv.gather_heads == ("L0H3",) and tv.aggregate_heads == ("L3H0",)
    tv = decide(bare, [_row(roles=(None, None), p_gather=0.9, p_aggregate=0.8)]).for_task(TASK)
    assert tv.outcome == "ga_like" and tv.verified_pairs == () and "evidence stage did not run" in tv.sentence
    tv = decide(bare, [_row(roles=(None, None), p_gather=0.9, p_aggregate=0.1)]).for_task(TASK)
    assert tv.outcome == "none" and tv.confidence == "low"


def test_several_tasks_and_top_pairs_entries():
    summary = _summary()
    summary["tasks"]["kv"] = {"clean": {"logit_diff": 2.0, "acc": 0.9}}
    top = {"task": "kv", "gather": {"layer": 1, "head": 0, "kind": "ssm"},
           "aggregate": {"layer": 2, "head": 1, "kind": "ssm"}, "joint_effect": -1.0, "joint_effect_lo": -1.2,
           "joint_effect_hi": -0.8, "control_effect": 0.0, "control_q05": -0.1, "control_n": 50, "control_p": 1 / 51,
           "gather_role": "gather", "aggregate_role": "aggregate", "p_gather": 0.6, "p_aggregate": 0.7}
    summary["top_pairs"] = [_row(), top]
    verdict = decide(summary)  # without pair rows: the summary's top_pairs
    assert [t.task for t in verdict.tasks] == [TASK, "kv"]
    kv = verdict.for_task("kv")
    assert kv.outcome == "verified" and kv.verified_pairs[0].gather.name == "L1S0"
    assert "p = 0.0196, n = 50 controls" in kv.sentence and kv.verified_pairs[0].control_mean_drop == 0.0
    assert verdict.headline.startswith("mc: G&A verified: gather L0H3") and " kv: G&A verified: gather L1S0" \
        in verdict.headline
    assert verdict.for_task("absent") is None


def test_as_dict_round_trips_through_json():
    rows = [_row(), _row(g=(1, 0), rank=2, n=9, p=0.1)]
    verdict = decide(_summary(gathers=("L0H3", "L1H0")), rows)
    data = json.loads(json.dumps(verdict.as_dict()))
    assert data["headline"] == verdict.headline and data["tasks"][0]["outcome"] == "verified"
    assert data["tasks"][0]["pairs"][0]["joint_drop"] == 6.0 and data["tasks"][0]["pairs"][1]["control_n"] == 9
    back = Verdict.from_dict(data)
    assert back == verdict
    assert back.for_task(TASK).verified_pairs == verdict.for_task(TASK).verified_pairs


def test_decide_scan_reads_the_pair_table(tmp_path):
    import polars as pl

    from discovery.artifacts import Scan

    scan = Scan(tmp_path, _summary(), pl.DataFrame({"task": [TASK]}), pairs=pl.DataFrame([_row(), _row(rank=2, n=9,
                                                                                                   p=0.1)]))
    tv = decide_scan(scan).for_task(TASK)
    assert tv.outcome == "verified" and len(tv.pairs) == 2 and tv.pairs[1].status == "not_testable"


# --- rule 8: refined Mamba-1 channels ------------------------------------------------------------------

def _refined(summary: dict, leaves: list[tuple[str, int, int, float, float]], *, level: int = 3) -> dict:
    """``summary`` with a refinement record whose leaves are ``(name, layer, channel, drop, drop_lo)``: single
    channels (the refined heads' numbers, ``L1S32``, are inventory slots after the 32 groups)."""
    summary["tasks"][TASK]["refinement"] = {
        "status": "done", "effect": 0.1,
        "leaves": [{"head": name, "layer": layer, "index": int(name.split("S")[1]), "channel_start": channel,
                    "channel_end": channel + 1, "level": level, "kind": "channel", "drop": d, "drop_lo": lo,
                    "drop_hi": d + 0.5} for name, layer, channel, d, lo in leaves]}
    return summary


def _ssm_row(g: tuple[int, int], a: tuple[int, int], **kw) -> dict:
    return {**_row(g, a, **kw), "gather_kind": "ssm", "aggregate_kind": "ssm"}


MAMBA1_LEAVES = [("L0S32", 0, 72, 0.907, 0.396), ("L0S33", 0, 73, 0.406, 0.066), ("L1S32", 1, 195, 1.19, 0.675)]


def test_the_verdict_names_the_refined_channels_that_carry_the_task():
    """The committed Mamba-1 toy's case (reports/toy-mc-mamba1, clean 8.82): no G&A role; the evidence calls the
    groups L0S9, L1S24 and the refined channels L0S32 (ch 72), L1S32 (ch 195) important, L0S33 (ch 73) not."""
    plain = _summary(gathers=(), aggregates=(), decoys=("L3S5",), others=("L0S9", "L1S24", "L0S32", "L1S32"), ld=8.82)
    rows = [_ssm_row((0, 9), (3, 29), roles=("other_important", "other_important"))]
    before = decide(plain, rows).for_task(TASK)
    assert before.sentence == ("No G&A here: no head has a gather or aggregate role by the evidence standards (L0S9 → "
                               "L3S29 beats the controls, but as important heads, not G&A heads). Decoys (G&A-like "
                               "pattern, no effect): L3S5.") and before.channels == ()
    tv = decide(_refined(plain, MAMBA1_LEAVES), rows).for_task(TASK)
    assert tv.outcome == "none" and tv.confidence == "medium"
    # largest drop first; the claim, then the channels, then the decoys
    assert tv.sentence == ("No G&A here: no head has a gather or aggregate role by the evidence standards (L0S9 → "
                           "L3S29 beats the controls, but as important heads, not G&A heads). Refined channels that "
                           "carry the task without a G&A role: L1S32 (ch 195, drop 1.19), L0S32 (ch 72, drop 0.907). "
                           "Decoys (G&A-like pattern, no effect): L3S5.")
    assert tv.channels == ("L1S32 (ch 195)", "L0S32 (ch 72)")
    assert tv.reason.endswith("L0S9, L1S24, L0S32 (ch 72), L1S32 (ch 195)")
    # a leaf at group level (a whole group left as a redundant set) is a group head: no channel label
    whole = _refined(_summary(gathers=(), aggregates=(), decoys=(), others=("L1S24",)), [("L1S24", 1, 192, 1.2, 0.7)],
                     level=0)
    assert decide(whole, []).for_task(TASK).channels == ()


def test_a_refined_channel_in_a_verified_pair_is_named_by_its_channel():
    """A refined channel as the gather head of a verified pair: the claim names its channel; a second refined
    channel that matters without a role follows the claim, outside it (the G&A claim names only pair heads)."""
    summary = _refined(_summary(gathers=("L0S32",), aggregates=("L3S29",), decoys=(), others=("L1S32", "L0S9"),
                                clean_pairs=(("L0S32", "L3S29"),)), MAMBA1_LEAVES)
    tv = decide(summary, [_ssm_row((0, 32), (3, 29))]).for_task(TASK)
    assert tv.outcome == "verified" and tv.confidence == "high"
    assert tv.sentence == ("G&A verified: gather L0S32 (ch 72) → aggregate L3S29 (joint drop 6 [5.5, 6.5] vs control "
                           "mean 0.1, p = 0.0244, n = 40 controls, controls from ±1 layer). Refined channels that "
                           "matter without a G&A role: L1S32 (ch 195, drop 1.19).")
    claim = re.split(r"Refined channels|Decoys", tv.sentence)[0]
    assert set(re.findall(r"\bL\d+[HS]\d+\b", claim)) == {"L0S32", "L3S29"}
    assert "confirms L0S32 (ch 72) → L3S29" in tv.reason
    # ga_like: the role list names the channel too
    tv = decide(summary, [_ssm_row((0, 32), (3, 29), p=0.3)]).for_task(TASK)
    assert tv.outcome == "ga_like" and tv.sentence.startswith("G&A-like heads (gather L0S32 (ch 72); aggregate L3S29)")


def test_without_the_evidence_stage_the_refined_channels_whose_drop_counts_are_named():
    """No evidence stage: the leaves whose drop reaches the refinement's threshold (10% of clean 8.82 = 0.882,
    interval above 0) are named; L0S33 (0.406) is not."""
    bare = _refined({"tasks": {TASK: {"clean": {"logit_diff": 8.82, "acc": 1.0}}}}, MAMBA1_LEAVES)
    tv = decide(bare, [_ssm_row((0, 9), (3, 29), roles=(None, None), p=0.3, p_gather=0.1, p_aggregate=0.3)]).for_task(TASK)
    assert tv.outcome == "none" and tv.channels == ("L1S32 (ch 195)", "L0S32 (ch 72)")
    assert tv.sentence.endswith("the evidence stage did not run. Refined channels that carry the task: "
                                "L1S32 (ch 195, drop 1.19), L0S32 (ch 72, drop 0.907).")
    tv = decide(bare, []).for_task(TASK)
    assert tv.outcome == "not_scored" and tv.sentence.endswith("Refined channels that matter: L1S32 (ch 195, drop "
                                                               "1.19), L0S32 (ch 72, drop 0.907).")
