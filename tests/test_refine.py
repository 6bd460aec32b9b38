"""Mamba-1 channel refinement (discovery/measure/refine.py): planted channels are found exactly, the batched
tree equals a naive loop of plain-hook ablations, and on the bundled Mamba-1 toy the refined channels match
the exhaustive channel truth at a fraction of its cost."""
from __future__ import annotations

import dataclasses
import json

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
