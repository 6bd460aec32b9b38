"""``gascan bench``'s measurements on a tiny model: compute ratios are counted (layer rows for the
engine, matmul FLOPs for the attribution screens), not timed;
the engine agrees with the naive loop, and the memory verdict is reported against --max-memory."""
from __future__ import annotations

import json

from discovery.model.loading import load_model
from discovery.tasks.base import annotate
from pipelines.bench import bench_model
from pipelines.cli import main
from tests.helpers import mc_prompts


def test_bench_counts_forward_equivalents_and_checks_the_memory_budget():
    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(3), lm.tokenizer, padding_side="left")
    heads = list(lm.inventory.heads())
    res = bench_model(lm, batch, heads, max_memory_mb=4096, log=lambda _: None)
    m, n_layers = res["measures"], lm.inventory.n_layers
    assert m["naive_all"]["forward_equivalents"] == len(heads)  # one full forward per head
    # a head in layer l recomputes layers l..L-1 only: sum over heads of (L - l) / L
    expected = sum(n_layers - h.layer for h in heads) / n_layers
    assert abs(m["sweep_all"]["forward_equivalents"] - expected) < 1e-9
    assert res["ratios"]["query_vs_naive_compute"] < 0.15
    assert m["sweep_all"]["max_diff"] < 1e-4 and m["sweep_query"]["max_diff"] < 1e-4
    assert res["engine_peak_within_budget"] is True
    # the screens estimate every head; their cost is measured in matmul FLOPs against the clean forward's
    assert 1.5 < m["atp"]["forward_equivalents"] <= 3  # one forward + one input-gradient backward
    assert m["atp"]["forward_equivalents"] < m["atp_qk"]["forward_equivalents"] <= 4
    assert bench_model(lm, batch, heads[:2], log=lambda _: None)["engine_peak_within_budget"] is None


def test_bench_command_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "tiny:llama", "--prompts", "2", "--heads-per-layer", "1", "--max-memory", "2048",
                 "--out", str(out)]) == 0
    (res,) = json.loads(out.read_text())
    assert res["heads"] == res["n_layers"] and res["engine_peak_within_budget"] is True  # one head per layer
    assert "within the --max-memory budget" in capsys.readouterr().out
