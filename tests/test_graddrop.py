"""AtP* GradDrop against a direct computation: the backward rerun with one layer's block held constant."""
from __future__ import annotations

import time

import pytest
import torch

from discovery.heads import HeadId
from discovery.measure.attribution import atp_effects
from discovery.measure.graddrop import graddrop_score, graddrop_screen
from discovery.measure.patterns import model_inputs
from discovery.model.intervene import Intervener, PassConfig, _hidden_of, _with_hidden
from discovery.model.loading import LoadedModel, load_model
from discovery.tasks.base import annotate
from discovery.tasks.scoring import next_token_scores
from tests.helpers import mc_prompts
from tests.test_attribution import one_thread  # noqa: F401  (autouse: tiny models run fastest on one thread)


def _direct(lm: LoadedModel, batch, drop: int | None) -> dict[HeadId, torch.Tensor]:
    """Zero-ablation AtP ``[prompt]`` per head from one forward in which layer ``drop``'s output is
    ``input + (output - input).detach()`` (its block's gradient dropped), and one full backward."""
    layers = lm.adapter.layers()
    xs: dict[tuple[int, str], torch.Tensor] = {}

    def capture(key):
        def edit(x):
            if not x.requires_grad:  # the first captured input is a leaf; later ones stay in the graph
                x = x.detach().requires_grad_(True)
            xs[key] = x
            return x

        return edit

    seen: dict[str, torch.Tensor] = {}
    handles = []
    if drop is not None:
        handles.append(layers[drop].register_forward_pre_hook(
            lambda m, args, kwargs: seen.__setitem__("in", args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True))
        handles.append(layers[drop].register_forward_hook(
            lambda m, args, out: _with_hidden(out, seen["in"] + (_hidden_of(out) - seen["in"]).detach())))
    groups = sorted({(g.layer, g.kind) for g in lm.inventory.groups})
    try:
        with torch.enable_grad(), Intervener(lm.adapter).run(PassConfig(proj_edits={k: capture(k) for k in groups})):
            logits = lm.model(**model_inputs(lm.model, batch)).logits
            total = next_token_scores(logits[:, -1], batch)["logit_diff"].sum()
    finally:
        for h in handles:
            h.remove()
    keys = list(xs)
    real = batch.attention_mask.bool()  # [prompt, pos]: the scope "all" is every real token
    grads = torch.autograd.grad(total, [xs[k] for k in keys], allow_unused=True)
    out = {}
    for key, g in zip(keys, grads, strict=True):
        group = lm.inventory.group(*key)
        x = xs[key].detach()
        g = torch.zeros_like(x) if g is None else g
        per = ((0 - x) * g * real[..., None]).view(len(batch), x.shape[1], group.count, group.width).sum((1, 3))  # [prompt, head]
        for i in range(group.count):
            out[HeadId(key[0], i, key[1])] = per[:, i]
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "mamba2", "zamba2"])
def test_graddrop_matches_the_direct_rerun(arch):
    lm = load_model(f"tiny:{arch}")
    batch = annotate(mc_prompts(6, seed=1), lm.tokenizer, padding_side="left")
    started = time.perf_counter()
    res = graddrop_screen(lm, batch, method="zero", scope=("all",), chunk_prompts=4)
    n_layers = lm.inventory.n_layers
    assert res.dropped.shape == (n_layers, len(res.heads), len(batch))
    full = _direct(lm, batch, None)
    plain = atp_effects(lm, batch, method="zero", scope=("all",), qk_fix=False).estimate
    assert torch.allclose(res.plain, plain, atol=1e-5)
    for i, h in enumerate(res.heads):
        assert torch.allclose(res.plain[i], full[h].float(), atol=1e-5)
    expected = torch.zeros(len(res.heads), len(batch))
    for drop in range(1, n_layers):
        direct = _direct(lm, batch, drop)
        for i, h in enumerate(res.heads):
            if h.layer < drop:
                assert torch.allclose(res.dropped[drop, i], direct[h].float(), atol=1e-5, rtol=1e-4), (h, drop)
                expected[i] += direct[h].abs().float() / (n_layers - 1 - h.layer)
            else:
                assert torch.isnan(res.dropped[drop, i]).all()
    for i, h in enumerate(res.heads):
        if h.layer == n_layers - 1:
            expected[i] = full[h].abs().float()
    assert torch.allclose(res.estimate, expected, atol=1e-5, rtol=1e-4)
    # dropping a layer changes the gradient: GradDrop is not just |AtP|
    assert (res.estimate - res.plain.abs()).abs().max() > 1e-4
    assert res.passes == 2 + (n_layers - 1)
    # one forward, one full backward, L-1 shorter backwards: between 2 and L+1 forward-equivalents
    assert 2.0 < res.forward_equivalents < n_layers + 1
    assert time.perf_counter() - started < 30


def test_graddrop_score_and_options():
    dropped = torch.tensor([[[float("nan")], [float("nan")]], [[-2.0], [float("nan")]], [[1.0], [float("nan")]]])
    plain = torch.tensor([[5.0], [-3.0]])
    assert graddrop_score(dropped, plain).tolist() == [[1.5], [3.0]]
