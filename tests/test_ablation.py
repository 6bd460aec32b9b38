"""The ablation engine: batched, prefix-reusing runs equal the naive loop on every architecture,
and zeroing a head through the adapter equals zeroing its columns of the output projection."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from discovery.heads import HeadId
from discovery.measure.ablation import Ablation, AblationEngine, Scores, keep_only, single_head_ablations
from discovery.model.loading import load_model
from discovery.model.tiny import TINY_CONFIGS
from discovery.tasks.base import annotate
from tests.helpers import mc_prompts

ARCHS = sorted(TINY_CONFIGS)


@pytest.fixture(scope="module", params=ARCHS)
def engine(request):
    lm = load_model(f"tiny:{request.param}")
    batch = annotate(mc_prompts(4), lm.tokenizer, padding_side="left")
    return AblationEngine(lm, batch, max_rows=24)


def _close(a, b, tol=1e-5):
    for metric in ("logit_diff", "gold_logprob", "acc"):
        assert torch.allclose(a[metric], b[metric], atol=tol), metric


def test_batched_equals_naive(engine):
    """Mixed interventions and scopes in one batched run equal one full forward per ablation."""
    per_layer = 2 if engine.lm.spec == "tiny:llama" else 1  # every layer; keeps the hybrids' test short
    heads = [h for h in engine.inventory.heads() if h.index < per_layer]
    ablations = [abl for method, scope in [("zero", ("all",)), ("zero", ("query",)), ("mean", ("all",)),
                                           ("mean", ("summary", "segment"))]
                 for abl in single_head_ablations(heads, method, scope)]
    batched = engine.run(ablations)
    naive = engine.run_naive(ablations)
    assert batched.logit_diff.shape == (len(ablations), 4)
    _close(batched, naive)
    # the ablations really change something (the test could not pass on a no-op)
    assert (batched.logit_diff - engine.clean.logit_diff).abs().max() > 1e-4


def test_prefix_reuse_costs_less_than_naive_and_the_count_is_the_flops(engine):
    """The engine's cost count is the matmul FLOPs it runs, in clean forwards: prefix reuse costs the layers
    from each ablated one on (weighed by their measured FLOPs, plus the readout), the naive loop a whole
    forward per ablation."""
    from discovery.measure.flops import MatmulFlops

    heads = [h for h in engine.inventory.heads() if h.index < 1]
    ablations = single_head_ablations(heads)
    predicted = engine.predicted_forward_equivalents(ablations)
    engine.layer_rows = 0
    with MatmulFlops() as batched_flops:
        engine.run(ablations)
    batched = engine.forward_equivalents
    engine.layer_rows = 0
    with MatmulFlops() as naive_flops:
        engine.run_naive(ablations)
    naive = engine.forward_equivalents
    assert batched == pytest.approx(predicted, rel=1e-9)
    assert naive == pytest.approx(len(heads), rel=1e-9)  # a whole clean forward each (edits add no matmul)
    clean_flops = naive_flops.total / len(heads)
    assert batched == pytest.approx(batched_flops.total / clean_flops, rel=1e-6)
    layers = engine.inventory.n_layers
    assert batched < naive
    assert batched == pytest.approx(sum(layers - h.layer for h in heads) / layers, rel=0.5)  # layers dominate


def test_shared_prefixes_equal_naive_at_the_predicted_cost_below_the_unshared(engine):
    """Ablations that agree up to a layer (pair controls with one gather head, a group with a member spared,
    holds after the edit) share those layers: the same scores as one full forward each, at the predicted
    cost (= the engine's count), below the cost of running each from its first layer."""
    heads = list(engine.inventory.heads())
    gather, later = heads[0], [h for h in heads if h.layer > heads[0].layer]
    ablations = ([Ablation((gather, h), label="control") for h in later[:6]]
                 + [Ablation(tuple(x for x in heads[:5] if x != s), label=f"spare:{s}") for s in heads[:5]]
                 + [replace(Ablation((gather,), scope=("segment",)), hold=(h,)) for h in later[:3]])
    predicted = engine.predicted_forward_equivalents(ablations)
    engine.layer_rows = 0
    shared = engine.run(ablations)
    assert engine.forward_equivalents == pytest.approx(predicted, rel=1e-9)
    _close(shared, engine.run_naive(ablations))
    unshared = sum(engine._pass_units(a.first_layer) for a in ablations) / engine.inventory.n_layers
    assert predicted < unshared - 0.1


def test_candidates_only_readout_scores_as_the_full_one_at_its_predicted_cost(engine):
    """``logprob=False`` (random controls) reads out only the candidates' unembedding rows: the same accuracy and
    logit difference as the whole-vocabulary readout, gold log-prob not scored (NaN), at the predicted cost
    (= the engine's count = the counted FLOPs), below the full readout's."""
    from discovery.measure.flops import MatmulFlops

    assert engine.readout is not None  # every tiny architecture's readout is norm, unembedding (and soft-cap)
    heads = [h for h in engine.inventory.heads() if h.index < 1]
    ablations = [*single_head_ablations(heads), Ablation(tuple(heads[:2]))]
    full = engine.run(ablations)
    predicted = engine.predicted_forward_equivalents(ablations, logprob=False)
    engine.layer_rows = 0
    with MatmulFlops() as counted:
        short = engine.run(ablations, logprob=False)
    assert engine.forward_equivalents == pytest.approx(predicted, rel=1e-9)
    one_forward = engine._unit_flops * engine.inventory.n_layers  # a clean forward's FLOPs over the batch
    assert counted.total / one_forward == pytest.approx(predicted, rel=1e-6)
    assert predicted < engine.predicted_forward_equivalents(ablations)
    assert torch.allclose(short.logit_diff, full.logit_diff, atol=1e-5) and torch.equal(short.acc, full.acc)
    assert short.gold_logprob.isnan().all()
    query = single_head_ablations(heads, scope=("query",))  # the query fast path, too
    assert torch.allclose(engine.run(query, logprob=False).logit_diff, engine.run(query).logit_diff, atol=1e-5)


def test_a_readout_the_shortcut_cannot_reproduce_keeps_the_full_one():
    """The candidates-only readout is checked against the clean logits: a model that scales its logits in a way
    it does not know (here a soft-cap the shortcut would apply and the model does not) keeps the full readout."""
    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(4), lm.tokenizer, padding_side="left")
    lm.model.config.final_logit_softcapping = 0.5  # read by the shortcut only; llama's forward ignores it
    engine = AblationEngine(lm, batch)
    assert engine.readout is None
    scores = engine.run([Ablation((engine.inventory.heads()[0],))], logprob=False)
    assert not scores.gold_logprob.isnan().any()


