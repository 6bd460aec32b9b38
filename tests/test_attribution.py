"""The attribution screen (AtP, and the QK fix of AtP*): what it estimates, where it is exact, what it costs.

- AtP is, by construction, the derivative of the ablation effect along the ablation direction:
  checked against a Richardson-extrapolated central difference on every tiny architecture.
- Where the model is linear in the ablated quantity (last-layer heads, with the last MLP silenced
  and the final norm removed) the estimate equals the exact effect, for zero and mean ablation,
  attention and SSM heads, a transformer and hybrids.
- On a plain tiny model the estimate's error is the Taylor remainder: mostly the measured curvature.
- The QK fix is exact when a head acts only through a later layer's (saturated) attention pattern,
  and leaves heads it does not apply to untouched.
"""
from __future__ import annotations

import copy

import pytest
import torch

from discovery.errors import GascanError
from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine, single_head_ablations
from discovery.measure.attribution import atp_effects, rank_agreement
from discovery.measure.patterns import model_inputs
from discovery.model.adapter import adapter_for
from discovery.model.intervene import Intervener, PassConfig
from discovery.model.loading import LoadedModel, load_model
from discovery.model.tiny import TINY_CONFIGS, tiny_tokenizer
from discovery.tasks.base import AnnotatedBatch, annotate
from tests.helpers import mc_prompts


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and the machine's cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _batch(lm: LoadedModel, n: int, seed: int = 0):
    return annotate(mc_prompts(n, seed=seed), lm.tokenizer, padding_side="left")


def _logit_diff(logits: torch.Tensor, batch) -> torch.Tensor:
    """Gold minus mean other candidate at the last position, in float64: ``[prompt]``."""
    cand = logits[:, -1].double().gather(1, batch.cand_first_token)  # [prompt, cand]
    gold = cand[torch.arange(len(batch)), batch.gold]
    return gold - (cand.sum(1) - gold) / (cand.shape[1] - 1)


def _scaled_run(lm: LoadedModel, batch, head: HeadId, scale: float) -> torch.Tensor:
    """Logit difference with ``head``'s out-projection input multiplied by ``scale`` at every real token."""
    group = lm.inventory.group(head.layer, head.kind)
    real = batch.attention_mask.bool()  # [prompt, pos]

    def edit(x: torch.Tensor) -> torch.Tensor:  # [prompt, pos, in]
        factor = torch.ones_like(x)
        factor[..., group.columns(head.index)] = torch.where(real[..., None], scale, 1.0)
        return x * factor

    with torch.no_grad(), Intervener(lm.adapter).run(PassConfig(proj_edits={(head.layer, head.kind): edit})):
        return _logit_diff(lm.model(**model_inputs(lm.model, batch)).logits, batch)


def _exact(lm: LoadedModel, batch, heads, method: str) -> torch.Tensor:
    engine = AblationEngine(lm, batch)
    return engine.effects(single_head_ablations(heads, method)).logit_diff  # [head, prompt]


# -- rank agreement ---------------------------------------------------------------------------------

def test_rank_agreement_hand_computed():
    # ranks 1,2,3,4 vs 1,3,2,4: d^2 = 2, spearman = 1 - 6*2/(4*15) = 0.8
    got = rank_agreement(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 3.0, 2.0, 4.0]), k=2)
    assert got["spearman"] == pytest.approx(0.8)
    # top-2 by |exact| = {3, 1}, by |estimate| = {3, 2}: one of two recovered
    assert got["recall_at_k"] == pytest.approx(0.5) and got["k"] == 2
    # signs: |.| ranks 4,2,1,3 vs 4,1,2,3 -> 0.8; the top two magnitudes agree
    got = rank_agreement(torch.tensor([-5.0, 1.0, 0.5, 2.0]), torch.tensor([-4.0, 0.1, 1.0, 3.0]), k=2)
    assert got["spearman"] == pytest.approx(0.8) and got["spearman_abs"] == pytest.approx(0.8)
    assert got["recall_at_k"] == 1.0
    # ties take the average rank: ranks 1.5,1.5,3 vs 1,2,3 -> 1.5 / sqrt(1.5 * 2) = 0.866
    got = rank_agreement(torch.tensor([1.0, 1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0]), k=5)
    assert got["spearman"] == pytest.approx(1.5 / 3**0.5) and got["k"] == 3 and got["recall_at_k"] == 1.0
    assert rank_agreement(torch.ones(3), torch.tensor([1.0, 2.0, 3.0]))["spearman"] is None
    with pytest.raises(ValueError):
        rank_agreement(torch.ones(3), torch.ones(4))


# -- AtP is the derivative of the ablation, on every architecture -----------------------------------

