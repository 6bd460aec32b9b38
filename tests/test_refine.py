"""Mamba-1 channel refinement (discovery/measure/refine.py): planted channels are found exactly, the batched
tree equals a naive loop of plain-hook ablations, and on the bundled Mamba-1 toy the refined channels match
the exhaustive channel truth at a fraction of its cost."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine, query_scores
from discovery.measure.refine import RefineSettings, channel_sweep_cost, refine_channels
from discovery.model.adapter import adapter_for
from discovery.model.loading import LoadedModel
from discovery.tasks.base import annotate
from tests.helpers import mc_prompts

PLANTED_LAYER = 1
PLANTED = (13, 50, 53)  # channels of layer 1: alone in group 1, and one in each half of group 6 (width 8)
WIDTH = 8


def planted_mamba1(seed: int = 0) -> tuple[LoadedModel, object]:
    """A tiny Mamba-1 (3 layers, 128 channels) whose answer is written by three channels of layer 1.

    Every out-projection column is shrunk 50-fold, so no other channel matters much; then each planted
    channel's column is set to write ``beta / (its mean activation at the query)`` along "gold minus the
    other candidates" in the unembedding (gold is always " A"), ``beta`` small next to the residual (so
    the final norm barely changes): each channel carries about a third of the clean logit difference."""
    from discovery.model.tiny import tiny_model, tiny_tokenizer

    model = tiny_model("mamba", seed=seed)
    tok = tiny_tokenizer()
    prompts = [dataclasses.replace(p, gold=0, gold_segment=0) for p in mc_prompts(24, seed=seed)]
    batch = annotate(prompts, tok, padding_side="left")
    layers = model.backbone.layers
    with torch.no_grad():
        for layer in layers:
            layer.mixer.out_proj.weight.mul_(0.02)
        proj = layers[PLANTED_LAYER].mixer.out_proj
        proj.weight[:, list(PLANTED)] = 0.0
        captured, resid = [], []
        handle = proj.register_forward_pre_hook(lambda m, a: captured.append(a[0].detach()))
        norm = model.backbone.norm_f.register_forward_pre_hook(lambda m, a: resid.append(a[0].detach()))
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        handle.remove()
        norm.remove()
        rows = torch.arange(len(batch))
        act = captured[0][rows, batch.query_pos]  # [prompt, channel] at the query
        # small next to the residual, so the final norm stays about constant and the channels add up
        beta = 0.15 * float(resid[0][rows, batch.query_pos].norm(dim=-1).mean())
        unembed = model.lm_head.weight  # [vocab, d_model]
        ids = batch.cand_first_token[0]
        direction = unembed[ids[0]] - unembed[ids[1:]].mean(0)
        direction = direction / direction.norm()
        for c in PLANTED:
            proj.weight[:, c] = beta * direction / act[:, c].mean()
    lm = LoadedModel(model, tok, adapter_for(model, WIDTH), "planted-mamba1")
    return lm, batch


@pytest.fixture(scope="module")
def planted():
    lm, batch = planted_mamba1()
    engine = AblationEngine(lm, batch)
    heads = lm.inventory.heads()
    from discovery.measure.ablation import single_head_ablations

    effects = engine.effects(single_head_ablations(heads, "zero", ("all",)))
    rows_before = engine.layer_rows
    ref = refine_channels(engine, heads, effects, RefineSettings(bootstrap=200))
    return lm, batch, engine, ref, rows_before


def test_refinement_finds_the_planted_channels(planted):
    lm, batch, engine, ref, _ = planted
    clean = float(engine.clean.logit_diff.mean())
    assert clean > 0.5 and float(engine.clean.acc.mean()) == 1.0
    found = sorted((n.layer, n.start, n.end) for n in (ref.nodes[i] for i in ref.leaf_nodes))
    assert found == [(PLANTED_LAYER, c, c + 1) for c in PLANTED]
    assert all(ref.nodes[i].outcome == "channel" for i in ref.leaf_nodes)
    # the leaves stay refined heads after the group heads of layer 1; the tree's other nodes are gone
    group = lm.inventory.group(PLANTED_LAYER, "ssm")
    assert group.spans == tuple((c, c + 1) for c in PLANTED)
    assert ref.leaves == [HeadId(PLANTED_LAYER, group.count + k, "ssm") for k in range(3)]
    # both kinds of evidence at every level: every node has pattern metrics and a direct logit attribution
    assert all(n.metrics.get("dla") is not None and "agg_select" in n.metrics for n in ref.nodes)
    # groups 1 and 6 of layer 1 were refined: 3 levels of halves (8 -> 4 -> 2 -> 1)
    assert sorted({(n.layer, n.group) for n in ref.nodes if n.level == 0}) == [(1, 1), (1, 6)]
    assert ref.levels == 3


def test_refinement_cost_grows_with_important_channels_not_width(planted):
    lm, batch, engine, ref, _ = planted
    sweep = channel_sweep_cost(engine, [0, 1, 2])
    # 2 + 2 + 2 halves for group 1, 2 + 4 + 4 for group 6 (both halves of each carry a planted channel)
    assert ref.ablations == 16
    assert ref.forward_equivalents * 10 < sweep


def _plain_hook_effects(lm: LoadedModel, batch, layer: int, start: int, end: int) -> torch.Tensor:
    """Reference: one full forward with a plain hook zeroing channels [start, end) of ``layer``'s out_proj input."""
    proj = lm.model.backbone.layers[layer].mixer.out_proj

    def zero(module, args):
        x = args[0].clone()
        x[..., start:end] = 0.0
        return (x,)

    handle = proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            logits = lm.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, -1].float()
    finally:
        handle.remove()
    return query_scores(logits[None], batch).logit_diff[0]