def test_plan_shares_exactly_the_layers_ablations_agree_on():
    """The prefix tree on a 6-layer inventory: controls (x, y) with one x share x's layers until the first y's
    (layers 1-2), then part (both from layer 3); a lone ablation is one scored pass from its first layer; equal
    edits are one pass for both."""
    from discovery.measure.shared import plan_passes

    x, y1, y2, z = HeadId(1, 0, "attn"), HeadId(3, 0, "attn"), HeadId(4, 1, "attn"), HeadId(2, 2, "attn")
    plan = plan_passes([Ablation((x, y1)), Ablation((x, y2)), Ablation((z,)),
                        Ablation((x, y1), hold=(HeadId(0, 1, "attn"),))], 6)  # a hold before any edit: no-op
    spans = sorted((p.start, p.last, p.members) for p in plan)
    assert spans == [(1, 2, ()), (2, None, (2,)), (3, None, (0, 3)), (3, None, (1,))]
    stem = next(i for i, p in enumerate(plan) if p.last is not None)
    assert all(p.parent == stem for p in plan if p.start == 3)
    assert next(p for p in plan if p.start == 2).parent is None


def test_multi_head_and_keep_only(engine):
    inv = engine.inventory
    last = inv.n_layers - 1
    ablations = [Ablation(tuple(inv.heads()[:3])), keep_only(inv, [last], inv.group(last, inv.groups[-1].kind).heads()[:1])]
    _close(engine.run(ablations), engine.run_naive(ablations))


def test_zero_ablation_equals_zeroed_weight_columns(engine):
    """Independent check of the hook: zero the head's input columns of out_proj in a copy."""
    lm = engine.lm
    group = lm.inventory.groups[len(lm.inventory.groups) // 2]
    head = group.heads()[1]
    # Zamba2's shared attention block is one module in several layers: ablate it wherever it runs
    proj = lm.adapter.out_proj(group.layer, group.kind)
    same = [g for g in lm.inventory.groups if lm.adapter.out_proj(g.layer, g.kind) is proj]
    heads = tuple(g.heads()[1] for g in same)
    scores = engine.run([Ablation(heads)])
    model = copy.deepcopy(lm.model)
    edited = model.get_submodule(group.out_proj)
    with torch.no_grad():
        if type(edited).__name__ == "Conv1D":  # GPT-2 stores [in, out]
            edited.weight[group.columns(head.index), :] = 0
        else:
            edited.weight[:, group.columns(head.index)] = 0
    twin = copy.copy(lm)
    twin.model = model
    from discovery.model.adapter import adapter_for

    twin.adapter = adapter_for(model)
    reference = AblationEngine(twin, engine.batch).clean
    _close(scores, reference)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "zamba2", "jamba", "falcon_h1"])