@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_atp_is_the_derivative_along_the_ablation(arch):
    """estimate = d/de metric(x + e (x_ablated - x)) at e = 0, for zero ablation (x_ablated = 0).

    Reference: central differences of the scaled head, Richardson-extrapolated (error O(e^4)), in
    float32: rounding gives ~1e-7 |metric| / e ~ 1e-5, hence the tolerance.
    The QK fix then changes only heads that write straight into the residual stream and have a later
    attention layer.
    """
    lm = load_model(f"tiny:{arch}")
    batch = _batch(lm, 3)
    every = lm.inventory.heads()
    heads = sorted({every[0], every[len(every) // 3], every[2 * len(every) // 3], every[-1]})
    plain = atp_effects(lm, batch, heads=heads, qk_fix=False)

    def central(head, e):
        return (_scaled_run(lm, batch, head, 1 - e) - _scaled_run(lm, batch, head, 1 + e)) / (2 * e)

    derivative = torch.stack([(4 * central(h, 0.025) - central(h, 0.05)) / 3 for h in heads])  # [head, prompt]
    assert derivative.abs().max() > 1e-3  # the heads matter: the check is not 0 == 0
    assert (plain.estimate.double() - derivative).abs().max() <= 1e-3 * derivative.abs().max() + 1e-5
    # measured matmul FLOPs: a forward and a backward (input gradients only: weights are frozen, so it
    # costs about one forward, never more than two)
    assert plain.passes == 2 and 1.5 < plain.forward_equivalents <= 3.0

    fixed = atp_effects(lm, batch, heads=heads, qk_fix=True)
    attn_layers = {g.layer for g in lm.inventory.groups if g.kind == "attn"}
    for i, h in enumerate(heads):
        applies = (lm.adapter.residual_write_scale(h.layer, h.kind) is not None
                   and any(m > h.layer for m in attn_layers))
        if not applies:
            assert torch.equal(fixed.qk_correction[i], torch.zeros_like(fixed.qk_correction[i]))
            assert torch.allclose(fixed.estimate[i], plain.estimate[i], atol=1e-7)
        else:
            assert torch.allclose(fixed.estimate[i], plain.estimate[i] + fixed.qk_correction[i], atol=1e-6)


# -- exact where the model is linear in the ablated quantity ----------------------------------------

def _linear_tail(lm: LoadedModel) -> LoadedModel:
    """A copy whose last layer writes straight into the logits: its MLP silenced, the final norm removed."""
    model = copy.deepcopy(lm.model)
    last = lm.adapter.layers()[-1]
    name = next(n for n in ("mlp", "feed_forward") if hasattr(last, n))
    twin_last = model.get_submodule(lm.adapter.table.layers)[-1]
    with torch.no_grad():
        getattr(twin_last, name).down_proj.weight.zero_()
    parent, _, attr = lm.adapter.table.final_norm.rpartition(".")
    setattr(model.get_submodule(parent), attr, torch.nn.Identity())
    twin = copy.copy(lm)
    twin.model, twin.adapter = model, adapter_for(model)
    return twin


@pytest.mark.parametrize("arch", ["llama", "bamba", "falcon_h1"])
@pytest.mark.parametrize("method", ["zero", "mean"])
def test_exact_when_linear_in_the_ablated_heads(arch, method):
    """Last-layer heads of a transformer and two hybrids (attention in bamba; attention and SSM in
    falcon_h1): with the last MLP silenced and no final norm the metric is linear in their
    out-projection input, so the first-order estimate is the exact effect (float32 rounding only)."""
    lm = _linear_tail(load_model(f"tiny:{arch}"))
    batch = _batch(lm, 4)
    last = lm.inventory.n_layers - 1
    heads = [h for h in lm.inventory.heads() if h.layer == last]
    exact = _exact(lm, batch, heads, method)
    result = atp_effects(lm, batch, heads=heads, method=method)
    assert exact.abs().max() > 1e-4  # (no final norm: the residual stream, and effects, are small)
    print(f"{arch} {method}: max |AtP - exact| {float((result.estimate - exact).abs().max()):.1e}"
          f" on effects up to {float(exact.abs().max()):.1e}")
    assert (result.estimate - exact).abs().max() <= 1e-4 * exact.abs().max()
    assert result.passes <= 4 and result.forward_equivalents <= 4
    assert result.passes == (3 if method == "mean" else 2)


# -- a plain tiny model: the error is the Taylor remainder ------------------------------------------

@pytest.mark.parametrize("method", ["zero", "mean"])
def test_close_to_exact_on_tiny_llama(method):
    """For a random tiny model ablations are small perturbations: relative error under 0.25.

    Why 0.25: the error of a first-order estimate is the curvature term
    S = (f(x + d) + f(x - d) - 2 f(x)) / 2 plus third-order terms; for zero ablation S is measured
    below and is ~0.15 of the effects here, and the error must be mostly S (a wrong gradient would not be).
    """
    lm = load_model("tiny:llama")
    batch = _batch(lm, 8)
    heads = lm.inventory.heads()
    exact = _exact(lm, batch, heads, method)
    result = atp_effects(lm, batch, method=method, qk_fix=False)
    error = exact - result.estimate
    relative = float(error.norm() / exact.norm())
    print(f"tiny llama {method}: relative error {relative:.3f}, "
          f"{rank_agreement(result.estimate.mean(1), exact.mean(1))}")
    assert relative < 0.25
    if method == "zero":  # x - d = 2x
        base = _scaled_run(lm, batch, heads[0], 1.0)
        curvature = torch.stack([(_scaled_run(lm, batch, h, 0.0) + _scaled_run(lm, batch, h, 2.0) - 2 * base) / 2
                                 for h in heads]).float()
        assert float(curvature.norm() / exact.norm()) > 0.05  # the model is not linear: the check has teeth
        assert float((error - curvature).norm()) < 0.5 * float(error.norm())


# -- the QK fix -------------------------------------------------------------------------------------

def _pattern_only_model() -> LoadedModel:
    """Two llama layers in which layer 0's heads reach the metric only through layer 1's attention pattern.

    Layer 0 writes only into residual dims 0..15; layer 1's values and the unembedding ignore those
    dims; both MLPs are silenced; layer 1's input norm and the final norm are removed; layer 1's
    query/key weights are scaled so its softmax saturates. The metric is then exactly linear in
    layer 1's probabilities, with the change of those probabilities the only path, so AtP* (exact
    scores, exact softmax, weighted by dMetric/dA) is exact while plain AtP linearises the softmax.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **{**TINY_CONFIGS["llama"], "num_hidden_layers": 2})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    first, second = model.model.layers
    writes = torch.zeros(config.hidden_size, dtype=torch.bool)
    writes[:16] = True
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(50)
        first.self_attn.o_proj.weight[~writes] = 0
        first.self_attn.o_proj.weight.mul_(300)
        first.mlp.down_proj.weight.zero_()
        second.mlp.down_proj.weight.zero_()
        second.self_attn.v_proj.weight[:, writes] = 0
        second.self_attn.q_proj.weight.mul_(8)
        second.self_attn.k_proj.weight.mul_(8)
        second.self_attn.o_proj.weight.mul_(10)
        model.lm_head.weight[:, writes] = 0
        model.lm_head.weight.mul_(10)
    second.input_layernorm = torch.nn.Identity()
    model.model.norm = torch.nn.Identity()
    return LoadedModel(model, tiny_tokenizer(), adapter_for(model), "test:pattern-only")


@pytest.mark.parametrize("method", ["zero", "mean"])
@pytest.mark.parametrize("query_reads_sources", [False, True])
def test_qk_fix_on_a_model_where_only_a_saturated_pattern_carries_the_effect(method, query_reads_sources):
    """Layer 0 reaches the metric only through layer 1's saturated query-row pattern.

    When layer 1's queries ignore what layer 0 writes, the sources move only the keys, linearly (no
    norm): first-order keys with an exact softmax are then the exact effect, and the fix must be
    exact. When the queries read it too, the fix leaves out the product of the query's and the
    keys' changes (as AtP* does, treating queries and keys as separate nodes): it must still remove
    most of plain AtP's error.
    """
    lm = _pattern_only_model()
    if not query_reads_sources:
        with torch.no_grad():
            lm.model.model.layers[1].self_attn.q_proj.weight[:, :16] = 0
    batch = _batch(lm, 8)
    heads = lm.inventory.heads()
    exact = _exact(lm, batch, heads, method)
    plain = atp_effects(lm, batch, method=method, qk_fix=False)
    fixed = atp_effects(lm, batch, method=method, qk_fix=True)
    first = [i for i, h in enumerate(heads) if h.layer == 0]
    scale = exact[first].abs().max()
    assert scale > 0.05

    def error(result):
        return float((result.estimate[first] - exact[first]).norm() / exact[first].norm())

    assert error(plain) > 0.3  # plain AtP misjudges the saturated path badly
    assert fixed.qk_correction[first].abs().max() > 0.1 * scale
    if query_reads_sources:
        assert error(fixed) < 0.5 * error(plain)
    else:
        assert (fixed.estimate - exact).abs().max() <= 1e-4 * scale
    print(f"pattern-only model ({method}, queries read the sources: {query_reads_sources}): relative error "
          f"plain {error(plain):.3f}, fixed {error(fixed):.2e}; cost {fixed.forward_equivalents:.2f} "
          f"forward-equivalents vs {plain.forward_equivalents:.2f}")


def _tiny(arch: str, **overrides) -> LoadedModel:
    """A tiny model of ``arch`` with config ``overrides``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **{**TINY_CONFIGS[arch], **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    return LoadedModel(model, tiny_tokenizer(), adapter_for(model), f"test:{arch}")


@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}), ("gpt2", {}), ("falcon_h1", {}),
    ("zamba2", {"layers_block_type": ["mamba", "hybrid", "hybrid", "mamba"]}), ("bamba", {}),
])
@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_qk_fix_reproduces_the_clean_query_row(arch, overrides, padding_side, monkeypatch):
    """The fix's plumbing on every architecture whose heads write straight into the residual stream
    (Gemma 2/3 and OLMo 2 normalise the write first: they get plain AtP): its scores (scale, soft-capping,
    masks) give the model's own query-row pattern, and its query pass (the layer's own code run on
    the clean input at the query position, as tokens at that position) gives the clean queries and
    the query position's own key back."""
    from discovery.measure import attribution

    lm = _tiny(arch, **overrides)
    prompts = mc_prompts(3, seed=2)
    batch = annotate(prompts, lm.tokenizer, padding_side=padding_side)
    seen: list[tuple[object, AnnotatedBatch, attribution._Target]] = []
    make_target = attribution._Screen._target

    def spy(self, part, *args):
        target = make_target(self, part, *args)
        seen.append((self, part, target))
        return target

    monkeypatch.setattr(attribution._Screen, "_target", spy)
    atp_effects(lm, batch, qk_fix=True)
    assert seen  # some later attention layer was fixed
    for screen, part, target in seen:
        assert torch.allclose(target.pattern(target.raw), target.probs, atol=1e-5)
        start = target.query_input[:, None].repeat(1, 2, 1)  # two copies of the clean input
        q_new, k_new = screen._query_pass(part, target.layer, start)
        rows = torch.arange(len(part))
        qpos = part.query_pos
        n_rep = q_new.shape[1] // k_new.shape[1]
        raw = target.scale * torch.einsum("nhkd,nhpd->knhp", q_new, target.keys)  # [copy, prompt, head, key]
        assert torch.allclose(raw, target.raw[None].expand_as(raw), atol=1e-4)
        own_key = k_new.repeat_interleave(n_rep, dim=1)[:, :, 0]  # [prompt, head, d_head]
        assert torch.allclose(own_key, target.keys[rows, :, qpos], atol=1e-5)