def test_batched_refinement_equals_a_naive_loop(planted):
    lm, batch, engine, ref, _ = planted
    clean = engine.clean.logit_diff[0]
    for node in ref.nodes:
        naive = float((_plain_hook_effects(lm, batch, node.layer, node.start, node.end) - clean).mean())
        assert -naive == pytest.approx(node.drop, abs=1e-5), (node.layer, node.start, node.end)


# --- the bundled Mamba-1 toy: refinement against the exhaustive channel-level truth ---------------------

TOY = "mc-mamba1"
TOY_PROMPTS = 32  # refinement runs on the first 32 of the truth's 64 prompts (the whole truth: ~10 min here)
TOY_RECALL = 0.75  # share of the truth's important channels refinement must find (measured 0.75: 3 of 4; no margin,
# since channels near the 10% threshold move with the prompts: see the scan-prompt tests below)
TOY_PRECISION = 0.75  # share of the single-channel leaves the truth puts at >= half that (measured 0.80: 4 of 5)
TOY_CHECKED = 6  # truth rows re-ablated live: the top 3 and 3 drawn from the rest
REPORT = Path(__file__).resolve().parents[1] / "reports" / "toy-mc-mamba1"


@pytest.fixture(scope="module")
def toy():
    """The bundled Mamba-1 toy, its channel-level truth and the truth's own prompts (rebuilt from its seed)."""
    from discovery.model.bundled import bundled_model_path
    from discovery.model.loading import load_model
    from discovery.tasks import build_task
    from discovery.toy import trained_task_options

    lm = load_model(f"bundled:{TOY}")
    truth = json.loads((bundled_model_path(TOY) / "truth_channels.json").read_text())
    task, options = next(iter(trained_task_options(lm.files).items()))
    assert (task, {**options, "split": "train"}) == (truth["task"], {**truth["task_options"], "split": "train"})
    prompts = build_task(task, {**options, "n": truth["clean"]["n_prompts"], "seed": truth["seed"]}).prompts()
    return lm, truth, prompts


def test_bundled_mamba1_channel_truth_matches_live_ablations(toy):
    """A sample of the bundled truth (its top channels and others drawn at random) re-ablated now, one
    channel at a time, on the truth's own prompts: the same drops."""
    from discovery.measure.ablation import single_head_ablations
    from discovery.rank.truth import channel_view

    lm, truth, prompts = toy
    view = channel_view(lm)
    batch = annotate(prompts, lm.tokenizer, padding_side="left")
    engine = AblationEngine(view, batch)
    assert float(engine.clean.logit_diff.mean()) == pytest.approx(truth["clean"]["logit_diff"], abs=1e-4)
    assert float(engine.clean.acc.mean()) == truth["clean"]["acc"] >= 0.9  # chance 0.25
    rows = sorted(truth["channels"], key=lambda r: r["d_ld_all"])
    rest = torch.randperm(len(rows) - 3, generator=torch.Generator().manual_seed(0))[: TOY_CHECKED - 3] + 3
    sample = rows[:3] + [rows[int(i)] for i in rest]
    heads = [HeadId(r["layer"], r["channel"], "ssm") for r in sample]
    live = engine.effects(single_head_ablations(heads, "zero", ("all",))).logit_diff.mean(1)
    assert live.tolist() == pytest.approx([r["d_ld_all"] for r in sample], abs=1e-4)


