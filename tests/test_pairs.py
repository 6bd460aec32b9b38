"""Pair ranking on a planted G&A circuit (weights set by hand), scanned with gascan's own scan."""
from __future__ import annotations

import json

import polars as pl
import pytest

from discovery.artifacts import write_pairs
from discovery.heads import HeadId
from discovery.rank.pairs import PAIR_COLUMNS, aggregate_metrics_under, rank_pairs
from discovery.tasks.base import annotate
from discovery.toy.planted import planted_model, planted_prompts, write_prompts

# a layout that is not among the classifier's training variants (discovery.classifier_data.PLANTED_VARIANTS)
LAYOUT = {"n_layers": 4, "n_heads": 4, "gather": (0, 3), "aggregate": (3, 0), "seed": 11}


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    from discovery.artifacts import write_scan
    from pipelines.sweep import ScanOptions, scan_model

    circuit = planted_model(**LAYOUT)
    out = tmp_path_factory.mktemp("planted")
    task = f"jsonl:{write_prompts(out / 'prompts.jsonl', 16, seed=3)}"
    heads, summary = scan_model(circuit.lm, ScanOptions(tasks=[task], prompts=16, bootstrap=200))
    write_scan(out, heads, summary)
    batch = annotate(planted_prompts(16, seed=3), circuit.lm.tokenizer, padding_side="left")
    return circuit, heads, summary, batch, out


def test_planted_circuit_works_and_needs_both_heads(planted):
    circuit, heads, summary, _, _ = planted
    clean = next(iter(summary["tasks"].values()))["clean"]
    assert clean["acc"] == 1.0 and clean["logit_diff"] > 5
    by_head = {(r["layer"], r["head"]): r for r in heads.iter_rows(named=True)}
    g, a = by_head[(0, 3)], by_head[(3, 0)]
    assert g["d_acc_all"] <= -0.5 and abs(g["d_ld_query"]) < 0.1  # gather acts before the query
    assert a["d_acc_query"] <= -0.5  # aggregate acts at the query
    others = [r for k, r in by_head.items() if k not in ((0, 3), (3, 0))]
    assert max(abs(r["d_ld_all"]) for r in others) < 0.1 * clean["logit_diff"]
    decoy = by_head[(circuit.decoys["aggregate"].layer, circuit.decoys["aggregate"].index)]
    assert decoy["agg_select"] >= 0.9 and abs(decoy["d_ld_all"]) < 0.05 * clean["logit_diff"]  # pattern, no effect


def test_ranking_finds_the_planted_pair_first_and_verifies_it(planted):
    circuit, heads, summary, batch, out = planted
    table, fields = rank_pairs(circuit.lm, batch, heads, k=3, summary=summary, n_gather=4, n_aggregate=4,
                               control_draws=50, bootstrap=200)
    assert set(table.columns) == set(PAIR_COLUMNS)
    best = table.sort("rank").row(0, named=True)
    assert (best["gather_layer"], best["gather_head"]) == (0, 3)
    assert (best["aggregate_layer"], best["aggregate_head"]) == (3, 0)
    # interaction test: without the gather head the aggregate head no longer selects the gold segment
    assert best["select_clean"] == 1.0 and best["select_drop"] >= 0.5
    # ... and holding the aggregate head at its clean output gives back the gather head's cost
    assert best["mediated"] >= 0.9
    # joint ablation against random control pairs: the pair's own layers hold 3 x 3 = 9 (too few for p <= 0.05),
    # so the pool widens to layers within ±1: gather layer 0 or 1, aggregate layer 2 or 3, neither head L0H3 or
    # L3H0: (0,2) 3 x 4 + (0,3) 3 x 3 + (1,2) 4 x 4 + (1,3) 4 x 3 = 49 pairs, all used (control_draws 50)
    assert best["control_n"] == 49 and best["control_layers"] == "±1 layer"
    assert best["control_p"] == pytest.approx(1 / 50)  # no control hurts as much as the planted pair
    assert best["verified"] is True and best["joint_effect_hi"] < best["control_q05"]
    assert best["joint_effect"] < -0.5 * next(iter(summary["tasks"].values()))["clean"]["logit_diff"]
    assert abs(best["control_mean"]) < 0.5
    # a pair with the decoy gather head (same pattern, output unused) scores far lower
    decoy = circuit.decoys["gather"]
    with_decoy = table.filter((pl.col("gather_layer") == decoy.layer) & (pl.col("gather_head") == decoy.index)
                              & (pl.col("aggregate_layer") == 3) & (pl.col("aggregate_head") == 0))
    if with_decoy.height:
        assert with_decoy["score"][0] < 0.2 * best["score"]
        assert (with_decoy["select_drop"][0] or 0.0) < 0.2
        assert with_decoy["mediated"][0] is None  # the decoy costs nothing at the segments: nothing to mediate
    top = fields["top_pairs"][0]
    assert top["gather"] == {"layer": 0, "head": 3, "kind": "attn"}
    assert top["aggregate"] == {"layer": 3, "head": 0, "kind": "attn"}
    assert top["joint_effect"] == pytest.approx(best["joint_effect"]) and top["verified"] is True
    assert fields["aggregate_heads"][0]["head"] == 0 and fields["aggregate_heads"][0]["p"] >= 0.5
    assert top["control_n"] == 49 and top["control_layers"] == "±1 layer"
    # written next to the scan
    write_pairs(out, table, fields)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["top_pairs"][0]["gather"]["head"] == 3
    # the scan ran no evidence stage, so no role is confirmed: the pair beats the controls, but the verdict
    # calls it G&A-like (the classifier alone never verifies a G&A pair)
    from discovery.artifacts import read_scan
    from discovery.rank.verdict import decide_scan

    tv = decide_scan(read_scan(out)).tasks[0]
    assert tv.outcome == "ga_like" and tv.pairs[0].status == "verified" and tv.verified_pairs == ()
    assert "evidence stage did not run" in tv.sentence and top["confident"] is False


