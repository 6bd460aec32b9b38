"""The head classifier: features, the JSON artifact, labels (published heads), leave-one-model-out."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import synthetic_heads, synthetic_summary, write_synthetic_scan

from discovery.errors import GascanError
from discovery.rank.classifier import (
    FEATURES,
    ROLE_EXCLUDED,
    HeadClassifier,
    attach_clean,
    head_features,
    label_matches_model,
    label_rows,
    leave_one_model_out,
    load_classifier,
    published_labels,
    save_classifier,
    score_heads,
    train_classifier,
)
from pipelines.cli import main

LAYOUTS = [((1, 2), (2, 1)), ((0, 1), (3, 3)), ((2, 0), (4, 2)), ((1, 3), (2, 0)), ((3, 1), (5, 1))]


def _labelled_set(n_models: int = 5, clean_ld: float = 4.0) -> tuple[pl.DataFrame, list[dict]]:
    frames, labels = [], []
    for i in range(n_models):
        gather, aggregate = LAYOUTS[i % len(LAYOUTS)]
        name = f"synthetic-{i}"
        # sizes and clean scores differ per model: features are normalised per model
        ld = clean_ld * (1 + i)
        frame = synthetic_heads(name, seed=i, gather=gather, aggregate=aggregate, decoy=(0, 3), clean_ld=ld,
                                n_layers=6 + i % 2)
        frames.append(attach_clean(frame, synthetic_summary(name, clean_ld=ld)))
        labels += [{"model": name, "layer": gather[0], "head": gather[1], "kind": "attn", "role": "gather"},
                   {"model": name, "layer": aggregate[0], "head": aggregate[1], "kind": "attn", "role": "aggregate"}]
    return pl.concat(frames, how="diagonal_relaxed"), labels


def test_features_are_normalised_per_model():
    small = attach_clean(synthetic_heads("a", clean_ld=2.0, seed=1), synthetic_summary("a", clean_ld=2.0))
    big = attach_clean(synthetic_heads("b", clean_ld=20.0, seed=1), synthetic_summary("b", clean_ld=20.0))
    fs, fb = head_features(small), head_features(big)
    assert fs.columns == list(FEATURES)
    # the same relative effects give the same features whatever the logit scale
    np.testing.assert_allclose(fs["drop_all"].to_numpy(), fb["drop_all"].to_numpy(), atol=1e-9)
    aggregate = small.with_row_index().filter((pl.col("layer") == 3) & (pl.col("head") == 2))["index"][0]
    assert fs["drop_query"][aggregate] == pytest.approx(0.75)
    assert fs["share_query"][aggregate] == pytest.approx(1.0)
    assert fs["agg_x_effect"][aggregate] == pytest.approx(0.97 * 0.75)
    # unmeasured columns (no position-resolved sweep in this table) are null, not zero
    assert fs["drop_segment"].null_count() == small.height


def test_aggregate_feature_counts_a_head_that_reads_just_past_the_option():
    """``agg_x_effect`` uses the truth rules' selection: the larger of agg_select and agg_after."""
    frame = pl.DataFrame({"model": ["m"] * 3, "task": ["mc"] * 3, "layer": [2, 2, 2], "head": [0, 1, 2],
                          "kind": ["ssm"] * 3, "clean_ld": [10.0] * 3, "d_ld_all": [-5.0, -5.0, -5.0],
                          "d_ld_query": [-5.0, -5.0, -5.0], "agg_select": [0.1, 0.8, None],
                          "agg_after": [0.9, 0.0, None]})
    feats = head_features(frame)
    assert feats["agg_x_effect"].to_list()[:2] == pytest.approx([0.9 * 0.5, 0.8 * 0.5])
    assert feats["agg_x_effect"][2] is None and feats["agg_after"].to_list()[:2] == [0.9, 0.0]