def test_refinement_on_the_bundled_mamba1_toy_finds_the_truth_channels(toy):
    """Group sweep (32 groups of 8 channels per layer) and refinement on 32 of the truth's prompts: the
    truth's important channels (every channel ablated alone, 64 prompts; drop >= 10% of clean) are among
    the refined heads' channels (recall >= TOY_RECALL), the single channels found are ones the truth puts
    at >= 5% (TOY_PRECISION), and the sweep plus refinement cost a small part of ablating
    every channel alone (forward-equivalents, as the engine counted them)."""
    from discovery.measure.ablation import single_head_ablations

    lm, truth, prompts = toy
    batch = annotate(prompts[:TOY_PROMPTS], lm.tokenizer, padding_side="left")
    engine = AblationEngine(lm, batch)
    heads = lm.inventory.heads()
    assert {lm.inventory.group(h.layer, "ssm").width for h in heads} == {8}
    rows_before = engine.layer_rows
    effects = engine.effects(single_head_ablations(heads, "zero", ("all",)))
    group_fe = (engine.layer_rows - rows_before) / (engine.n_prompts * engine.n_active_layers)
    ref = refine_channels(engine, heads, effects, RefineSettings(bootstrap=200))
    leaves = [ref.nodes[i] for i in ref.leaf_nodes]
    found = {(n.layer, c) for n in leaves for c in range(n.start, n.end)}
    # the truth's important channels: drop >= the refinement's own threshold (10% of clean), largest first
    top = [(r["layer"], r["channel"]) for r in truth["important"]]
    assert truth["effect"] == RefineSettings().effect and len(top) >= 3
    recall = sum(c in found for c in top) / len(top)
    clean = truth["clean"]["logit_diff"]
    near = {(r["layer"], r["channel"]) for r in truth["channels"] if -r["d_ld_all"] >= truth["effect"] / 2 * clean}
    singles = [(n.layer, n.start) for n in leaves if n.outcome == "channel"]
    precision = sum(c in near for c in singles) / max(1, len(singles))
    sweep_fe = channel_sweep_cost(engine, sorted({h.layer for h in heads}))
    print(f"recall {recall:.2f} of {len(top)}, single-channel leaves at >= half the threshold {precision:.2f} "
          f"({len(singles)} of {len(leaves)} leaves), refinement {ref.forward_equivalents:.1f} fe + group sweep "
          f"{group_fe:.1f} fe vs channel sweep {sweep_fe:.1f} fe")
    assert recall >= TOY_RECALL
    assert precision >= TOY_PRECISION
    # what the exhaustive truth's engine counted, per scope it measured
    assert sweep_fe == pytest.approx(truth["forward_equivalents"] / len(truth["scopes"]), rel=1e-6)
    assert (ref.forward_equivalents + group_fe) * 4 < sweep_fe
    assert ref.forward_equivalents * 10 < sweep_fe


SCAN_TRUTH = Path(__file__).resolve().parent / "data" / "mc_mamba1_scan_channel_truth.json"
"""Every channel ablated alone on the committed scan's own prompts (64, seed 0; the file says how it was made)."""


