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
    # joint ablation against random pairs from the same layers (3 x 3 = 9 pairs, all used)
    assert best["control_n"] == 9 and best["verified"] is True
    assert best["joint_effect_hi"] < best["control_q05"]
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
    # written next to the scan: the report's verdict names the pair
    write_pairs(out, table, fields)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["top_pairs"][0]["gather"]["head"] == 3
    from discovery.report import write_report

    write_report(out, circuit.lm)
    # the verdict sentence is decide()'s (discovery.rank.verdict); the report lists the pair first
    assert "| 1 | L0H3 | L3H0 |" in (out / "report.md").read_text()


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


def test_a_pair_is_confident_only_when_verified_and_its_heads_look_like_g_and_a():
    from discovery.rank.pairs import is_confident

    base = {"verified": True, "p_gather": 0.1, "p_aggregate": 0.1, "gather_role": "other_important",
            "aggregate_role": "other_important"}
    assert not is_confident(base)  # two important heads beat random pairs: not G&A evidence
    no_evidence = {**base, "gather_role": None, "aggregate_role": None}
    assert is_confident({**no_evidence, "p_gather": 0.9, "p_aggregate": 0.6})  # the classifier sees the roles
    assert not is_confident({**no_evidence, "p_gather": 0.9, "p_aggregate": 0.4})
    # where the evidence stage ran, its roles overrule the classifier (a toy Mamba-2's important SSM heads
    # had P >= 0.5 but unselective patterns)
    assert not is_confident({**base, "p_gather": 0.9, "p_aggregate": 0.6})
    assert is_confident({**base, "gather_role": "gather", "aggregate_role": "aggregate"})  # the evidence stage does
    assert not is_confident({**base, "gather_role": "gather", "aggregate_role": "aggregate", "verified": False})
    assert not is_confident({**base, "p_gather": 0.9, "p_aggregate": 0.9, "verified": None})