def test_with_evidence_roles_the_verdict_verifies_the_planted_pair(planted):
    """The evidence stage's roles on the true heads (as its table carries them): the top pair is verified
    against 49 controls from neighbouring layers, and the verdict's sentence quotes its numbers as drops."""
    from discovery.rank.verdict import decide

    circuit, heads, summary, batch, _ = planted
    roles = {(0, 3): "gather", (3, 0): "aggregate"}
    frame = heads.with_columns(role=pl.Series([roles.get((r["layer"], r["head"]), "none")
                                               for r in heads.iter_rows(named=True)]))
    table, fields = rank_pairs(circuit.lm, batch, frame, k=1, summary=summary, n_gather=2, n_aggregate=2,
                               control_draws=50, bootstrap=200)
    best = table.sort("rank").row(0, named=True)
    assert (best["gather_layer"], best["gather_head"], best["aggregate_layer"], best["aggregate_head"]) == (0, 3, 3, 0)
    assert (best["gather_role"], best["aggregate_role"]) == ("gather", "aggregate")
    assert best["control_n"] == 49 and best["control_p"] == pytest.approx(0.02) and best["verified"] is True
    assert fields["top_pairs"][0]["confident"] is True
    tv = decide(summary, table.to_dicts()).tasks[0]
    assert tv.outcome == "verified" and [(p.gather.name, p.aggregate.name) for p in tv.verified_pairs] == \
        [("L0H3", "L3H0")]
    call = tv.verified_pairs[0]
    assert call.joint_drop == pytest.approx(-best["joint_effect"]) and call.joint_drop > 0
    assert call.joint_drop_lo == pytest.approx(-best["joint_effect_hi"])
    assert call.control_q95_drop == pytest.approx(-best["control_q05"]) and call.joint_drop_lo > call.control_q95_drop
    assert tv.sentence.startswith("G&A verified: gather L0H3 → aggregate L3H0 (joint drop ")
    assert "p = 0.02, n = 49 controls, controls from ±1 layer)" in tv.sentence