def test_artifact_round_trip_reproduces_sklearn(tmp_path):
    from sklearn.linear_model import LogisticRegression

    frame, labels = _labelled_set()
    labelled = label_rows(frame, labels)
    clf = train_classifier(labelled)
    path = save_classifier(clf, tmp_path / "clf.json")
    text = path.read_text()
    assert json.loads(text)["format"] == "gascan-head-classifier"  # plain JSON: no code, no pickle
    again = load_classifier(path)
    p1, p2 = clf.predict(labelled), again.predict(labelled)
    for role in ("gather", "aggregate"):
        np.testing.assert_array_equal(p1[role], p2[role])
    # the numpy inference equals scikit-learn's own probabilities for the same fit
    x = head_features(labelled).to_numpy()
    x = np.where(np.isfinite(x), x, np.asarray(clf.mean))
    z = (x - np.asarray(clf.mean)) / np.asarray(clf.scale)
    shipped = load_classifier()
    for role in ("gather", "aggregate"):
        y = (labelled["role_label"].to_numpy() == role).astype(int)
        used = [i for i, name in enumerate(FEATURES) if name not in ROLE_EXCLUDED[role]]
        ref = LogisticRegression(C=1.0, class_weight="balanced", max_iter=5000).fit(z[:, used], y)
        np.testing.assert_allclose(ref.predict_proba(z[:, used])[:, 1], p1[role], atol=1e-9)
        # a role's excluded features (the gather role's query effects) carry no weight
        excluded = [i for i, name in enumerate(FEATURES) if name in ROLE_EXCLUDED[role]]
        assert all(clf.coef[role][i] == 0.0 for i in excluded)
        assert all(shipped.coef[role][i] == 0.0 for i in excluded)  # the shipped artifact too
    assert len(ROLE_EXCLUDED["gather"]) == 4 and "drop_query" in ROLE_EXCLUDED["gather"]
    # the labelled heads are the most probable of each model
    scored = labelled.with_columns(pl.Series("pg", p1["gather"]), pl.Series("pa", p1["aggregate"]))
    for (model,), part in scored.partition_by(["model"], as_dict=True).items():
        assert part.sort("pg", descending=True)["role_label"][0] == "gather", model
        assert part.sort("pa", descending=True)["role_label"][0] == "aggregate", model


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["roles"]["gather"]["coef"].pop(), "lengths"),
    (lambda d: d["scaler"]["scale"].__setitem__(0, 0.0), "non-positive"),
    (lambda d: d.pop("format"), "format tag"),
])
def test_malformed_artifacts_are_one_line_errors(tmp_path, mutate, message):
    frame, labels = _labelled_set(3)
    data = train_classifier(label_rows(frame, labels)).to_json()
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(GascanError) as info:
        load_classifier(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    path.write_text("{not json")
    with pytest.raises(GascanError, match="is not JSON"):
        load_classifier(path)


def test_shipped_classifier_ranks_planted_roles_and_rejects_decoys():
    clf = load_classifier()
    assert isinstance(clf, HeadClassifier) and clf.features == list(FEATURES)
    frame = synthetic_heads("unseen", seed=11, gather=(2, 1), aggregate=(3, 2), decoy=(1, 3), clean_ld=6.0)
    scored = score_heads(frame, synthetic_summary("unseen", clean_ld=6.0), clf)
    top_g = scored.sort("p_gather", descending=True).row(0, named=True)
    top_a = scored.sort("p_aggregate", descending=True).row(0, named=True)
    assert (top_g["layer"], top_g["head"]) == (2, 1)
    assert (top_a["layer"], top_a["head"]) == (3, 2)
    decoy = scored.filter((pl.col("layer") == 1) & (pl.col("head") == 3)).row(0, named=True)
    assert decoy["agg_select"] == 0.9 and decoy["p_aggregate"] < 0.5  # pattern without effect


def test_published_labels_match_by_model_name_and_map_channels():
    labels = published_labels()
    llama = [r for r in labels if r["model"] == "Llama-3.1-8B-Instruct"]
    assert {(r["layer"], r["head"], r["role"]) for r in llama} == {(16, 22, "gather"), (17, 24, "aggregate")}
    assert label_matches_model(llama[0], "Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf")
    assert label_matches_model(llama[0], "meta-llama/Llama-3.1-8B-Instruct")
    assert not label_matches_model(llama[0], "Llama-3.1-8B")
    assert not label_matches_model(llama[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    # Falcon-Mamba-7B channels onto 32 channel groups of 256 channels, and at channel level
    rows = []
    for layer in (35, 36):
        for head in range(32):
            rows.append({"model": "tiiuae/falcon-mamba-7b", "checkpoint": "x", "task": "mc", "layer": layer,
                         "head": head, "kind": "ssm"})
    got = label_rows(pl.DataFrame(rows), labels).filter(pl.col("role_label") != "none")
    assert sorted(got.filter(pl.col("layer") == 35)["head"].to_list()) == [12, 20, 25, 28]
    assert sorted(got.filter(pl.col("layer") == 36)["head"].to_list()) == [6, 7, 15, 19]
    assert set(got["role_label"]) == {"gather", "aggregate"}
    # a model no label names contributes no rows (its heads are unknown, not negatives)
    assert label_rows(pl.DataFrame(rows).with_columns(pl.lit("other").alias("model")), labels).height == 0


def test_leave_one_model_out_on_synthetic_models():
    frame, labels = _labelled_set(5)
    lomo = leave_one_model_out(label_rows(frame, labels))
    assert lomo.height == 5
    assert lomo["aggregate_best_rank"].to_list() == [1] * 5
    assert lomo["gather_best_rank"].to_list() == [1] * 5
    assert lomo["pair_in_top3"].all()
    assert lomo["aggregate_recall"].min() == 1.0


def test_cli_train_eval_and_bad_labels(tmp_path, capsys):
    dirs, labels = [], []
    for i, (gather, aggregate) in enumerate(LAYOUTS[:3]):
        name = f"cli-model-{i}"
        dirs.append(str(write_synthetic_scan(tmp_path / name, model=name, gather=gather, aggregate=aggregate, seed=i)))
        labels += [{"model": name, "layer": gather[0], "head": gather[1], "kind": "attn", "role": "gather"},
                   {"model": name, "layer": aggregate[0], "head": aggregate[1], "kind": "attn", "role": "aggregate"}]
    (tmp_path / "labels.json").write_text(json.dumps(labels))
    out = tmp_path / "clf.json"
    assert main(["classifier", "train", *dirs, "--labels", str(tmp_path / "labels.json"), "--out", str(out)]) == 0
    assert load_classifier(out).meta["n_models"] == 3
    capsys.readouterr()
    assert main(["classifier", "eval", *dirs, "--labels", str(tmp_path / "labels.json"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["model"] for r in rows] == [f"cli-model-{i}" for i in range(3)]
    assert all(r["aggregate_best_rank"] == 1 for r in rows)
    (tmp_path / "bad.json").write_text(json.dumps([{"model": "x", "layer": 1, "head": 2, "role": "boss"}]))
    assert main(["classifier", "train", *dirs, "--labels", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "role 'boss'" in err[0]


def test_shipped_training_rows_evaluate_leave_one_model_out(capsys):
    """Leave-one-model-out on the shipped rows (planted circuits and the bundled toys of both trained
    architectures): every held-out model's true aggregate head is ranked first and a true pair is in
    the top 3 wherever the model has one, the transformer toy and the width-2 Mamba-2 toy included."""
    assert main(["classifier", "eval", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    assert len(rows) >= 13 and sum(name.startswith("planted") for name in rows) >= 8
    for role in ("gather", "aggregate"):
        assert all(r[f"{role}_best_rank"] in (1, None) for r in rows.values()), role
    assert all(r["pair_in_top3"] in (True, None) for r in rows.values())
    for toy in ("bundled:mc-transformer", "bundled:mc-mamba2-k2"):  # a true pair, held out
        assert rows[toy]["pair_in_top3"] is True and rows[toy]["aggregate_best_rank"] == 1, toy
    assert rows["bundled:mc-mamba2"]["aggregate_best_rank"] == 1  # the SSM aggregate head without a gatherer
    # one: mc3-transformer (no G&A) once the gather regression stopped reading query effects (ROLE_EXCLUDED)
    assert sum(r["gather_false_positives"] for r in rows.values()) <= 1
    assert sum(r["aggregate_false_positives"] for r in rows.values()) <= 2
    meta = load_classifier().meta
    assert {"bundled:mc-transformer", "bundled:mc-mamba2-k2"} <= set(meta["trained_on"])
    assert meta["leave_one_model_out"]["aggregate_top1"] == 1.0 and meta["leave_one_model_out"]["pair_in_top3"] == 1.0


def test_labels_from_ground_truth_files(tmp_path):
    from pipelines.classifier_data import derive_truth, labels_from_truth

    truth = {"clean": {"acc": 1.0}, "gather": [{"layer": 1, "head": 2, "kind": "attn"}],
             "aggregate": [{"layer": 2, "head": 1, "kind": "attn"}], "pairs": []}
    path = tmp_path / "toy-model" / "truth.json"
    path.parent.mkdir()
    path.write_text(json.dumps(truth))
    labels = labels_from_truth(path)
    assert [(r["model"], r["layer"], r["head"], r["role"]) for r in labels] == [
        ("toy-model", 1, 2, "gather"), ("toy-model", 2, 1, "aggregate")]
    # an exhaustive truth also lists the heads it tested: the rest become known negatives
    truth["heads"] = [{"layer": layer, "head": head, "kind": "attn"} for layer in range(3) for head in range(3)]
    path.write_text(json.dumps(truth))
    roles = {(r["layer"], r["head"]): r["role"] for r in labels_from_truth(path)}
    assert len(roles) == 9 and roles[(1, 2)] == "gather" and roles[(2, 1)] == "aggregate"
    assert sum(role == "none" for role in roles.values()) == 7
    path.write_text(json.dumps({**truth, "gather": [], "aggregate": []}))  # a model without G&A
    assert {r["role"] for r in labels_from_truth(path)} == {"none"}
    # the table-only fallback finds the planted roles of a synthetic scan and nothing else
    frame = synthetic_heads("s", gather=(2, 1), aggregate=(3, 2), decoy=(1, 3), clean_ld=4.0)
    derived = derive_truth(frame, 4.0)
    assert sorted((r["layer"], r["head"], r["role"]) for r in derived) == [(2, 1, "gather"), (3, 2, "aggregate")]


def test_spread_by_gather_gives_every_gather_head_one_pair_before_any_second():
    from discovery.rank.classifier import spread_by_gather

    # gather head "g1" with a redundant set of four aggregate heads, then "g2" and "g3" with lower scores
    pairs = [("g1", "a1", 0.09), ("g1", "a2", 0.08), ("g1", "a3", 0.07), ("g1", "a4", 0.06),
             ("g2", "a2", 0.015), ("g2", "a1", 0.012), ("g3", "a1", 0.002)]
    spread = spread_by_gather(pairs[::-1], lambda p: p[0], lambda p: p[2])  # input order does not matter
    assert [p[:2] for p in spread] == [("g1", "a1"), ("g2", "a2"), ("g3", "a1"), ("g1", "a2"), ("g2", "a1"),
                                       ("g1", "a3"), ("g1", "a4")]
    assert [p[:2] for p in sorted(pairs, key=lambda p: -p[2])[:3]] == [("g1", "a1"), ("g1", "a2"), ("g1", "a3")]
    assert spread_by_gather([], lambda p: p, lambda p: 0.0) == []


HYBRID_ROWS = Path(__file__).parent / "data" / "mc_hybrid_labelled_heads.parquet"
PLACEMENT_HYBRID_ROWS = Path(__file__).parent / "data" / "placement_hybrid_attn0_labelled_heads.parquet"


def _lomo_with_shipped_rows(*extra: pl.DataFrame) -> dict[str, dict]:
    """Leave-one-model-out over the shipped training rows plus ``extra`` labelled head tables, by model."""
    from discovery.rank.classifier import shipped_training_rows

    labelled = pl.concat([shipped_training_rows(), *extra], how="diagonal_relaxed")
    return {r["model"]: r for r in leave_one_model_out(labelled).iter_rows(named=True)}


def test_hybrid_toy_held_out_has_its_true_pair_in_the_top_3():
    """Leave-one-model-out on the shipped rows plus the hybrid toy's (`gascan scan bundled:mc-hybrid
    --no-report`, labelled from its truth.json; tests/data): every architecture held out once. The hybrid's
    true aggregate heads (a redundant set of five SSM heads) rank first; its gather head L1H2 (attention,
    a weak own-option pattern) ranks second, behind L0S1, a layer-0 SSM head whose removal breaks
    everything. By P(g)·P(a) alone L0S1's pairs with the five aggregate heads fill the top of the list;
    spread over gather heads, L1H2's best pair comes second."""
    from discovery.rank.classifier import pair_prior, shipped_training_rows, train_classifier

    hybrid = pl.read_parquet(HYBRID_ROWS)
    assert hybrid["model"].unique().to_list() == ["bundled:mc-hybrid"]
    lomo = _lomo_with_shipped_rows(hybrid)
    assert len(lomo) >= 14
    held = lomo["bundled:mc-hybrid"]
    assert held["aggregate_best_rank"] == 1 and held["gather_best_rank"] == 2
    assert held["pair_in_top3"] is True
    assert all(r["pair_in_top3"] in (True, None) for r in lomo.values())
    assert all(r["aggregate_best_rank"] in (1, None) for r in lomo.values())
    # what the spread changes: the plain product order has only L0S1 pairs in its top 3
    clf = train_classifier(shipped_training_rows())  # every model but the held-out hybrid
    probs = clf.predict(hybrid)
    top = pair_prior(hybrid, probs["gather"], probs["aggregate"], k=3)
    assert top[0][0] == (0, 1, "ssm") and top[1][0] == (1, 2, "attn")
    heads = list(zip(hybrid["layer"], hybrid["head"], hybrid["kind"]))
    plain = sorted(((heads[g], heads[a], probs["gather"][g] * probs["aggregate"][a]) for g in range(len(heads))
                    for a in range(len(heads)) if heads[g][0] < heads[a][0]), key=lambda t: -t[2])[:3]
    assert {g for g, _, _ in plain} == {(0, 1, "ssm")}



def test_both_hybrids_with_a_pair_held_out_rank_it_in_the_top_3():
    """The shipped rows plus the two hybrid toys whose ground truth has a G&A pair: mc-hybrid and the
    placement check's hybrid with attention at layer 0 (Mamba-2 init, seed 0; `gascan toy truth` then
    `gascan scan RUN --no-report`, tests/data). Its gather head L0H0 is one of four layer-0 attention heads
    that all break the task and it also costs 1.7 logits at the query; with the query effects in the
    gather regression it ranked 4th, without them (ROLE_EXCLUDED) it ranks first."""
    lomo = _lomo_with_shipped_rows(pl.read_parquet(HYBRID_ROWS), pl.read_parquet(PLACEMENT_HYBRID_ROWS))
    assert len(lomo) == 15
    for name in ("bundled:mc-hybrid", "placement-hybrid-attn0-seed0"):
        assert lomo[name]["pair_in_top3"] is True and lomo[name]["aggregate_best_rank"] == 1, name
    assert lomo["placement-hybrid-attn0-seed0"]["gather_best_rank"] == 1
    assert all(r["pair_in_top3"] in (True, None) for r in lomo.values())
    assert all(r["aggregate_best_rank"] in (1, None) for r in lomo.values())
