"""Evidence on a budget: the candidate rule picks the heads it says it picks, the ledger shares the budget as
documented, the budget bounds what the evidence and pair stages run, and a budgeted scan of a bundled toy
reaches the verdict of the unbounded one (every bundled toy: tests/test_consistency.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from discovery.evidence.budget import (
    MIN_PASSES,
    SHARES,
    Ledger,
    all_position_sweep_fe,
    candidate_counts,
    choose_candidates,
    default_budget,
    resolve_budget,
)
from discovery.evidence.thresholds import EvidenceThresholds
from discovery.heads import HeadId
from pipelines.validate import budget as parse_budget


def _row(layer: int, head: int, effect: float, half_width: float = 0.1, *, selectivity: float = 0.1,
         gather_score: float = 0.0) -> dict:
    return {"layer": layer, "head": head, "kind": "attn", "d_ld_all": effect, "d_ld_all_lo": effect - half_width,
            "d_ld_all_hi": effect + half_width, "selectivity": selectivity, "agg_select": 0.0,
            "gather_score": gather_score}


def test_the_candidate_rule_takes_effects_first_then_patterns():
    """Clean logit difference 4: noise 0.05 -> |effect| >= 0.2 with an interval excluding 0 counts."""
    frame = pl.DataFrame([
        _row(0, 0, -2.0),  # strongest effect
        _row(0, 1, -1.0),
        _row(1, 0, -0.5),
        _row(1, 1, -0.3, half_width=0.5),  # interval includes 0: no effect
        _row(2, 0, 0.0, selectivity=0.9),  # pattern, no effect
        _row(2, 1, -0.25, gather_score=0.7),  # weaker pattern, a weak effect
        _row(3, 0, 0.01),  # nothing
    ])
    th = EvidenceThresholds()
    chosen, why = choose_candidates(frame, 4.0, th, limit=3)
    # two places (ceil(3 * 2/3)) to the strongest effects, one to the strongest pattern (a decoy candidate)
    assert chosen == [HeadId(0, 0, "attn"), HeadId(0, 1, "attn"), HeadId(2, 0, "attn")]
    assert [why[h] for h in chosen] == ["effect", "effect", "pattern"]
    chosen, why = choose_candidates(frame, 4.0, th, limit=5)  # 4 effect places: (2, 1) comes in by its effect
    assert set(chosen) == {HeadId(0, 0, "attn"), HeadId(0, 1, "attn"), HeadId(1, 0, "attn"), HeadId(2, 1, "attn"),
                           HeadId(2, 0, "attn")}
    assert why[HeadId(2, 0, "attn")] == "pattern" and why[HeadId(2, 1, "attn")] == "effect"
    chosen, _ = choose_candidates(frame.filter(pl.col("selectivity") < 0.5), 4.0, th, limit=5)
    assert HeadId(1, 1, "attn") not in chosen and HeadId(3, 0, "attn") not in chosen  # no effect, no pattern
    everyone, _ = choose_candidates(frame, 4.0, th, limit=None)
    assert len(everyone) == frame.height


def test_bounded_parts_try_every_candidate_count_from_24_down_to_5():
    assert candidate_counts(72) == list(range(24, 4, -1))  # Gemma3-270M: 9 fits its default, 8 loses L5H3
    assert candidate_counts(10) == [9, 8, 7, 6, 5] and candidate_counts(5) == [] and candidate_counts(3) == []


def test_the_ledger_shares_the_budget_in_order_and_unbounded_allows_everything():
    ledger = Ledger(100.0)
    assert ledger.allowance("position effects") == pytest.approx(100 * SHARES["position effects"])
    ledger.charge("position effects", 15.0, 10.0)  # 5 left unspent: the next part may use it
    first, second = list(SHARES)[:2]
    assert ledger.allowance(second) == pytest.approx(100 * (SHARES[first] + SHARES[second]) - 10)
    assert ledger.allowance("pairs") == pytest.approx(90.0)
    back = Ledger.from_record(ledger.record(), 100.0)
    assert back.spent == pytest.approx(10.0) and back.allowance("pairs") == pytest.approx(90.0)
    assert Ledger(None).allowance("pairs") is None


def test_budget_values_parse_and_resolve():
    assert parse_budget("auto") == ("auto", None) and parse_budget("none") == ("none", None)
    assert parse_budget("120") == ("fe", 120.0) and parse_budget("90s") == ("s", 90.0)
    for bad in ("-3", "0", "lots", "inf"):
        with pytest.raises(Exception, match="is not a budget"):
            parse_budget(bad)
    layers = [layer for layer in range(30) for _ in range(9)]  # SmolLM2-135M: 30 layers of 9 heads
    assert all_position_sweep_fe(layers, 30) == pytest.approx(9 * 15.5)
    assert resolve_budget("auto", None, layers, 30) == pytest.approx(1.5 * 9 * 15.5)
    # a small model: the floor of MIN_PASSES average passes (here 1.5 fe over 2 heads) decides
    assert resolve_budget("auto", None, [0, 1], 2) == pytest.approx(MIN_PASSES * 1.5 / 2) == default_budget(1.5, 2)
    assert default_budget(0.0, 2) is None
    # ... unless 200 fe cost at most a teraFLOP (the bundled toys): then 200
    assert default_budget(1.5, 2, forward_flops=2.8e9) == 200.0 and default_budget(1.5, 2, 2.8e11) == pytest.approx(105)
    assert resolve_budget("none", None, layers, 30) is None
    # --ablation screened: the sweep covered the screen's top heads only (here 200 heads of layers 0 and 20)
    screened = {"screen": {"heads": ["L0H1"] * 100 + ["L20H3"] * 100}}
    assert resolve_budget("auto", None, layers, 30, screened) == pytest.approx(1.5 * (100 * 1.0 + 100 * 10 / 30))
    # seconds: converted with the sweep's measured rate (here 2 s per forward-equivalent)
    assert resolve_budget("s", 100.0, layers, 30, {"seconds": 20.0, "cost": {"forward_equivalents": 10.0}}) == 50.0


@pytest.mark.slow
def test_a_tight_budget_bounds_the_tests_and_keeps_the_toy_verdict(tmp_path):
    """The bundled toy (16 heads), one sweep, then evidence and pairs unbounded and within 80
    forward-equivalents (its default is 200, the small-model rule; the unbounded tests plan ~116): the budgeted stages run what the ledger planned (its parts sum to at
    most the budget where each fitted), cost fewer counted FLOPs, list the heads they left untested (null
    evidence columns, never a decoy), and reach the same verdict."""
    from discovery.artifacts import read_scan
    from discovery.model.loading import load_model
    from pipelines import pipeline
    from pipelines.options import ScanOptions
    from tests.helpers import verdict_differences

    lm = load_model("bundled:mc-transformer")
    options = ScanOptions(task_options=pipeline.task_options(lm.files, ["mc"], {}), prompts=16, bootstrap=200,
                          budget="80")
    budgeted = pipeline.run(lm, options, tmp_path / "budget", report=False)
    unbounded = pipeline.finish(lm, unbounded_copy(tmp_path / "budget", tmp_path / "none"), report=False)
    assert verdict_differences(budgeted.verdict, unbounded.verdict) == []

    record = budgeted.summary["budget"]["mc"]
    assert record["budget"] == 80.0
    fitted = [p for p in record["parts"] if p.get("fits", True)]
    assert len(fitted) == len(record["parts"]) and sum(p["predicted"] for p in fitted) <= 80.0 + 1e-6
    none_record = unbounded.summary["budget"]["mc"]
    assert none_record["budget"] is None and none_record["spent"] > 1.3 * record["spent"]
    stages = lambda s: s["stages"]["evidence"]["flops"] + s["stages"]["pairs"]["flops"]
    assert stages(budgeted.summary) < stages(unbounded.summary)
    evidence = read_scan(tmp_path / "budget").evidence
    untested = budgeted.summary["evidence"]["mc"]["untested"]
    left = evidence.filter(~pl.col("tested"))
    assert untested and sorted(untested) == sorted(f"L{r['layer']}H{r['head']}" for r in left.iter_rows(named=True))
    assert left["d_ld_segment"].null_count() == len(untested)
    assert "decoy" not in left["role"].to_list()


def unbounded_copy(scan: Path, to: Path) -> Path:
    """A copy of a scan directory whose later stages run without a budget (same sweep)."""
    shutil.copytree(scan, to)
    summary = json.loads((to / "summary.json").read_text())
    summary["options"]["budget"] = "none"
    (to / "summary.json").write_text(json.dumps(summary))
    return to


def test_auto_ablation_screens_large_models_only():
    """``--ablation auto``: screened where the exact all-position sweep alone would cost over SCREEN_ABOVE_FE
    (100; SmolLM2-135M's 270 heads: 139.5 fe), exact for small models (Gemma3-270M's 72 heads: 38 fe; the
    mc-mamba1 toy's 128 groups: 80 fe) and in a layer-range shard; other modes pass through."""
    from pipelines.options import resolve_ablation

    smollm2 = [layer for layer in range(30) for _ in range(9)]
    gemma = [layer for layer in range(18) for _ in range(4)]
    mamba1_toy = [layer for layer in range(4) for _ in range(32)]
    assert all_position_sweep_fe(smollm2, 30) == pytest.approx(139.5)
    assert resolve_ablation("auto", smollm2, 30, sharded=False) == "screened"
    assert resolve_ablation("auto", smollm2, 30, sharded=True) == "exact"
    assert all_position_sweep_fe(gemma, 18) == pytest.approx(38.0)
    assert resolve_ablation("auto", gemma, 18, sharded=False) == "exact"
    assert all_position_sweep_fe(mamba1_toy, 4) == pytest.approx(80.0)
    assert resolve_ablation("auto", mamba1_toy, 4, sharded=False) == "exact"
    assert resolve_ablation("query", smollm2, 30, sharded=False) == "query"