# -- a trained-ish model: rank agreement, reported ----------------------------------------------------

def test_rank_agreement_on_a_briefly_trained_model():
    """Tiny llama fitted for 60 steps to the gold letter: AtP vs the exact sweep, with and without the fix."""
    lm = load_model("tiny:llama")
    batch = _batch(lm, 16, seed=1)
    model = lm.model
    torch.manual_seed(0)
    optimiser = torch.optim.Adam(model.parameters(), lr=3e-3)
    target = batch.cand_first_token[torch.arange(len(batch)), batch.gold]
    model.train()
    for _ in range(60):
        logits = model(**model_inputs(model, batch)).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, target)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    model.eval()
    engine = AblationEngine(lm, batch)
    assert engine.clean.acc.mean() > 0.5  # it learned something (chance is 0.25)
    heads = lm.inventory.heads()
    for method in ("zero", "mean"):
        exact = engine.effects(single_head_ablations(heads, method)).logit_diff.mean(1)  # [head]
        for qk in (False, True):
            result = atp_effects(lm, batch, method=method, qk_fix=qk)
            agreement = rank_agreement(result.estimate.mean(1), exact, k=3)
            print(f"trained tiny llama, {method}, qk_fix={qk}: {agreement}, "
                  f"{result.forward_equivalents:.1f} forward-equivalents")
            assert agreement["spearman"] is not None and -1.0 <= agreement["spearman"] <= 1.0


# -- results and input errors -----------------------------------------------------------------------

def test_frame_and_bad_input():
    lm = load_model("tiny:llama")
    batch = _batch(lm, 2)
    heads = lm.inventory.heads()[:3]
    result = atp_effects(lm, batch, heads=heads, metric="gold_logprob", qk_fix=False)
    frame = result.frame()
    assert frame.columns == ["layer", "head", "kind", "atp_gold_logprob"]
    assert frame["atp_gold_logprob"].to_list() == pytest.approx(result.estimate.mean(1).tolist())
    assert frame["head"].to_list() == [0, 1, 2]
    for kwargs in ({"method": "knockout"}, {"metric": "acc"}, {"scope": ("nowhere",)},
                   {"heads": [HeadId(99, 0, "attn")]}, {"chunk_prompts": 0}):
        with pytest.raises(GascanError):
            atp_effects(lm, batch, **kwargs)
    # chunking does not change the numbers
    one = atp_effects(lm, batch, heads=heads, chunk_prompts=1)
    assert torch.allclose(one.estimate, atp_effects(lm, batch, heads=heads, chunk_prompts=8).estimate, atol=1e-6)
