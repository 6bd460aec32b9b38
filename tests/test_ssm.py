"""Implicit attention of SSM heads reproduces each transformers mixer's own scan, gate and output."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from discovery.errors import GascanError
from discovery.model.ssm import (
    SSMComponents,
    family_of,
    implicit_attention,
    knockout_delta,
    mixer_inputs,
    post_scan,
    scan_output,
    segsum,
    ssm_components,
)
from discovery.model.tiny import TINY_CONFIGS

ARCHS = ["mamba", "falcon_mamba", "jamba", "mamba2", "zamba2", "bamba", "falcon_h1"]
SEQ = 37  # longer than the tiny Mamba-2 chunk (16) and not a multiple of it: exercises the inter-chunk path
TOL = 1e-5


def build(arch: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A tiny model with every 1-D parameter (norm weights, D, dt_bias, conv bias) perturbed so that a
    missed weight, bias or multiplier cannot pass unnoticed."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, **(TINY_CONFIGS[arch] | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    return model


def mixers_of(model: nn.Module) -> dict[str, nn.Module]:
    found = {}
    for name, module in model.named_modules():
        try:
            family_of(module)
        except GascanError:
            continue
        found[name] = module
    return found


def batch(padded: bool, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (2, SEQ), generator=gen)
    if not padded:
        return ids, None
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :5] = 0  # left padding in the second prompt
    ids[1, :5] = 0
    return ids, mask


def capture(
    model: nn.Module,
    mixer: nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor | None,
    monkeypatch: pytest.MonkeyPatch,
) -> dict[str, Any]:
    """Run the model and record, for ``mixer``: its inputs, its own pre-gate scan output, the input
    of its out_proj and its output. The pre-gate value comes from the library's own scan function
    (wrapped in the mixer's module), called exactly as the mixer calls it."""
    rec: dict[str, Any] = {"active": False}
    family = family_of(mixer)
    module = sys.modules[type(mixer).__module__]
    name = "mamba_selective_scan" if family == "mamba1" else "mamba2_chunk_scan"
    original: Callable[..., Any] = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if rec["active"]:  # with a cache (the default) the scan also returns its final state
            if family == "mamba1":  # the same call without the gate is the pre-gate output
                pre = original(*args, **(kwargs | {"z": None, "return_last_state": False}))
                rec["y"] = pre.transpose(1, 2)  # [batch, pos, channel]
            else:
                rec["y"] = (out[0] if isinstance(out, tuple) else out).clone()  # [batch, pos, head, d_head]
        return out

    monkeypatch.setattr(module, name, wrapped)

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        rec["active"] = True
        rec["hidden"], rec["mask"] = mixer_inputs(args, kwargs)

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: torch.Tensor) -> None:
        rec["active"] = False
        rec["out"] = out

    handles = [
        mixer.register_forward_pre_hook(pre, with_kwargs=True),
        mixer.register_forward_hook(post, with_kwargs=True),
        mixer.out_proj.register_forward_pre_hook(lambda mod, args: rec.__setitem__("proj_in", args[0])),
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return rec


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_reproduces_mixer_scan_gate_and_output(
    arch: str, padded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build(arch)
    mixers = mixers_of(model)
    assert len(mixers) >= 2, f"{arch}: expected several SSM mixers, found {list(mixers)}"
    if arch == "zamba2":  # both kinds of mamba layer: plain and inside a hybrid layer
        assert any("mamba_decoder" in n for n in mixers) and any("mamba_decoder" not in n for n in mixers)
    ids, mask = batch(padded)
    for name, mixer in mixers.items():
        rec = capture(model, mixer, ids, mask, monkeypatch)
        if padded:
            assert rec["mask"] is not None, f"{arch} {name}: mixer got no padding mask"
        comp = ssm_components(mixer, rec["hidden"], rec["mask"])
        M = implicit_attention(comp)
        y = scan_output(comp, M)
        assert y.shape == rec["y"].shape
        assert max_err(y, rec["y"]) < TOL, f"{arch} {name}: scan output off by {max_err(y, rec['y']):.2e}"
        assert max_err(scan_output(comp), rec["y"]) < TOL  # the chunked path without a full M
        z = post_scan(mixer, y, comp)
        assert max_err(z, rec["proj_in"]) < TOL, (
            f"{arch} {name}: out_proj input off by {max_err(z, rec['proj_in']):.2e}"
        )
        assert max_err(mixer.out_proj(z), rec["out"]) < TOL
        # the scan is not trivial: M x carries a real share of y, and padded keys are never read
        assert float((y - scan_output(comp, torch.zeros_like(M))).abs().max()) > 1e-3
        if padded:
            assert float(M[1, :, :, :5].abs().max()) == 0.0


@pytest.mark.parametrize("arch", ARCHS)
def test_knockout_delta_equals_zeroed_matrix(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(arch)
    _name, mixer = next(iter(mixers_of(model).items()))
    ids, mask = batch(True)
    rec = capture(model, mixer, ids, mask, monkeypatch)
    comp = ssm_components(mixer, rec["hidden"], rec["mask"])
    M = implicit_attention(comp)
    gen = torch.Generator().manual_seed(7)
    key_mask = torch.rand(2, SEQ, generator=gen) < 0.4
    query_pos = torch.tensor([SEQ - 1, 20])
    delta = knockout_delta(comp, M, query_pos, key_mask)

    cut = M.clone()
    for b, q in enumerate(query_pos.tolist()):
        cut[b, :, q, key_mask[b]] = 0
    expected = scan_output(comp, cut)
    assert max_err(scan_output(comp, M) + delta, expected) < TOL
    assert float(delta.abs().max()) > 1e-3  # the knockout changes something
    other = torch.ones(2, SEQ, dtype=torch.bool)
    other[0, SEQ - 1] = other[1, 20] = False
    assert float(delta[other].abs().max()) == 0.0  # and only at the query positions

    # a subset of units: the same delta on those units, zero on the others
    units = [0, 3] if comp.family == "mamba2" else [1, 5, 6]
    sub = knockout_delta(comp, M[:, units], query_pos, key_mask, heads=units)
    assert max_err(sub[:, :, units], delta[:, :, units]) < 1e-12
    rest = [u for u in range(comp.n_units) if u not in units]
    assert float(sub[:, :, rest].abs().max()) == 0.0

    # bool query mask gives the same answer as integer positions
    qmask = ~other
    assert max_err(knockout_delta(comp, M, qmask, key_mask), delta) == 0.0
    # without M only the query rows are computed, with the same result
    assert max_err(knockout_delta(comp, None, query_pos, key_mask), delta) < 1e-7
    assert max_err(knockout_delta(comp, None, query_pos, key_mask, heads=units), sub) < 1e-7


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_mamba1_channel_groups_chunks_and_causality(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(arch)
    mixer = next(iter(mixers_of(model).values()))
    rec = capture(model, mixer, *batch(False), monkeypatch)
    comp = ssm_components(mixer, rec["hidden"], rec["mask"])
    n_channels = comp.n_units
    per_channel = implicit_attention(comp)  # [batch, channel, q, k]
    assert per_channel.shape == (2, n_channels, SEQ, SEQ)
    upper = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    assert float(per_channel[..., upper].abs().max()) == 0.0
    assert float(per_channel[..., ~upper].abs().max()) > 1e-3

    grouped = implicit_attention(comp, channel_group=8)  # [batch, group, q, k]
    assert grouped.shape == (2, n_channels // 8, SEQ, SEQ)
    expected = per_channel.reshape(2, n_channels // 8, 8, SEQ, SEQ).mean(2)
    assert max_err(grouped, expected) < 1e-6

    tiny_budget = 5 * 2 * SEQ * SEQ * 4 * 10  # ten channels per block: uneven chunks that split groups
    assert max_err(implicit_attention(comp, channel_group=8, memory_budget=tiny_budget), grouped) < 1e-6
    assert max_err(scan_output(comp, memory_budget=tiny_budget), scan_output(comp, per_channel)) < 1e-6

    assert max_err(implicit_attention(comp, channels=slice(8, 24)), per_channel[:, 8:24]) == 0.0
    assert max_err(implicit_attention(comp, channels=slice(8, 24), channel_group=8), grouped[:, 1:3]) < 1e-6
    assert max_err(implicit_attention(comp, [5, 2], channel_group=8), grouped[:, [5, 2]]) < 1e-6
    rows = implicit_attention(comp, channel_group=8, rows=[-1, 4], memory_budget=5 * 2 * 2 * SEQ * 4 * 10)
    assert max_err(rows, grouped[:, :, [SEQ - 1, 4]]) < 1e-6
    with pytest.raises(GascanError, match="divide"):
        implicit_attention(comp, channel_group=7)
    with pytest.raises(GascanError, match="aligned"):
        implicit_attention(comp, channels=slice(3, 24), channel_group=8)


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_mamba2_head_selection(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build(arch)
    mixer = next(iter(mixers_of(model).values()))
    rec = capture(model, mixer, *batch(False), monkeypatch)
    comp = ssm_components(mixer, rec["hidden"], rec["mask"])
    full = implicit_attention(comp)
    assert full.shape == (2, comp.n_units, SEQ, SEQ)
    assert max_err(implicit_attention(comp, [6, 1]), full[:, [6, 1]]) == 0.0
    assert (
        max_err(implicit_attention(comp, [6, 1], rows=[-1, 0, 20]), full[:, [6, 1]][:, :, [SEQ - 1, 0, 20]])
        < 1e-7
    )
    upper = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    assert float(full[..., upper].abs().max()) == 0.0
    with pytest.raises(GascanError, match="out of range"):
        implicit_attention(comp, [comp.n_units])
    with pytest.raises(GascanError, match="Mamba-1 only"):
        implicit_attention(comp, channel_group=2)
    with pytest.raises(GascanError, match="expected"):
        scan_output(comp, full[:, :2])


@pytest.mark.parametrize(
    "overrides",
    [
        {"mamba_rms_norm": True, "mamba_norm_before_gate": False},
        {"mamba_rms_norm": True, "mamba_norm_before_gate": True},
        {"mamba_rms_norm": False},
    ],
    ids=["norm_after_gate", "norm_before_gate", "no_norm"],
)
def test_falcon_h1_multipliers_and_norm_variants(overrides: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    model = build("falcon_h1", ssm_multipliers=[0.5, 1.7, 0.8, 1.3, 0.6], ssm_in_multiplier=1.9, **overrides)
    mixer = model.model.layers[1].mamba
    rec = capture(model, mixer, *batch(True), monkeypatch)
    comp = ssm_components(mixer, rec["hidden"], rec["mask"])
    y = scan_output(comp, implicit_attention(comp))
    assert max_err(y, rec["y"]) < TOL
    assert max_err(post_scan(mixer, y, comp), rec["proj_in"]) < TOL


@pytest.mark.parametrize("arch", ["falcon_mamba", "zamba2"])
def test_float64_working_precision(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dtype=float64 scores a float32 model in float64 (weights cast, not edited) and agrees with the
    mixer's own float32 scan. (The library itself runs its scans in float32 even for a float64
    model, so float64 is checked against it only to float32 precision.)"""
    model = build(arch)
    mixer = next(iter(mixers_of(model).values()))
    rec = capture(model, mixer, *batch(True), monkeypatch)
    before = {k: v.clone() for k, v in mixer.state_dict().items()}
    comp64 = ssm_components(mixer, rec["hidden"], rec["mask"], dtype=torch.float64)
    assert comp64.x.dtype == comp64.A.dtype == comp64.dt.dtype == torch.float64
    M64 = implicit_attention(comp64)
    assert M64.dtype == torch.float64
    y64 = scan_output(comp64, M64)
    assert max_err(y64, rec["y"]) < TOL
    assert max_err(post_scan(mixer, y64, comp64), rec["proj_in"]) < TOL
    comp32 = ssm_components(mixer, rec["hidden"], rec["mask"])
    assert comp32.x.dtype == torch.float32
    assert 0 < max_err(implicit_attention(comp32), M64) < 1e-5
    assert all(torch.equal(v, mixer.state_dict()[k]) for k, v in before.items())


def test_segsum_is_stable_where_prefix_differences_are_not() -> None:
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(1500, generator=gen, dtype=torch.float64) * 100  # prefix sums reach ~7.5e4
    truth = segsum(values)
    t, s = torch.tril_indices(1500, 1500)
    exact = torch.stack([values[s[i] + 1 : t[i] + 1].sum() for i in range(0, len(t), 9973)])
    assert max_err(truth[t[::9973], s[::9973]], exact) < 1e-9

    ours = segsum(values.float()).double()
    near = (t - s) <= 3  # short spans: the decays that matter most
    rel = ((ours[t, s] - truth[t, s]).abs() / truth[t, s].clamp_min(1e-3))[near]
    assert float(rel.max()) < 1e-5
    prefix = torch.cumsum(values.float(), 0).double()
    naive = (prefix[t] - prefix[s])[near]
    assert float(((naive - truth[t, s][near]).abs() / truth[t, s][near].clamp_min(1e-3)).max()) > 1e-3


def test_mamba2_matrix_matches_explicit_recurrence() -> None:
    """M from the closed form equals the matrix read off a step-by-step recurrence (random components)."""
    gen = torch.Generator().manual_seed(1)
    b, T, H, P, N = 2, 9, 3, 2, 4
    comp = SSMComponents(
        "mamba2",
        x=torch.randn(b, T, H, P, generator=gen, dtype=torch.float64),
        B=torch.randn(b, T, H, N, generator=gen, dtype=torch.float64),
        C=torch.randn(b, T, H, N, generator=gen, dtype=torch.float64),
        dt=torch.rand(b, T, H, generator=gen, dtype=torch.float64),
        A=-torch.rand(H, generator=gen, dtype=torch.float64) * 3,
        D=torch.randn(H, generator=gen, dtype=torch.float64),
        gate=torch.randn(b, T, H * P, generator=gen, dtype=torch.float64),
    )
    state = torch.zeros(b, H, P, N, dtype=torch.float64)
    ys = []
    for t in range(T):
        decay = torch.exp(comp.dt[:, t] * comp.A)  # [b, H]
        state = state * decay[..., None, None] + (
            comp.dt[:, t, :, None, None] * comp.x[:, t, :, :, None] * comp.B[:, t, :, None, :]
        )
        ys.append(torch.einsum("bhpn,bhn->bhp", state, comp.C[:, t]) + comp.D[:, None] * comp.x[:, t])
    assert max_err(scan_output(comp, implicit_attention(comp)), torch.stack(ys, 1)) < 1e-12


def test_family_of_and_mixer_inputs() -> None:
    with pytest.raises(GascanError, match="not a supported SSM mixer"):
        family_of(nn.Linear(2, 2))
    h, m = torch.zeros(1, 2, 3), torch.ones(1, 2)
    assert mixer_inputs((h,), {"attention_mask": m, "cache": None}) == (h, m)
    assert mixer_inputs((), {"hidden_states": h}) == (h, None)
    assert mixer_inputs((h, None, m), {}) == (h, m)
    model = build("mamba")
    with pytest.raises(GascanError, match="attention_mask must be"):
        ssm_components(model.backbone.layers[0].mixer, torch.zeros(1, 4, 64), torch.ones(1, 1, 4, 4))
