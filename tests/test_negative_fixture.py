"""Negative fixtures (issue: evidence standards): trained toy models without a clean G&A circuit.

``mc1-transformer`` (single-word options) and ``mc3-transformer`` (three-word options) solve
their task (≥ 0.96 accuracy) with heads at the option tokens and query heads that spread their
attention; heads with a G&A-like pattern and no effect sit among them. The full scan (patterns, exact
sweep, evidence, pairs, report) must name those heads ``decoy``, say "no G&A", and report no confident
G&A pair.
"""
from __future__ import annotations

import json

import polars as pl
import pytest

from discovery.evidence import EvidenceThresholds
from discovery.toy import bundled_model_path
from pipelines.cli import main

# model -> the decoys its committed scan names (pattern without effect)
FIXTURES = {"mc1-transformer": {"L3H1"}, "mc3-transformer": {"L3H3"}}


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def scanned(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    assert main(["scan", str(bundled_model_path(request.param)), "--out", str(out)]) == 0
    return request.param, out


def test_pattern_without_effect_is_a_decoy_and_no_pair_is_confident(scanned):
    name, out = scanned
    th = EvidenceThresholds()
    summary = json.loads((out / "summary.json").read_text())
    clean_ld = summary["tasks"]["mc"]["clean"]["logit_diff"]
    assert summary["tasks"]["mc"]["clean"]["acc"] >= 0.9  # the model does the task ...
    evidence = summary["evidence"]["mc"]
    assert evidence["verdict"] == "none"  # ... without G&A
    roles = {r["head"]: r["role"] for r in evidence["roles"]}
    decoys = {h for h, role in roles.items() if role == "decoy"}
    assert decoys == FIXTURES[name]
    heads = pl.read_parquet(out / "heads.parquet")
    patterned_without_effect = 0
    for r in heads.iter_rows(named=True):
        pattern = (r["selectivity"] >= th.selectivity or r["agg_select"] >= th.agg_select
                   or (r["gather_score"] or 0.0) >= th.gather_score)
        no_effect = all(abs(r[c]) < th.noise * clean_ld for c in ("d_ld_all", "d_ld_query"))
        if pattern and no_effect:
            patterned_without_effect += 1
            assert roles.get(f"L{r['layer']}H{r['head']}") == "decoy", r
    assert patterned_without_effect >= 1
    assert not any(p.get("confident") for p in summary["top_pairs"])
    assert summary["gather_heads"] == [] and summary["aggregate_heads"] == []  # the classifier flags no head
    assert not evidence["details"]["pairs"]
    report = (out / "report.md").read_text()
    verdict = summary["verdict"]["tasks"][0]
    assert verdict["outcome"] == "none" and "G&A verified" not in report  # a pair may beat the controls, but no
    assert not any(p["status"] == "verified" and p["gather_role"] == "gather" and p["aggregate_role"] == "aggregate"
                   for p in verdict["pairs"])  # verified pair joins heads with G&A roles
    assert all(d in report.split("## Pattern without effect")[1] for d in decoys)
