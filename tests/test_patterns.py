"""Streamed per-head patterns on every tiny architecture, under left padding.

Attention heads must equal the eager implementation's ``output_attentions``; SSM heads must equal
the implicit attention computed directly from each mixer's input (Mamba-1: the mean over each
channel group), and ``y = M x + D x`` from the streamed pattern and ``D`` must give the scan output.
(That the scan output is the mixer's own is tested in tests/test_ssm.py.)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from discovery.heads import HeadGroup
from discovery.measure import metrics
from discovery.measure.patterns import collect_patterns, for_each_pattern, model_inputs, pattern_metric_values
from discovery.model import ssm
from discovery.model.adapter import adapter_for
from discovery.model.loading import LoadedModel, load_model
from discovery.model.tiny import TINY_CONFIGS
from discovery.tasks.base import AnnotatedBatch, annotate
from tests.helpers import mc_prompts

ARCHS = sorted(TINY_CONFIGS)
ATTN_ARCHS = [a for a in ARCHS if a not in ("mamba", "falcon_mamba", "mamba2")]
SSM_ARCHS = ["bamba", "falcon_h1", "falcon_mamba", "jamba", "mamba", "mamba2", "zamba2"]
MAMBA1_ARCHS = ["falcon_mamba", "jamba", "mamba"]


@dataclass
class Case:
    """One tiny model, a left-padded batch, its streamed patterns and an eager reference pass."""

    lm: LoadedModel
    batch: AnnotatedBatch
    patterns: dict[tuple[int, str], torch.Tensor]  # (layer, kind) -> [batch, head, q, k]
    eager_attentions: list[torch.Tensor]  # [batch, head, q, k] per attention layer, in layer order
    mixer_inputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]]  # layer -> (hidden, mask)


def reference_pass(lm: LoadedModel, batch: AnnotatedBatch):
    """Eager forward with ``output_attentions`` and the input of every SSM mixer (own hooks)."""
    model = lm.model
    ssm_groups = [g for g in lm.inventory.groups if g.kind == "ssm"]
    mixers = {g.layer: lm.adapter.mixer(g.layer, "ssm") for g in ssm_groups}
    assert len({id(m) for m in mixers.values()}) == len(mixers)  # one mixer module per layer
    captured: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def hook(layer: int) -> Callable:
        def record(module, args, kwargs):
            captured[layer] = ssm.mixer_inputs(args, kwargs)

        return record

    handles = [m.register_forward_pre_hook(hook(layer), with_kwargs=True) for layer, m in mixers.items()]
    previous = model.config._attn_implementation
    try:
        if any(g.kind == "attn" for g in lm.inventory.groups):
            model.set_attn_implementation("eager")
        with torch.no_grad():
            kwargs = model_inputs(model, batch)
            if any(g.kind == "attn" for g in lm.inventory.groups):
                kwargs["output_attentions"] = True
            out = model(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
    attentions = [a for a in (getattr(out, "attentions", None) or ()) if a is not None]
    return attentions, captured


def perturb(model: torch.nn.Module, seed: int = 1) -> None:
    """Shift every 1-D parameter (norm weights, biases, D, dt_bias, A_log): at initialisation the tiny
    SSMs' implicit attention is ~1e-5 and ``D x`` dominates ``y``, which would let a wrong M pass."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))


@pytest.fixture(scope="module")
def cases() -> Callable[[str], Case]:
    """Build each architecture's case once per module, on first use."""
    built: dict[str, Case] = {}

    def get(arch: str) -> Case:
        if arch not in built:
            lm = load_model(f"tiny:{arch}")
            perturb(lm.model)
            # two prompts of different lengths (left padding), short: Mamba-1 per-channel work grows as t^2
            batch = annotate(mc_prompts(2, n_choices=2), lm.tokenizer, padding_side="left")
            assert (batch.attention_mask[:, 0] == 0).any() and (batch.attention_mask[:, -1] == 1).all()
            patterns = collect_patterns(lm, batch)
            attentions, inputs = reference_pass(lm, batch)
            built[arch] = Case(lm, batch, patterns, attentions, inputs)
        return built[arch]

    return get


def real(batch: AnnotatedBatch) -> torch.Tensor:
    """[batch, q, k] bool: a real query reading a real key at or before it."""
    mask = batch.attention_mask.bool()  # [batch, pos]
    causal = torch.ones(mask.shape[1], mask.shape[1]).tril().bool()
    return mask[:, :, None] & mask[:, None, :] & causal