def test_knockout_of_every_key_equals_query_zero_ablation(arch):
    lm = load_model(f"tiny:{arch}")
    engine = AblationEngine(lm, annotate(mc_prompts(4), lm.tokenizer, padding_side="left"))
    attn = [h for h in engine.inventory.heads("attn") if h.index < 1]
    knock = engine.run(single_head_ablations(attn, "knockout", ("query",), keys=("all",)))
    zero_q = engine.run(single_head_ablations(attn, "zero", ("query",)))
    _close(knock, zero_q)
    seg = engine.run(single_head_ablations(attn, "knockout", ("query",), keys=("segment",)))
    _close(seg, engine.run_naive(single_head_ablations(attn, "knockout", ("query",), keys=("segment",))))


@pytest.mark.parametrize("arch", ["mamba2", "mamba", "bamba"])
def test_ssm_edge_knockout_batched_equals_naive(arch):
    """SSM knockout removes implicit-attention entries; batched rows match one forward per ablation."""
    lm = load_model(f"tiny:{arch}")
    engine = AblationEngine(lm, annotate(mc_prompts(3), lm.tokenizer, padding_side="left"))
    heads = [h for h in engine.inventory.heads("ssm") if h.index < 2]
    ablations = single_head_ablations(heads, "knockout", ("query",), keys=("segment", "label"))
    batched = engine.run(ablations)
    _close(batched, engine.run_naive(ablations))
    if arch != "bamba":  # bamba's random init gives SSM paths too small to move the logits measurably
        assert (batched.logit_diff - engine.clean.logit_diff).abs().max() > 1e-5


def test_patterns_under_an_ablation_use_the_engine_plan():
    """Zeroing a layer-0 head through engine.plan changes later patterns exactly as a weight edit does."""
    from discovery.measure.patterns import collect_patterns, for_each_pattern

    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(4), lm.tokenizer, padding_side="left")
    engine = AblationEngine(lm, batch)
    head = lm.inventory.heads()[0]
    seen = []
    for_each_pattern(lm, batch, lambda g, r, p, e: seen.append(p), layers=[1], chunk_prompts=3,
                     edits_for=lambda rows: engine.plan([Ablation((head,))], rows))
    under = torch.cat(seen)
    model = copy.deepcopy(lm.model)
    with torch.no_grad():
        model.get_submodule(lm.inventory.group(0, "attn").out_proj).weight[:, lm.inventory.group(0, "attn").columns(0)] = 0
    twin = copy.copy(lm)
    twin.model = model
    from discovery.model.adapter import adapter_for

    twin.adapter = adapter_for(model)
    reference = collect_patterns(twin, batch, layers=[1])[(1, "attn")]
    clean = collect_patterns(lm, batch, layers=[1])[(1, "attn")]
    assert torch.allclose(under, reference, atol=1e-6)
    assert (under - clean).abs().max() > 1e-4


def test_held_heads_batched_equal_naive(engine):
    """Ablations that hold later heads at their clean outputs: batched rows equal one forward each, and
    holding changes the result (the held heads carry part of the edit's effect)."""
    inv = engine.inventory
    first = inv.heads()[0]  # [layer 0]
    later = [h for h in inv.heads() if h.layer > first.layer and h.index < 2]
    ablations = [Ablation((first,), "zero", ("segment",)),
                 Ablation((first,), "zero", ("segment",), hold=tuple(later[:1])),
                 Ablation((first,), "mean", ("all",), hold=tuple(later)),
                 Ablation((first,), hold=tuple(later), hold_scope=("all",))]
    batched = engine.run(ablations)
    _close(batched, engine.run_naive(ablations))
    query_only = [Ablation((later[0],), "zero", ("query",), hold=tuple(h for h in later[1:] if h.layer > later[0].layer))]
    _close(engine.run(query_only), engine.run_naive(query_only))  # attention-only models: the cached last-token path
    assert (batched.logit_diff[2] - batched.logit_diff[0]).abs().max() > 1e-6