def test_control_pool_widens_to_neighbouring_layers_when_two_layers_hold_too_few_heads(planted):
    """4 heads a layer: the pair's own layers give 3 x 3 = 9 controls; the pool widens until it holds at least
    19, same kinds, the control's gather layer before its aggregate layer, never one of the pair's heads,
    the nearest layers first, and the same draws every time (seeded)."""
    from discovery.rank.pairs import control_pool

    circuit = planted[0]
    inv = circuit.lm.inventory
    g, a = HeadId(1, 0, "attn"), HeadId(2, 3, "attn")
    pool, distance = control_pool(inv, g, a, 50, seed=0)
    assert distance == 1 and len(pool) == 50  # 9 same-layer + 64 within ±1, capped at 50
    assert all(x.layer < y.layer and x.kind == y.kind == "attn" and not {x, y} & {g, a} for x, y in pool)
    assert all((x.layer, y.layer) == (1, 2) for x, y in pool[:9])  # the same layers come first, all of them
    assert len(set(pool)) == 50 and {abs(x.layer - 1) for x, _ in pool} | {abs(y.layer - 2) for _, y in pool} == {0, 1}
    assert control_pool(inv, g, a, 50, seed=0) == (pool, 1) and control_pool(inv, g, a, 50, seed=1)[0] != pool
    assert control_pool(inv, g, a, 9, seed=0)[1] == 0 and len(control_pool(inv, g, a, 9, seed=0)[0]) == 9
    # adjacent layers at the top of the model: (2, 3) gives 9; ±1 adds (1, 2) 4 x 3 and (1, 3) 4 x 3 (no layer 4)
    pool, distance = control_pool(inv, HeadId(2, 1, "attn"), HeadId(3, 2, "attn"), 50)
    assert distance == 1 and len(pool) == 9 + 4 * 3 + 4 * 3


def test_evidence_roles_outrank_classifier_probabilities_in_the_pair_score(planted):
    """A head the evidence stage calls gather/aggregate weighs 1 in the pair score, whatever the classifier
    says: with tiny probabilities on the true heads and larger ones on two unrelated heads, the evidence
    pair still ranks first (before the fix the unrelated pair won, 0.05 x 0.05 against 0.01 x 0.01)."""
    circuit, heads, _summary, batch, _ = planted
    keyed = {(0, 3): (0.01, 0.0, "gather"), (3, 0): (0.0, 0.01, "aggregate"),
             (1, 1): (0.05, 0.0, "none"), (2, 2): (0.0, 0.05, "none")}
    rows = [keyed.get((r["layer"], r["head"]), (0.0, 0.0, "none")) for r in heads.iter_rows(named=True)]
    frame = heads.with_columns(p_gather=pl.Series([r[0] for r in rows]), p_aggregate=pl.Series([r[1] for r in rows]),
                               role=pl.Series([r[2] for r in rows]))
    table, _ = rank_pairs(circuit.lm, batch, frame, k=1, n_gather=2, n_aggregate=2, control_draws=9, bootstrap=100)
    best = table.sort("rank").row(0, named=True)
    assert (best["gather_layer"], best["gather_head"], best["aggregate_layer"], best["aggregate_head"]) == (0, 3, 3, 0)
    assert best["p_gather"] == pytest.approx(0.01) and best["score"] >= 0.4
    other = table.filter((pl.col("gather_layer") == 1) & (pl.col("aggregate_layer") == 2)).row(0, named=True)
    assert other["score"] < 0.01


def test_interaction_patterns_follow_the_ablation(planted):
    circuit, _, _, batch, _ = planted
    a, g = HeadId(3, 0, "attn"), HeadId(0, 3, "attn")
    clean = aggregate_metrics_under(circuit.lm, batch, None, [a])[a]
    knocked = aggregate_metrics_under(circuit.lm, batch, g, [a])[a]
    unrelated = aggregate_metrics_under(circuit.lm, batch, HeadId(1, 0, "attn"), [a])[a]
    assert clean["agg_focus"] > 0.9 and knocked["agg_focus"] < 0.5
    assert unrelated["agg_focus"] == pytest.approx(clean["agg_focus"], abs=0.05)