def test_every_group_streamed(cases) -> None:
    for arch in ARCHS:
        case = cases(arch)
        n, t = case.batch.input_ids.shape
        assert set(case.patterns) == {(g.layer, g.kind) for g in case.lm.inventory.groups}
        for group in case.lm.inventory.groups:
            assert case.patterns[(group.layer, group.kind)].shape == (n, group.count, t, t), arch


@pytest.mark.parametrize("arch", ATTN_ARCHS)
def test_attention_equals_eager_output_attentions(arch: str, cases) -> None:
    case = cases(arch)
    groups = [g for g in case.lm.inventory.groups if g.kind == "attn"]
    assert len(case.eager_attentions) == len(groups) > 0
    valid = real(case.batch)[:, None]  # [batch, 1, q, k]
    for group, eager in zip(groups, case.eager_attentions):
        pattern = case.patterns[(group.layer, "attn")]
        torch.testing.assert_close(pattern, eager, atol=1e-6, rtol=0)
        rows = case.batch.attention_mask.bool()[:, None, :, None].expand_as(pattern)  # real queries
        sums = pattern.masked_fill(~valid, 0).sum(-1)  # [batch, head, q]
        torch.testing.assert_close(sums[rows[..., 0]], torch.ones_like(sums[rows[..., 0]]), atol=1e-5, rtol=0)
        assert pattern.masked_select(rows & ~valid).abs().max() < 1e-6  # padding and future keys: 0
        # heads differ (GQA: query heads sharing a key/value head are still separate patterns)
        assert (pattern[:, 0] - pattern[:, 1]).abs().max() > 1e-3


