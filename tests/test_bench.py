"""``gascan bench``'s measurements on a tiny model: every head by default, a warm-up and interleaved
repeats with median and spread, the clean forward timed in the same rounds, compute counted in matmul
FLOPs (the engine's own layer-row count agrees), wall ratios to the naive loop and to the clean
forward, the engine agreeing with the naive loop, and the memory verdict against --max-memory."""
from __future__ import annotations

import json

import pytest

from discovery.model.loading import load_model
from discovery.tasks.base import annotate
from pipelines.bench import METHODS, bench_model, spread
from pipelines.cli import main
from tests.helpers import mc_prompts


def test_bench_repeats_interleaved_and_counts_forward_equivalents():
    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(3), lm.tokenizer, padding_side="left")
    heads = list(lm.inventory.heads())
    res = bench_model(lm, batch, heads, repeats=2, max_memory_mb=4096, log=lambda _: None)
    m, n_layers = res["measures"], lm.inventory.n_layers
    assert set(m) == set(METHODS) and res["heads"] == res["heads_in_model"] == len(heads)
    for measure in m.values():  # every method timed in every round: median within the spread
        assert len(measure["samples_s"]) == 2
        assert measure["seconds_min"] <= measure["seconds"] <= measure["seconds_max"]
    assert res["clean_forward_s"] == m["clean"]["seconds"] and m["clean"]["forward_equivalents"] == 1.0
    # FLOPs: one full forward per head for the naive loop; a head in layer l recomputes layers l..L-1 only
    assert abs(m["naive_all"]["forward_equivalents"] - len(heads)) < 1e-6
    expected = sum(n_layers - h.layer for h in heads) / n_layers
    # the engine's own count weighs each layer and the readout by their FLOPs: it is the measured compute
    assert m["sweep_all"]["layer_rows_forward_equivalents"] == pytest.approx(m["sweep_all"]["forward_equivalents"],
                                                                           rel=1e-6)
    assert abs(m["sweep_all"]["forward_equivalents"] - expected) < 0.05 * expected
    assert res["ratios"]["query_vs_naive_compute"] < 0.15
    assert m["sweep_all"]["max_diff"] < 1e-4 and m["sweep_query"]["max_diff"] < 1e-4
    assert m["atp"]["max_diff"] is not None  # the screens' approximation error against the naive loop
    assert res["engine_peak_within_budget"] is True
    # the screens estimate every head; their cost is their matmul FLOPs over the clean forward's
    assert 1.5 < m["atp"]["forward_equivalents"] <= 3  # one forward + one input-gradient backward
    assert m["atp"]["forward_equivalents"] < m["atp_qk"]["forward_equivalents"] <= 4
    for key in ("sweep_all", "sweep_query", "atp_qk"):  # wall ratios to the naive loop and the clean forward
        assert m[key]["vs_naive_wall"] > 0
        assert abs(m[key]["forward_equivalents_wall"] - m[key]["seconds"] / res["clean_forward_s"]) < 1e-9
    assert set(res["targets"]) == {"query_wall_over_compute_ideal", "atp_qk_forward_equivalents_wall",
                                   "exact_vs_naive_wall"}


def test_naive_subset_is_scaled_per_head():
    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(2), lm.tokenizer, padding_side="left")
    heads = list(lm.inventory.heads())
    res = bench_model(lm, batch, heads, repeats=1, naive_heads=3, log=lambda _: None)
    naive = res["measures"]["naive_all"]
    assert naive["timed_heads"] == 3 and naive["heads"] == len(heads) and "scaled per head" in naive["note"]
    assert abs(naive["forward_equivalents"] - len(heads)) < 1e-6  # 3 forwards counted, scaled to all heads
    assert res["measures"]["sweep_all"]["max_diff"] < 1e-4  # compared on the timed heads
    assert res["engine_peak_within_budget"] is None
    assert [h.layer for h in spread(heads, 3)] == [0, 1, 2]  # spread evenly over the layers


def test_bench_command_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "tiny:llama", "--prompts", "2", "--heads", "3", "--repeats", "1", "--max-memory", "2048",
                 "--out", str(out)]) == 0
    (res,) = json.loads(out.read_text())
    assert res["heads"] == res["n_layers"] == 3 and res["engine_peak_within_budget"] is True
    assert res["repeats"] == 1 and res["machine"]["cpus"] >= 1
    printed = capsys.readouterr()
    assert "within the --max-memory budget" in printed.out and "target exact_vs_naive_wall" in printed.out
    assert "gascan: bench tiny:llama  0/" in printed.err  # progress off a terminal: plain lines