def test_a_pair_is_confident_only_when_verified_and_its_heads_have_evidence_roles():
    """``confident`` (the top_pairs field) is the verdict's rule: at least 19 controls, p <= 0.05, both
    heads G&A by the evidence standards; classifier probabilities alone no longer make a pair confident."""
    from discovery.rank.pairs import is_confident

    base = {"control_n": 40, "control_p": 1 / 41, "joint_effect_hi": -3.0, "control_q05": -0.5,
            "p_gather": 0.9, "p_aggregate": 0.9, "gather_role": "gather", "aggregate_role": "aggregate"}
    assert is_confident(base)
    assert not is_confident({**base, "gather_role": "other_important"})  # important heads beat random pairs too
    assert not is_confident({**base, "gather_role": None, "aggregate_role": None})  # the classifier alone: no
    assert not is_confident({**base, "control_n": 9, "control_p": 0.1})  # 9 controls: not testable
    assert not is_confident({**base, "control_p": 3 / 41})  # not significant at 5%
    assert not is_confident({**base, "joint_effect_hi": -0.4})  # interval reaches the controls


def test_tested_pairs_from_the_same_layers_share_their_controls(planted):
    """The control order is one seeded order of control pairs, so two tested pairs from the same layers take
    the same controls wherever both may (fewer distinct verification ablations), each still a seeded sample
    of its own eligible controls that never holds one of its own heads."""
    from discovery.rank.pairs import control_pool

    inv = planted[0].lm.inventory
    a = HeadId(2, 3, "attn")
    first, second = HeadId(1, 0, "attn"), HeadId(1, 1, "attn")
    pool_1, _ = control_pool(inv, first, a, 50, seed=0)
    pool_2, _ = control_pool(inv, second, a, 50, seed=0)
    assert not any({first, a} & set(p) for p in pool_1) and not any({second, a} & set(p) for p in pool_2)
    both = [p for p in pool_1 if second not in p]  # pool_1's controls that pool_2 may hold too
    assert [p for p in pool_2 if first not in p] == both  # ... it holds them all, in the same order
    assert len(set(pool_1) | set(pool_2)) <= 50 + 15 < 100  # 65 distinct ablations, not 100


def test_verification_goes_to_the_pairs_that_can_be_ga_pairs():
    """With the evidence stage's roles, only pairs whose two heads have their G&A roles are verified (the top
    ``k`` of them, in rank order); without such a pair the top pair alone; without roles the top ``k``."""
    from discovery.rank.pairs import verification_choice

    def row(rank: int, g: str | None, a: str | None) -> dict:
        return {"rank": rank, "gather_role": g, "aggregate_role": a}

    rows = [row(1, "other_important", "aggregate"), row(2, "gather", "aggregate"), row(3, "none", "aggregate"),
            row(4, "gather", "aggregate"), row(5, "gather", "other_important")]
    assert [r["rank"] for r in verification_choice(rows, 3)] == [2, 4]
    assert [r["rank"] for r in verification_choice(rows, 1)] == [2]
    no_ga = [row(1, "other_important", "aggregate"), row(2, "gather", "none")]
    assert [r["rank"] for r in verification_choice(no_ga, 3)] == [1]
    no_roles = [row(i, None, None) for i in (1, 2, 3, 4)]
    assert [r["rank"] for r in verification_choice(no_roles, 3)] == [1, 2, 3]
    assert verification_choice([], 3) == []


def test_a_pair_without_ga_roles_is_ranked_but_not_verified(planted):
    """On the planted circuit with an important head beside the true gather head (roles as the evidence stage
    writes them), the pair table ranks both gather heads' pairs, the joint ablation and its controls run for
    the G&A pair only, and the budget record counts one pair of one to verify."""
    from discovery.evidence.budget import Ledger

    circuit, heads, summary, batch, _ = planted
    roles = {(0, 3): "gather", (3, 0): "aggregate", (1, 1): "other_important"}
    frame = heads.with_columns(role=pl.Series([roles.get((r["layer"], r["head"]), "none")
                                               for r in heads.iter_rows(named=True)]))
    ledger = Ledger(None)
    table, _ = rank_pairs(circuit.lm, batch, frame, k=3, summary=summary, n_gather=2, n_aggregate=1,
                          control_draws=19, bootstrap=100, ledger=ledger)
    tested = table.filter(pl.col("control_n").is_not_null())
    assert table.height >= 2
    assert tested.select("gather_layer", "gather_head", "aggregate_layer", "aggregate_head").rows() == [(0, 3, 3, 0)]
    assert tested["verified"].to_list() == [True] and tested["control_n"].to_list() == [19]
    part = next(p for p in ledger.record()["parts"] if p["part"] == "pairs (verification)")
    assert (part["pairs"], part["of"]) == (1, 1)
