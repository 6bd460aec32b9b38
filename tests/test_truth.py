"""Ground truth and the scan on a planted G&A circuit: both find exactly the planted heads."""
from __future__ import annotations

import pytest

from discovery.rank.truth import ground_truth
from discovery.tasks.base import annotate
from discovery.toy.planted import planted_model, planted_prompts, write_prompts


@pytest.fixture(scope="module")
def circuit():
    return planted_model()


def test_truth_names_the_planted_pair_and_no_decoy(circuit):
    batch = annotate(planted_prompts(16), circuit.lm.tokenizer, padding_side="left")
    truth = ground_truth(circuit.lm, batch)
    assert truth["clean"]["acc"] == 1.0
    as_tuple = lambda d: (d["layer"], d["head"])
    assert [as_tuple(g) for g in truth["gather"]] == [(circuit.gather.layer, circuit.gather.index)]
    assert [as_tuple(a) for a in truth["aggregate"]] == [(circuit.aggregate.layer, circuit.aggregate.index)]
    confirmed = [p for p in truth["pairs"] if p["confirmed"]]
    assert len(confirmed) == 1 and confirmed[0]["selection_without_gather"] < 0.5
    assert confirmed[0]["mediated"] >= 0.5  # the planted gather head acts through the aggregate head
    roles = {(r["layer"], r["head"]): r["role"] for r in truth["heads"]}
    for decoy in circuit.decoys.values():
        assert roles[(decoy.layer, decoy.index)] == "none"
    assert truth["margin"]["ratio"] > 20  # G&A effects dwarf every other head's


def test_scan_ranks_the_planted_heads_first(tmp_path):
    """The scan (patterns + effects) on the planted circuit without decoys: the gather head has the top
    gather score, the aggregate head the top aggregate focus, and they are the two largest effects."""
    from pipelines.sweep import ScanOptions, scan_task

    circuit = planted_model(decoys=False)
    task = write_prompts(tmp_path / "planted.jsonl", 16)
    options = ScanOptions(tasks=[f"jsonl:{task}"], ablation="exact", prompts=16, bootstrap=200)
    frame, summary = scan_task(circuit.lm, f"jsonl:{task}", options)
    assert summary["clean"]["acc"] == 1.0
    key = lambda row: (row["layer"], row["head"])
    top_gather = frame.sort("gather_score", descending=True).row(0, named=True)
    top_aggregate = frame.sort("agg_focus", descending=True).row(0, named=True)
    assert key(top_gather) == (circuit.gather.layer, circuit.gather.index)
    assert key(top_aggregate) == (circuit.aggregate.layer, circuit.aggregate.index)
    top_two = {key(r) for r in frame.sort("d_ld_all").head(2).iter_rows(named=True)}
    assert top_two == {(circuit.gather.layer, circuit.gather.index), (circuit.aggregate.layer, circuit.aggregate.index)}
    # the aggregate head's effect lives at the query position, the gather head's does not
    by_key = {key(r): r for r in frame.iter_rows(named=True)}
    agg, gat = by_key[(circuit.aggregate.layer, circuit.aggregate.index)], by_key[(circuit.gather.layer, circuit.gather.index)]
    assert agg["d_ld_query"] < 0.5 * agg["d_ld_all"]
    assert abs(gat["d_ld_query"]) < 0.1 * abs(gat["d_ld_all"])
    assert agg["d_ld_all_hi"] < 0  # the bootstrap interval excludes zero


def test_truth_finds_redundant_aggregate_copies_as_a_set():
    """Three copies of the aggregate head: none breaks the task alone, ablating them together at the
    query does, so all three aggregate (and the gather head is confirmed against them); the decoys,
    selective but without effect, stay out of the set."""
    circuit = planted_model(aggregate_copies=3)
    batch = annotate(planted_prompts(16), circuit.lm.tokenizer, padding_side="left")
    truth = ground_truth(circuit.lm, batch)
    as_tuple = lambda d: (d["layer"], d["head"])
    copies = {(h.layer, h.index) for h in [circuit.aggregate, *circuit.copies]}
    assert len(copies) == 3
    rows = {(r["layer"], r["head"]): r for r in truth["heads"]}
    assert not any(rows[c]["breaks_task"] for c in copies)  # each alone falls short
    assert {as_tuple(a) for a in truth["aggregate"]} == copies
    group = truth["aggregate_set"]
    assert {as_tuple(h) for h in group["heads"]} == copies and group["breaks_task"]
    assert group["d_ld_query_joint"] <= -truth["rules"]["break_fraction"] * truth["clean"]["logit_diff"]
    assert [as_tuple(g) for g in truth["gather"]] == [(circuit.gather.layer, circuit.gather.index)]
    (joint,) = truth["joint_mediation"]
    assert {as_tuple(h) for h in joint["set"]} == copies and joint["set_mediated"] >= 0.5
    assert all(p["confirmed"] and p["set_mediated"] == joint["set_mediated"] for p in truth["pairs"])
    for decoy in circuit.decoys.values():
        assert rows[(decoy.layer, decoy.index)]["role"] == "none"
    margin = truth["pattern_margin"]["aggregate"]
    assert margin["weakest_labelled"] > margin["strongest_other"] + 0.3