def test_on_the_scans_prompts_the_missed_channels_fall_under_the_threshold(toy):
    """Why refinement misses the truth's third and fourth channels on the committed scan: on the scan's own
    prompts L1C11 and L1C129 (11.2% and 10.3% of clean on the truth's prompts) drop the logit difference by
    only 5.0% and 3.5% alone, and their groups L1S1 and L1S16 by the same (nothing cancels inside the groups),
    while L1C195 and L0C72 stay above the 10% threshold: channels near the threshold move with the prompts.
    The live drops are those of the scan-prompt truth (tests/data), which is checked here."""
    from discovery.measure.ablation import single_head_ablations
    from discovery.rank.truth import channel_view
    from discovery.tasks import build_task
    from discovery.toy import trained_task_options

    lm, _, _ = toy
    truth = json.loads(SCAN_TRUTH.read_text())
    task, options = next(iter(trained_task_options(lm.files).items()))
    prompts = build_task(task, {**options, "n": truth["clean"]["n_prompts"], "seed": truth["seed"]}).prompts()
    batch = annotate(prompts, lm.tokenizer, padding_side="left")
    scan = json.loads((REPORT / "summary.json").read_text())
    assert (scan["options"]["prompts"], scan["options"]["seed"]) == (truth["clean"]["n_prompts"], truth["seed"])
    channels = AblationEngine(channel_view(lm), batch)
    clean = float(channels.clean.logit_diff.mean())
    assert clean == pytest.approx(truth["clean"]["logit_diff"], abs=1e-4)
    assert clean == pytest.approx(scan["tasks"][task]["clean"]["logit_diff"], abs=1e-4)  # 8.82
    named = [(1, 195), (0, 72), (1, 11), (1, 129)]
    effects = channels.effects(single_head_ablations([HeadId(la, c, "ssm") for la, c in named], "zero", ("all",)))
    stored = {(r["layer"], r["channel"]): r["d_ld_all"] for r in truth["channels"]}
    assert effects.logit_diff.mean(1).tolist() == pytest.approx([stored[c] for c in named], abs=1e-4)
    alone = -effects.logit_diff.mean(1) / clean
    assert alone.tolist() == pytest.approx([0.134, 0.103, 0.050, 0.035], abs=0.002)
    width = lm.inventory.group(1, "ssm").width
    together = -AblationEngine(lm, batch).effects(single_head_ablations(
        [HeadId(1, 11 // width, "ssm"), HeadId(1, 129 // width, "ssm")], "zero", ("all",))).logit_diff.mean(1) / clean
    assert together.tolist() == pytest.approx([0.050, 0.033], abs=0.002)
    assert (together - alone[2:]).abs().max() < 0.005 and alone[2:].max() < RefineSettings().effect / 2


def test_the_committed_scan_refines_every_channel_that_counts_on_its_prompts():
    """Recall on the scan's own prompts: of the channels that drop the logit difference by >= 10% there (the
    scan-prompt truth: L1C195 13.4%, L0C72 10.3%; the next is L1C141 at 7.7%), the committed scan's refinement
    leaves hold every one (recall 1.00, 2 of 2) at 12.5 forward-equivalents against 640 for the channel sweep."""
    truth = json.loads(SCAN_TRUTH.read_text())
    record = json.loads((REPORT / "summary.json").read_text())["tasks"][truth["task"]]["refinement"]
    clean = truth["clean"]["logit_diff"]
    important = [(r["layer"], r["channel"]) for r in truth["important"]]
    assert important == [(1, 195), (0, 72)] and truth["effect"] == RefineSettings().effect
    drops = sorted((-r["d_ld_all"] / clean for r in truth["channels"]), reverse=True)
    assert drops[1] >= truth["effect"] and drops[2] < truth["effect"] - 0.02  # the third is 2 points under it
    found = {(leaf["layer"], c) for leaf in record["leaves"] for c in range(leaf["channel_start"], leaf["channel_end"])}
    assert sum(c in found for c in important) / len(important) == 1.0
    assert record["forward_equivalents"] * 10 < record["channel_sweep_forward_equivalents"] == truth["forward_equivalents"]


def test_the_bundled_group_truth_holds_the_channel_truth():
    """The group-level truth (truth.json: every group of 8 ablated alone, 128 prompts) and the channel truth
    agree: no G&A role at either resolution, L0S9 alone breaks the task, and the channel truth's four important
    channels lie in the group truth's top four groups, each group dropping about what its channel drops
    (nothing cancels inside them)."""
    from discovery.model.bundled import bundled_model_path

    path = bundled_model_path(TOY)
    groups = json.loads((path / "truth.json").read_text())
    channels = json.loads((path / "truth_channels.json").read_text())
    assert groups["checkpoint"] == channels["checkpoint"] and groups["clean"]["n_prompts"] == 128
    assert groups["gather"] == groups["aggregate"] == groups["pairs"] == []
    clean = groups["clean"]["logit_diff"]
    ranked = sorted(groups["heads"], key=lambda r: r["d_ld_all"])
    assert [(r["layer"], r["head"]) for r in ranked if r["breaks_task"]] == [(0, 9)]
    width = 8
    top = [(r["layer"], r["head"]) for r in ranked[:4]]
    assert top == [(0, 9), (1, 24), (1, 16), (1, 1)]
    assert {(r["layer"], r["channel"] // width) for r in channels["important"]} == set(top)
    share = {(r["layer"], r["head"]): -r["d_ld_all"] / clean for r in ranked[:4]}
    assert [round(share[g], 3) for g in top] == [0.218, 0.130, 0.095, 0.090]
    assert not any(r["aggregate_set_member"] and r["breaks_task"] for r in groups["heads"])


def test_toy_truth_channels_cli_scopes(tmp_path):
    """``gascan toy truth --channels --scopes all``: every channel of every Mamba-1 layer ablated once, at
    the scope asked for only; a scope that is not all/query is refused with one line (exit 2)."""
    from pipelines.cli import main

    out = tmp_path / "truth_channels.json"
    assert main(["toy", "truth", "tiny:mamba", "--channels", "--scopes", "all", "--prompts", "4",
                 "--out", str(out)]) == 0
    truth = json.loads(out.read_text())
    assert truth["scopes"] == ["all"] and truth["n_channels"] == len(truth["channels"]) > 0
    assert all("d_ld_all" in r and "d_ld_query" not in r for r in truth["channels"])
    assert main(["toy", "truth", "tiny:mamba", "--channels", "--scopes", "segment", "--prompts", "4",
                 "--out", str(out)]) == 2