def expected_ssm(case: Case, group: HeadGroup) -> tuple[ssm.SSMComponents, torch.Tensor, torch.Tensor]:
    """Components, pattern and D of an SSM group computed directly from its mixer's input."""
    hidden, mask = case.mixer_inputs[group.layer]
    comp = ssm.ssm_components(case.lm.adapter.mixer(group.layer, "ssm"), hidden, mask)
    if group.pattern == "mamba1":  # per channel, then the mean over each contiguous group
        per_channel = ssm.implicit_attention(comp)  # [batch, channel, q, k]
        b, c, q, k = per_channel.shape
        pattern = per_channel.view(b, group.count, c // group.count, q, k).mean(2)
        d_skip = comp.D.view(group.count, -1).mean(-1)
    else:
        pattern, d_skip = ssm.implicit_attention(comp), comp.D
    return comp, pattern, d_skip


@pytest.mark.parametrize("arch", SSM_ARCHS)
def test_ssm_pattern_equals_implicit_attention_of_mixer_input(arch: str, cases) -> None:
    case = cases(arch)
    groups = [g for g in case.lm.inventory.groups if g.kind == "ssm"]
    extras: dict[int, dict] = {}
    for_each_pattern(case.lm, case.batch, lambda g, r, p, e: extras.setdefault(g.layer, e), kinds=("ssm",))
    valid = real(case.batch)[:, None]
    for group in groups:
        _, want, d_skip = expected_ssm(case, group)
        got = case.patterns[(group.layer, "ssm")]
        assert want.abs().max() > 1e-2  # a pattern worth comparing (see perturb)
        torch.testing.assert_close(got, want, atol=1e-6 * float(want.abs().max()), rtol=1e-5)
        torch.testing.assert_close(extras[group.layer]["D"], d_skip, atol=0, rtol=0)
        real_queries = case.batch.attention_mask.bool()[:, None, :, None].expand_as(got)
        assert got.masked_select(real_queries & ~valid).abs().max() < 1e-6  # padding and future keys: 0


@pytest.mark.parametrize("arch", SSM_ARCHS)
def test_streamed_pattern_reproduces_scan_output(arch: str, cases) -> None:
    """``y = M x + D x`` with M and D as streamed (Mamba-1 at channel level) equals ssm.scan_output."""
    case = cases(arch)
    lm = case.lm
    if arch in MAMBA1_ARCHS:  # group means cannot rebuild y: stream the channel-level view
        lm = LoadedModel(lm.model, lm.tokenizer, adapter_for(lm.model, mamba1_group_width=1), lm.spec)
    streamed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for_each_pattern(lm, case.batch, lambda g, r, p, e: streamed.setdefault(g.layer, (p, e["D"])),
                     kinds=("ssm",))
    assert set(streamed) == {g.layer for g in lm.inventory.groups if g.kind == "ssm"}
    for layer, (M, d_skip) in streamed.items():
        group = lm.inventory.group(layer, "ssm")
        hidden, mask = case.mixer_inputs[layer]
        comp = ssm.ssm_components(lm.adapter.mixer(layer, "ssm"), hidden, mask)
        if group.pattern == "mamba1":
            assert group.width == 1 and M.shape[1] == comp.x.shape[-1]
            mx = torch.einsum("bcts,bsc->btc", M, comp.x)  # [batch, pos, channel]
            dx = d_skip.detach() * comp.x
        else:
            mx = torch.einsum("bhts,bshp->bthp", M, comp.x)  # [batch, pos, head, d_head]
            dx = d_skip.detach()[:, None] * comp.x
        want = ssm.scan_output(comp)
        assert (want - dx).abs().max() > 1e-3  # the M x part matters at the tolerance below
        torch.testing.assert_close(mx + dx, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunking_gives_identical_patterns(arch: str, cases) -> None:
    """chunk_prompts=1 (one prompt per pass) equals the default chunking; sinks stream layer by layer."""
    case = cases(arch)
    calls: list[tuple[int, str, slice]] = []
    parts: dict[tuple[int, str], list[torch.Tensor]] = {}

    def sink(group: HeadGroup, rows: slice, pattern: torch.Tensor, extras: dict) -> None:
        calls.append((group.layer, group.kind, rows))
        assert pattern.shape[0] == rows.stop - rows.start == 1
        parts.setdefault((group.layer, group.kind), []).append(pattern)

    for_each_pattern(case.lm, case.batch, sink, chunk_prompts=1)
    n, groups = len(case.batch), {(g.layer, g.kind) for g in case.lm.inventory.groups}
    assert len(calls) == n * len(groups)
    for i in range(n):  # each chunk: every group once, layer by layer (in a layer, in execution order)
        chunk = calls[i * len(groups):(i + 1) * len(groups)]
        assert {(c[2].start, c[2].stop) for c in chunk} == {(i, i + 1)}
        assert {(layer, kind) for layer, kind, _ in chunk} == groups
        assert [layer for layer, _, _ in chunk] == sorted(layer for layer, _, _ in chunk)
    for key, pattern in case.patterns.items():
        torch.testing.assert_close(torch.cat(parts[key]), pattern, atol=1e-6, rtol=1e-5)


def test_layer_and_kind_selection(cases) -> None:
    case = cases("zamba2")
    only = collect_patterns(case.lm, case.batch, layers=[3], kinds=("attn",), chunk_prompts=2)
    assert set(only) == {(3, "attn")}
    torch.testing.assert_close(only[(3, "attn")], case.patterns[(3, "attn")], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mamba2", "zamba2"])
def test_streamed_metrics_equal_metrics_of_the_whole_patterns(arch: str, cases) -> None:
    """pattern_metric_values, one prompt per pass, gives every metric of every head exactly as
    pattern_metrics on the full patterns of the whole batch (per prompt, NaN where undefined)."""
    case = cases(arch)
    ticks: list[int] = []
    streamed = pattern_metric_values(case.lm, case.batch, chunk_prompts=1, on_chunk=lambda: ticks.append(1))
    assert set(streamed) == set(case.patterns)
    assert len(ticks) == len(case.batch) * len(case.patterns)
    for key, pattern in case.patterns.items():
        whole = metrics.pattern_metrics(pattern.float(), case.batch)
        assert set(streamed[key]) == set(metrics.PATTERN_METRICS) == set(whole)
        for name, values in whole.items():
            assert streamed[key][name].shape == values.shape == (len(case.batch), pattern.shape[1])
            torch.testing.assert_close(streamed[key][name], values, atol=1e-5, rtol=1e-4, equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "mamba2", "zamba2", "jamba"])
def test_engine_watch_passes_equal_whole_forwards_and_cost_their_span(arch: str, cases) -> None:
    """Patterns through the engine (layers before the first watched or edited one from its clean pass, the
    pass halted after the last watched layer) equal those of a whole forward, clean and under an ablation,
    and each pass costs the layers of its span, as predicted."""
    from discovery.measure.ablation import Ablation, AblationEngine
    from discovery.measure.flops import MatmulFlops

    case = cases(arch)
    engine = AblationEngine(case.lm, case.batch)
    watched = [g.layer for g in case.lm.inventory.groups if g.layer >= 1]
    first, last = min(watched), max(watched)
    some = next(iter(engine.inventory.heads()))
    with MatmulFlops() as clean:  # edits add no matmul: one whole clean forward
        engine.run_naive([Ablation((some,))])
    engine.layer_rows = 0
    with MatmulFlops() as counted:
        reused = collect_patterns(case.lm, case.batch, layers=watched, engine=engine)
    assert engine.forward_equivalents == pytest.approx(engine.predicted_watch_fe(first, last))
    model_only = counted.total / clean.total
    if all(g.kind == "attn" for g in engine.inventory.groups):
        assert engine.forward_equivalents == pytest.approx(model_only, rel=1e-6)
    else:  # the SSM heads' implicit attention is matmul work of the pattern extraction, on top of the model's
        assert engine.forward_equivalents < model_only
    assert engine.forward_equivalents < 1.0  # layers before the first watched one and the readout do not run
    for key, pattern in reused.items():
        torch.testing.assert_close(pattern, case.patterns[key], atol=1e-5, rtol=1e-4)

    ablated = next(h for h in engine.inventory.heads() if h.layer == 0)
    edits = lambda rows: engine.plan([Ablation((ablated,))], rows)
    whole = collect_patterns(case.lm, case.batch, layers=[last], edits_for=edits)
    engine.layer_rows = 0
    under = collect_patterns(case.lm, case.batch, layers=[last], edits_for=edits, engine=engine)
    assert engine.forward_equivalents == pytest.approx(engine.predicted_watch_fe(0, last))
    assert set(under) == set(whole) and under
    for key, pattern in under.items():
        torch.testing.assert_close(pattern, whole[key], atol=1e-5, rtol=1e-4)
        assert not torch.equal(pattern, case.patterns[key])  # the ablation reached the watched layer


@pytest.mark.parametrize("arch", ["llama", "zamba2"])
def test_dla_from_the_engine_equals_its_own_pass(arch: str, cases) -> None:
    """Direct logit attribution from what the engine's clean pass kept equals head_dla's own forward."""
    from discovery.measure.ablation import AblationEngine
    from discovery.measure.dla import _group_dla, head_dla
    from discovery.model.intervene import Intervener, PassConfig

    case = cases(arch)
    lm, batch = case.lm, case.batch
    groups = list(lm.inventory.groups)
    engine = AblationEngine(lm, batch)
    kept = head_dla(lm, batch, groups, engine)
    # the reference: a forward of its own, capturing the out-projection inputs and the final norm's input
    rows = torch.arange(len(batch))
    captured: dict[tuple[int, str], torch.Tensor] = {}
    norm_in: list[torch.Tensor] = []

    def grab(key):
        def edit(x):
            captured[key] = x[rows, batch.query_pos].detach()
            return x
        return edit

    norm = lm.adapter.final_norm()
    handle = norm.register_forward_pre_hook(lambda m, a: norm_in.append(a[0].detach()))
    try:
        with torch.no_grad(), Intervener(lm.adapter).run(PassConfig(proj_edits={(g.layer, g.kind): grab((g.layer, g.kind))
                                                                                for g in groups})):
            lm.model(**model_inputs(lm.model, batch))
    finally:
        handle.remove()
    with torch.no_grad():
        own = _group_dla(lm, batch, groups, captured, norm, norm_in[-1][rows, batch.query_pos].float())
    assert set(own) == set(kept) == {(g.layer, g.kind) for g in groups}
    scale = max(float(v.abs().max()) for v in own.values())  # DLA values carry no autograd graph
    assert scale > 0  # not trivially zero
    for key in own:
        torch.testing.assert_close(kept[key].detach(), own[key].detach(), atol=1e-4 * scale, rtol=1e-4)


def test_a_halted_pass_runs_no_later_layer_and_no_unembedding(cases) -> None:
    """``halt_after=k``: layer k's sinks fire, no later layer runs, no logits are computed, and the
    ``with`` block ends normally."""
    from discovery.measure.flops import MatmulFlops
    from discovery.model.intervene import Intervener, PassConfig

    case = cases("llama")
    lm, n_layers = case.lm, case.lm.inventory.n_layers
    ran: list[int] = []
    sinks = {i: (lambda h, i=i: ran.append(i)) for i in range(n_layers)}
    with MatmulFlops() as whole, torch.no_grad():
        lm.model(**model_inputs(lm.model, case.batch))
    with MatmulFlops() as halted, torch.no_grad(), Intervener(lm.adapter).run(PassConfig(layer_sinks=sinks,
                                                                                          halt_after=1)):
        out = lm.model(**model_inputs(lm.model, case.batch))
    assert ran == [0, 1]
    assert "out" not in locals() or out is None
    unembed = 2 * case.batch.input_ids.numel() * lm.adapter.unembed().weight.numel()
    assert halted.total < whole.total - unembed  # neither the later layers nor the unembedding ran
