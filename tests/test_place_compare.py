"""Placement advice and cross-scan comparison, on synthetic head tables with the scan's schema."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import synthetic_heads, synthetic_summary, write_synthetic_scan

from discovery.errors import GascanError
from discovery.rank.placement import default_budget, place
from discovery.report.compare import compare_scans, training_step, write_comparison
from pipelines.cli import main


def _pairs(verified: bool, p: float = 0.9) -> pl.DataFrame:
    """One pair row; ``verified`` sets its controls (40, all weaker, or p = 0.5), ``p`` >= 0.5 gives both heads
    their G&A role by the evidence standards, below it they are important heads without one."""
    roles = ("gather", "aggregate") if p >= 0.5 else ("other_important", "other_important")
    return pl.DataFrame([{"task": "mc", "rank": 1, "gather_layer": 2, "gather_head": 1, "gather_kind": "attn",
                          "aggregate_layer": 3, "aggregate_head": 2, "aggregate_kind": "attn", "score": 0.9,
                          "p_gather": p, "p_aggregate": p, "gather_role": roles[0], "aggregate_role": roles[1],
                          "joint_effect": -3.5, "joint_effect_lo": -3.8, "joint_effect_hi": -3.2,
                          "control_mean": -0.1, "control_q05": -0.4, "control_n": 40,
                          "control_p": 1 / 41 if verified else 0.5, "verified": verified}])


def test_layers_ranked_by_g_and_a_evidence_with_reasons():
    heads = synthetic_heads("m", gather=(2, 1), aggregate=(3, 2), decoy=(1, 3))
    summary = synthetic_summary("m")
    layers = place(heads, summary, None, budget=3, unit="layer")
    assert [c.layer for c in layers[:2]] == [3, 2]  # aggregate layer (query effect) first, then gather layer
    assert layers[0].action == "keep attention"
    assert "L3H2" in layers[0].why and "aggregate" in layers[0].why and "lowers the logit difference by 80% of clean" in layers[0].why
    # the decoy's layer (strong pattern, no effect) is not among the two recommended layers
    assert 1 not in [c.layer for c in layers[:2]]
    heads_only = place(heads, summary, None, budget=2, unit="head")
    assert [(c.layer, c.head) for c in heads_only] == [(3, 2), (2, 1)]


def test_verified_pair_raises_its_heads_and_is_cited():
    heads = synthetic_heads("m", gather=(2, 1), aggregate=(3, 2), decoy=None)
    # a strong aggregate-like head in no pair: without the pair bonus it comes first
    strong = (pl.col("layer") == 5) & (pl.col("head") == 0)
    heads = heads.with_columns(*[pl.when(strong).then(v).otherwise(pl.col(c)).alias(c) for c, v in
                                 (("d_ld_all", -3.9), ("d_ld_query", -3.9), ("agg_select", 0.8))])
    without = place(heads, synthetic_summary("m"), None, budget=1, unit="head")[0]
    assert (without.layer, without.head) == (5, 0)
    with_pair = place(heads, synthetic_summary("m"), _pairs(True), budget=2, unit="head")
    assert {(c.layer, c.head) for c in with_pair} == {(3, 2), (2, 1)}
    assert "verified G&A pair L2H1 → L3H2 (joint drop 3.5 vs control mean 0.1, p = 0.024, n = 40 controls)" \
        in with_pair[0].why
    # verified, but neither head looks like its role: half the bonus, and the reason says so
    weak = {(c.layer, c.head): c for c in place(heads, synthetic_summary("m"), _pairs(True, p=0.1), budget=8,
                                                unit="head")}
    strong = {(c.layer, c.head): c for c in with_pair}
    assert weak[3, 2].score == pytest.approx(strong[3, 2].score - 0.25)
    assert "pair L2H1 → L3H2 beats the controls, but its heads are not G&A by the evidence standards" in weak[3, 2].why


def test_ssm_heads_get_insert_attention_and_budgets():
    heads = synthetic_heads("mamba", kind="ssm", gather=(2, 1), aggregate=(3, 2))
    choices = place(heads, synthetic_summary("mamba"), None, budget=2, unit="layer")
    assert [c.action for c in choices] == ["insert attention", "insert attention"]
    assert default_budget({"n_layers": 32}, "layer") == 2
    assert default_budget({"n_heads": {"attn": 1024, "ssm": 0}}, "head") == 21
    assert default_budget({"n_heads": {"attn": 16}}, "head") == 2
    with pytest.raises(GascanError, match="unit"):
        place(heads, None, None, unit="block")
    with pytest.raises(GascanError, match="budget 0"):
        place(heads, None, None, budget=0)


def test_place_cli(tmp_path, capsys):
    out = write_synthetic_scan(tmp_path / "scan", model="m")
    assert main(["place", str(out), "--budget", "2", "--unit", "head", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["layer"], r["head"]) for r in rows] == [(3, 2), (2, 1)]
    assert main(["place", str(out), "--budget", "0"]) == 2
    assert "budget 0" in capsys.readouterr().err


def test_training_step_from_names_and_training_json(tmp_path):
    assert training_step(tmp_path / "x", {"spec": "/m/checkpoints/step-000600"}) == 600
    assert training_step(tmp_path / "scan_step_1200", {"spec": "tiny:llama"}) == 1200
    ck = tmp_path / "model"
    ck.mkdir()
    (ck / "training.json").write_text(json.dumps({"steps": 2000}))
    assert training_step(tmp_path / "scan", {"spec": str(ck)}) == 2000
    assert training_step(tmp_path / "scan", {"spec": "tiny:llama"}) is None


def test_compare_series_and_depths(tmp_path, capsys):
    dirs = []
    # a checkpoint series: G&A appears at step 1200 (effects and patterns grow)
    for step, strength in ((300, 0.0), (600, 0.1), (1200, 1.0)):
        d = tmp_path / f"step-{step:06d}"
        heads = synthetic_heads("toy", seed=step, gather=(2, 1) if strength else None,
                                aggregate=(3, 2) if strength else None, decoy=None, clean_ld=4.0 * max(strength, 0.1))
        d.mkdir()
        heads.write_parquet(d / "heads.parquet")
        summary = synthetic_summary("toy", clean_ld=4.0 * max(strength, 0.1))
        summary["spec"] = f"/runs/toy/checkpoints/step-{step:06d}"
        (d / "summary.json").write_text(json.dumps(summary))
        dirs.append(str(d))
    table = compare_scans(dirs)
    assert table["step"].to_list() == [300, 600, 1200]
    last = table.row(2, named=True)
    assert last["aggregate_head"] == "L3H2" and last["aggregate_depth"] == pytest.approx(3 / 5)
    assert last["gather_head"] == "L2H1" and last["gather_depth"] == pytest.approx(2 / 5)
    assert last["aggregate_drop"] == pytest.approx(0.75)
    assert table["max_aggregate_evidence"][2] > 5 * table["max_aggregate_evidence"][0]
    html = write_comparison(table, tmp_path / "cmp")
    assert (tmp_path / "cmp" / "figures" / "compare_series.png").is_file()
    assert "data:image/png;base64," in html.read_text()
    assert main(["compare", *dirs, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [300, 600, 1200]
    # piped (capsys is not a terminal): one record per row, every value whole (no column cut to "m…")
    assert main(["compare", *dirs]) == 0
    printed = capsys.readouterr().out
    assert printed.count("[") >= 3 and "[3/3]" in printed and "…" not in printed
    assert "  aggregate head: L3H2" in printed and "  step: 1200" in printed


def test_compare_escapes_model_names(tmp_path):
    d = write_synthetic_scan(tmp_path / "a", model="<img src=x onerror=alert(1)>")
    write_comparison(compare_scans([d]), tmp_path / "out")
    html = (tmp_path / "out" / "compare.html").read_text()
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_evidence_roles_steer_placement():
    heads = synthetic_heads("m", gather=(2, 1), aggregate=(3, 2), decoy=(1, 3))
    roles = {(2, 1): "gather", (3, 2): "aggregate", (1, 3): "decoy"}
    heads = heads.with_columns(pl.Series("role", [roles.get((r["layer"], r["head"]), "none")
                                                  for r in heads.iter_rows(named=True)]))
    chosen = place(heads, synthetic_summary("m"), None, budget=2, unit="head")
    assert [(c.layer, c.head) for c in chosen] == [(3, 2), (2, 1)]
    assert "aggregate by the evidence standards" in chosen[0].why
    everything = place(heads, synthetic_summary("m"), None, budget=24, unit="head")
    decoy = next(c for c in everything if (c.layer, c.head) == (1, 3))
    assert "decoy by the evidence standards" in decoy.why and decoy.score < 0.1