def test_holding_a_head_rejects_bad_requests():
    head = HeadId(0, 0, "attn")
    with pytest.raises(ValueError, match="both ablated and held"):
        Ablation((head,), hold=(head,))
    with pytest.raises(ValueError, match="unknown position class"):
        Ablation((head,), hold=(HeadId(1, 0, "attn"),), hold_scope=("final",))


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_holding_a_head_equals_patching_its_clean_columns_by_hand(arch):
    """Independent check of ``hold``: pre-hooks on the out-projections zero the gather-side head at the
    segment positions and paste the held head's clean columns back at the query."""
    from discovery.measure.ablation import query_scores, scope_positions

    lm = load_model(f"tiny:{arch}")
    engine = AblationEngine(lm, annotate(mc_prompts(4), lm.tokenizer, padding_side="left"))
    inv = lm.inventory
    g = inv.heads()[1]
    a = inv.group(inv.n_layers - 1, inv.groups[-1].kind).heads()[2]
    g_group, a_group = inv.group(g.layer, g.kind), inv.group(a.layer, a.kind)
    g_proj, a_proj = lm.model.get_submodule(g_group.out_proj), lm.model.get_submodule(a_group.out_proj)
    g_cols, a_cols = g_group.columns(g.index), a_group.columns(a.index)
    segment = scope_positions(engine.classes, ("segment",))[..., None]  # [prompt, pos, 1]
    query = scope_positions(engine.classes, ("query",))[..., None]
    inputs = engine._inputs(1)
    clean_in: list[torch.Tensor] = []
    grab = a_proj.register_forward_pre_hook(lambda m, args: clean_in.append(args[0].detach().clone()))
    with torch.no_grad():
        lm.model(**inputs)
    grab.remove()

    def zero_g(module, args):
        x = args[0].clone()
        x[..., g_cols] = torch.where(segment, 0.0, x[..., g_cols])
        return (x,)

    def hold_a(module, args):
        x = args[0].clone()
        x[..., a_cols] = torch.where(query, clean_in[0][..., a_cols], x[..., a_cols])
        return (x,)

    hooks = [g_proj.register_forward_pre_hook(zero_g), a_proj.register_forward_pre_hook(hold_a)]
    try:
        with torch.no_grad():
            by_hand = query_scores(lm.model(**inputs).logits[:, -1, :].float()[None], engine.batch)
    finally:
        for h in hooks:
            h.remove()
    held, plain = engine.run([Ablation((g,), "zero", ("segment",), hold=(a,)), Ablation((g,), "zero", ("segment",))])[
        "logit_diff"]
    assert torch.allclose(held, by_hand.logit_diff[0], atol=1e-5)
    assert (held - plain).abs().max() > 1e-6


def test_mediated_share_is_the_cost_given_back():
    from discovery.measure.ablation import mediated_share

    assert mediated_share(-4.0, -1.0) == pytest.approx(0.75)
    assert mediated_share(-4.0, -4.0) == 0.0 and mediated_share(-4.0, 0.0) == 1.0
    assert mediated_share(0.0, 0.0) is None and mediated_share(-0.1, 0.0, min_cost=0.5) is None
    assert mediated_share(float("nan"), 1.0) is None


def test_predicted_cost_is_what_runs_cost_and_duplicates_run_once(engine):
    """The planner's forward-equivalents equal the engine's own count of what ran (query fast path
    included), and ablations that differ only in their label are computed once with the same scores."""
    heads = [h for h in engine.inventory.heads() if h.index < 1]
    distinct = single_head_ablations(heads, "zero", ("all",)) + single_head_ablations(heads, "zero", ("query",)) \
        + single_head_ablations(heads, "mean", ("segment",))
    with_copies = distinct + [Ablation(a.heads, a.method, a.scope, label=f"copy of {a.name}") for a in distinct[::2]]
    predicted = engine.predicted_forward_equivalents(with_copies)  # with the mean values' pass, if not kept yet
    predicted_distinct = engine.predicted_forward_equivalents(distinct)
    engine.layer_rows = 0
    scores = engine.run(with_copies)
    assert predicted == pytest.approx(engine.forward_equivalents, rel=1e-9)
    assert predicted == pytest.approx(predicted_distinct, rel=1e-9)
    copies = scores.logit_diff[len(distinct):]
    assert torch.equal(copies, scores.logit_diff[:len(distinct)][::2])
    first = Scores(*(scores[m][:len(distinct)] for m in ("acc", "logit_diff", "gold_logprob")))
    _close(first, engine.run_naive(distinct))


def test_mediation_on_the_query_fast_path_equals_the_full_runs_at_its_predicted_cost(engine):
    """The mediation test recomputes only the query for heads held there (attention models): the same
    effects as running each held ablation over the whole sequence, at the cost mediation_cost predicts,
    which on the fast path is below the full runs'."""
    heads = list(engine.inventory.heads())
    gather = heads[0]
    holds = [(h,) for h in heads if h.layer > gather.layer][:6]
    base = Ablation((gather,), "zero", ("segment",))
    runs = [base, *(replace(base, hold=h) for h in holds)]
    full = engine.effects(runs).logit_diff.double().mean(1)  # [1 + hold]
    predicted = engine.mediation_cost(base, holds)
    engine.layer_rows = 0
    cost, held = engine.mediation(base, holds)
    assert engine.forward_equivalents == pytest.approx(predicted, rel=1e-9)
    assert [cost, *held] == pytest.approx(full.tolist(), abs=1e-5)
    assert max(abs(x - cost) for x in held) > 1e-6  # holding a head changes something
    if engine.query_fast_path:
        assert predicted < engine.predicted_forward_equivalents(runs)
