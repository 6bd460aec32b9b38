"""Screen recall: hand-computed on small vectors, and measured end to end on a tiny model and a bundled toy."""
from __future__ import annotations

import json
import time

import pytest
import torch

from discovery.measure.ablation import AblationEngine, single_head_ablations
from discovery.measure.recall import SCREENS, measure_screens, screen_recall
from discovery.model.loading import load_model
from discovery.tasks.base import annotate
from tests.helpers import mc_prompts
from tests.test_attribution import one_thread  # noqa: F401  (autouse: tiny models run fastest on one thread)


def test_screen_recall_hand_computed():
    exact = torch.tensor([-5.0, 4.0, 0.1, 3.0, -0.2, 0.0])
    score = torch.tensor([0.3, -2.0, 1.0, 0.0, 0.5, 0.1])
    # exact top 3: heads 0, 1, 3; screen order by |score|: 1, 2, 4, 0, 5, 3 -> ranks 4, 1, 6
    rec = screen_recall(exact, score, top=3, target=0.6, ks=(1, 2, 4))
    assert rec["ranks"] == [4, 1, 6]
    assert rec["recall_at_k"] == {1: 1 / 3, 2: 1 / 3, 3: 1 / 3, 4: 2 / 3}
    assert rec["k_for_recall"] == 4  # 2 of 3 needed
    assert rec["n_major"] == 3 and rec["k_for_major"] == 6  # |effect| >= 0.5: heads 0, 1, 3
    assert screen_recall(exact, score, top=3, target=1.0)["k_for_recall"] == 6
    assert screen_recall(exact, exact, top=3)["recall_at_k"][3] == 1.0
    assert screen_recall(exact, -exact, top=3)["k_for_recall"] == 3  # magnitudes rank, signs do not
    with pytest.raises(ValueError, match="finite"):
        screen_recall(exact, torch.full((6,), float("nan")))


def test_measure_screens_on_tiny_llama():
    started = time.perf_counter()
    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(8, seed=2), lm.tokenizer, padding_side="left")
    out = measure_screens(lm, batch, top=5)
    heads = list(lm.inventory.heads())
    engine = AblationEngine(lm, batch)
    exact = {}
    for scope in ("all", "query"):
        abl = single_head_ablations(heads, "zero", (scope,))
        exact[scope] = engine.effects(abl, engine.run(abl)).logit_diff.mean(-1)  # [head]
    assert [out["reference"]["d_ld_all"][str(h)] for h in heads] == pytest.approx(exact["all"].tolist(), abs=1e-6)
    assert set(out["screens"]) == set(SCREENS)
    query = out["screens"]["query"]
    assert [query["scores"][str(h)] for h in heads] == pytest.approx(exact["query"].tolist(), abs=1e-6)
    assert query["ranks"] == screen_recall(exact["all"], exact["query"], top=5)["ranks"]
    fe = {name: rec["forward_equivalents"] for name, rec in out["screens"].items()}
    # plain AtP: a forward and a backward; the QK fix and GradDrop's reruns cost more; GradDrop < L+1
    assert 1.5 < fe["atp"] < 2.5 and fe["atp_qk"] > fe["atp"] and fe["atp"] < fe["graddrop"] < lm.inventory.n_layers + 1
    assert fe["query"] < out["reference"]["forward_equivalents"]
    for rec in out["screens"].values():
        assert 5 <= rec["k_for_recall"] <= len(heads) and 0.0 <= rec["recall_at_k"][5] <= 1.0
    json.dumps(out, allow_nan=False)
    assert time.perf_counter() - started < 30


def test_screens_command_writes_json(tmp_path, capsys):
    from pipelines.cli import main

    assert main(["screens", "tiny:llama", "--screens", "atp,nope"]) == 2
    assert "unknown screen 'nope'" in capsys.readouterr().err
    out = tmp_path / "recall.json"
    assert main(["screens", "tiny:llama", "--prompts", "4", "--screens", "atp,query", "--top", "3",
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["screens"]) == {"atp", "query"} and data["n_prompts"] == 4 and data["task"] == "mc"
    assert data["screens"]["atp"]["top"] == 3 and len(data["reference"]["top"]) == 3
