"""Exact implicit attention of SSM heads (Mamba-1 channels, Mamba-2 heads) in transformers' mixers.

A selective SSM with zero initial state is a causal linear map of its (post-conv) input ``x``:
``y = M x + D x``. Mamba-2 has one ``[query, key]`` matrix per head,
``M[t, s] = (C_t . B_s) exp(sum_{k=s+1..t} dt_k A) dt_s``; Mamba-1 one per channel, with a per-state
decay summed over the state. These matrices are the SSM heads' *patterns*, and because they
reproduce the mixer's own scan output they also give exact key knockouts (``knockout_delta``).

transformers 5.x mixers call ``conv1d``/``dt_proj`` as functions, so hooks on those submodules never
fire: everything here is recomputed from the mixer's *input* (capture it with a forward pre-hook,
see ``mixer_inputs``) and the mixer's own weights, read but never modified (Zamba2 shares weights
across layers). This follows each mixer's pure-PyTorch path for a full sequence with no cache
(no initial state), which is how prompts are scored.

Supported mixers (transformers 5.24): MambaMixer, FalconMambaMixer, JambaMambaMixer (``"mamba1"``);
Mamba2Mixer, Zamba2MambaMixer, BambaMixer, FalconH1Mixer (``"mamba2"``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from discovery.errors import GascanError

Family = Literal["mamba1", "mamba2"]

MAMBA1_MIXERS: frozenset[str] = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer"})
MAMBA2_MIXERS: frozenset[str] = frozenset({"Mamba2Mixer", "Zamba2MambaMixer", "BambaMixer", "FalconH1Mixer"})

# Working memory (bytes) for one block of per-channel Mamba-1 matrices; blocks are chunked to fit.
DEFAULT_MEMORY_BUDGET = 1 << 28


@dataclass
class SSMComponents:
    """Everything the scan needs, per token, recomputed from a mixer's input and weights."""

    family: str  # "mamba1" | "mamba2"
    x: Tensor  # mamba2: [batch, pos, head, d_head]; mamba1: [batch, pos, channel]  (post conv+act, masked)
    B: Tensor  # mamba2: [batch, pos, head, d_state] (groups expanded to heads); mamba1: [batch, pos, d_state]
    C: Tensor  # same layout as B
    dt: Tensor  # mamba2: [batch, pos, head]; mamba1: [batch, pos, channel]  (after bias, softplus, clamp)
    A: Tensor  # mamba2: [head]; mamba1: [channel, d_state]  (negative)
    D: Tensor  # mamba2: [head]; mamba1: [channel]
    gate: Tensor  # z, the gate branch (pre-activation), [batch, pos, inner]

    @property
    def n_units(self) -> int:
        """Heads (mamba2) or channels (mamba1)."""
        return int(self.dt.shape[-1])

    @property
    def seq_len(self) -> int:
        return int(self.x.shape[1])


# --------------------------------------------------------------------------------------------- family


def family_of(mixer: nn.Module) -> Family:
    """``"mamba1"`` or ``"mamba2"`` for a supported transformers mixer (or a subclass of one)."""
    names = {cls.__name__ for cls in type(mixer).__mro__}
    if names & MAMBA1_MIXERS:
        return "mamba1"
    if names & MAMBA2_MIXERS:
        return "mamba2"
    known = ", ".join(sorted(MAMBA1_MIXERS | MAMBA2_MIXERS))
    raise GascanError(
        f"{type(mixer).__name__} is not a supported SSM mixer",
        f"pass one of the mixer modules {known} (e.g. backbone.layers[i].mixer, model.layers[i].mamba)",
    )


def mixer_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, Tensor | None]:
    """``(hidden_states, attention_mask)`` from a mixer's forward pre-hook (``with_kwargs=True``).

    Mixers are called as ``mixer(hidden_states, cache=None, attention_mask=None, **kwargs)``, with
    the arguments positional or by name depending on the model.
    """
    hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if "attention_mask" in kwargs:
        mask = kwargs["attention_mask"]
    else:
        mask = args[2] if len(args) > 2 else None
    return hidden, mask


# ----------------------------------------------------------------------------------------- components


def _compute_dtype(hidden_states: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return hidden_states.dtype if hidden_states.dtype in (torch.float32, torch.float64) else torch.float32


def _mask_padding(hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Zero padded positions the way the mixers do: ``hidden * mask[:, :, None]``."""
    if attention_mask is None:
        return hidden
    return hidden * attention_mask[:, :, None].to(hidden.dtype)


def _causal_conv(mixer: nn.Module, xbc: Tensor) -> Tensor:
    """The mixer's depthwise causal conv + activation. ``xbc`` [batch, pos, conv_dim] -> same shape."""
    from transformers.activations import ACT2FN

    weight = mixer.conv1d.weight.to(xbc.dtype)  # [conv_dim, 1, kernel]
    bias = None if mixer.conv1d.bias is None else mixer.conv1d.bias.to(xbc.dtype)
    seq_len = xbc.shape[1]
    out = F.conv1d(xbc.transpose(1, 2), weight, bias, padding=weight.shape[-1] - 1, groups=weight.shape[0])
    out = out[:, :, :seq_len]  # [batch, conv_dim, pos]
    return ACT2FN[mixer.activation](out).transpose(1, 2)


def _rms(x: Tensor, eps: float) -> Tensor:
    """RMS normalisation over the last dim, at least in float32 (the mixers normalise in float32)."""
    work = x if x.dtype == torch.float64 else x.float()
    return (work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _norm_eps(norm: nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if eps is None:
        raise GascanError(f"cannot find the epsilon of {type(norm).__name__}", "report this mixer version")
    return float(eps)


def _apply_rms_module(norm: nn.Module, x: Tensor) -> Tensor:
    """Functional copy of a mixer's dt/B/C RMS norm (Jamba: weighted; Falcon-Mamba: weightless)."""
    y = _rms(x, _norm_eps(norm))
    if "Weightless" in type(norm).__name__:
        return y
    return norm.weight.to(x.dtype) * y


def ssm_components(
    mixer: nn.Module,
    hidden_states: Tensor,
    attention_mask: Tensor | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> SSMComponents:
    """Recompute ``x, B, C, dt, A, D, z`` of ``mixer`` for its input ``hidden_states`` [batch, pos, hidden].

    ``attention_mask`` is the 2D ``[batch, pos]`` padding mask the mixer received (``None`` when
    unpadded); it zeroes padded positions before ``in_proj`` and again after the conv, as the
    mixers do. ``dtype`` is the working precision: float32 by default (float64 when the input is
    float64); pass ``torch.float64`` for a reference computation. Weights are cast, never modified.
    """
    family = family_of(mixer)
    if hidden_states.ndim != 3:
        raise GascanError(
            f"hidden_states must be [batch, pos, hidden], got shape {tuple(hidden_states.shape)}",
            "pass the mixer's input as captured by a forward pre-hook",
        )
    if attention_mask is not None and (
        attention_mask.ndim != 2 or attention_mask.shape != hidden_states.shape[:2]
    ):
        raise GascanError(
            f"attention_mask must be the 2D [batch, pos] padding mask {tuple(hidden_states.shape[:2])}, "
            f"got shape {tuple(attention_mask.shape)}",
            "pass the mask the mixer itself received (mixer_inputs) or None",
        )
    work = _compute_dtype(hidden_states, dtype)
    with torch.no_grad():
        h = _mask_padding(hidden_states.to(work), attention_mask)
        if family == "mamba1":
            return _mamba1_components(mixer, h, attention_mask)
        return _mamba2_components(mixer, h, attention_mask)


def _linear(module: nn.Linear, x: Tensor) -> Tensor:
    bias = None if module.bias is None else module.bias.to(x.dtype)
    return F.linear(x, module.weight.to(x.dtype), bias)


def _mamba1_components(mixer: nn.Module, h: Tensor, attention_mask: Tensor | None) -> SSMComponents:
    """MambaMixer / FalconMambaMixer / JambaMambaMixer, following their ``forward`` (no cache)."""
    projected = _linear(mixer.in_proj, h)  # [batch, pos, 2 * inner]
    x, gate = projected.chunk(2, dim=-1)  # [batch, pos, inner] each
    x = _mask_padding(_causal_conv(mixer, x), attention_mask)  # [batch, pos, channel]
    rank, n_state = int(mixer.time_step_rank), int(mixer.ssm_state_size)
    time_step, B, C = torch.split(_linear(mixer.x_proj, x), [rank, n_state, n_state], dim=-1)
    if hasattr(mixer, "b_layernorm"):  # Falcon-Mamba (weightless) and Jamba (weighted) norms
        time_step = _apply_rms_module(mixer.dt_layernorm, time_step)
        B = _apply_rms_module(mixer.b_layernorm, B)
        C = _apply_rms_module(mixer.c_layernorm, C)
    dt = _linear(mixer.dt_proj, time_step)  # [batch, pos, channel]  weight @ ts + bias
    dt = F.softplus(dt)
    A = -torch.exp(mixer.A_log.to(h.dtype))  # [channel, d_state]
    D = mixer.D.to(h.dtype)  # [channel]
    return SSMComponents("mamba1", x, B, C, dt, A, D, gate)


def _mamba2_components(mixer: nn.Module, h: Tensor, attention_mask: Tensor | None) -> SSMComponents:
    """Mamba2Mixer / Zamba2MambaMixer / BambaMixer / FalconH1Mixer, following their ``forward``."""
    n_heads, d_head = int(mixer.num_heads), int(mixer.head_dim)
    inner, n_groups, n_state = int(mixer.intermediate_size), int(mixer.n_groups), int(mixer.ssm_state_size)
    if n_heads * d_head != inner or n_heads % n_groups:
        raise GascanError(
            f"{type(mixer).__name__}: {n_heads} heads x {d_head} != inner size {inner} or groups {n_groups} "
            "do not divide heads",
            "check the model config (mamba heads, head dim, groups)",
        )
    if hasattr(mixer, "ssm_in_multiplier"):  # Falcon-H1: input scale before in_proj
        h = h * mixer.ssm_in_multiplier
    projected = _linear(mixer.in_proj, h)  # [batch, pos, inner + conv_dim + head]
    if getattr(mixer, "mup_vector", None) is not None:  # Falcon-H1: muP multipliers on z, x, B, C, dt
        projected = projected * mixer.mup_vector.to(projected.dtype)
    gate, xbc, dt = projected.split([inner, inner + 2 * n_groups * n_state, n_heads], dim=-1)
    xbc = _mask_padding(_causal_conv(mixer, xbc), attention_mask)
    x, B, C = torch.split(xbc, [inner, n_groups * n_state, n_groups * n_state], dim=-1)
    batch, seq_len = x.shape[:2]
    dt = F.softplus(dt + mixer.dt_bias.to(dt.dtype))  # [batch, pos, head]
    low, high = mixer.time_step_limit
    dt = torch.clamp(dt, min=low, max=high)
    per_group = n_heads // n_groups
    # groups expanded to heads: [batch, pos, head, n]
    B = B.reshape(batch, seq_len, n_groups, n_state).repeat_interleave(per_group, dim=2)
    C = C.reshape(batch, seq_len, n_groups, n_state).repeat_interleave(per_group, dim=2)
    A = -torch.exp(mixer.A_log.to(h.dtype))  # [head]
    D = mixer.D.to(h.dtype)  # [head]
    return SSMComponents("mamba2", x.reshape(batch, seq_len, n_heads, d_head), B, C, dt, A, D, gate)


# ---------------------------------------------------------------------------------- implicit attention


def segsum(values: Tensor, rows: Tensor | None = None) -> Tensor:
    """``out[..., r, s] = sum_{k=s+1..t} values[..., k]``, ``t = rows[r]``, for ``s <= t``; 0 for ``s > t``.

    The log-decay between key ``s`` and query ``t``. Each row is a suffix sum accumulated backwards
    from its query (never a difference of prefix sums), so long sequences do not lose the small
    decays next to the query to cancellation. ``values`` [..., pos] -> [..., rows, pos]; ``rows``
    (long [rows]) defaults to every position (a [pos, pos] lower-triangular matrix).
    """
    seq_len = values.shape[-1]
    if rows is None:
        rows = torch.arange(seq_len, device=values.device)
    keys = torch.arange(seq_len, device=values.device)
    upto = keys[None, :] <= rows[:, None]  # [rows, pos]: k <= t
    masked = values[..., None, :] * upto.to(values.dtype)  # [..., rows, pos]
    suffix = masked.flip(-1).cumsum(-1).flip(-1)  # [..., rows, j] = sum_{j <= k <= t}
    return F.pad(suffix[..., 1:], (0, 1))  # [..., rows, s] = sum_{s < k <= t}; 0 past the query


def _rows(rows: Sequence[int] | Tensor | None, seq_len: int, device: torch.device) -> Tensor:
    """Query rows as a long tensor (negative positions count from the end); all rows when ``None``."""
    if rows is None:
        return torch.arange(seq_len, device=device)
    out = torch.as_tensor(rows, device=device).reshape(-1)
    if out.is_floating_point() or out.dtype == torch.bool:
        raise GascanError(
            f"rows must be integer query positions, got {out.dtype}",
            "pass e.g. rows=[-1] for the final token",
        )
    if bool(((out < -seq_len) | (out >= seq_len)).any()):
        raise GascanError(
            f"a query row is out of range for {seq_len} tokens", f"use rows in -{seq_len}..{seq_len - 1}"
        )
    return out.long() % seq_len


def _mamba2_matrix(comp: SSMComponents, heads: list[int], rows: Tensor) -> Tensor:
    """Mamba-2 matrices for ``heads`` and query ``rows``: [batch, len(heads), len(rows), k]."""
    idx = torch.tensor(heads, dtype=torch.long, device=comp.x.device)
    B = comp.B.index_select(2, idx)  # [batch, pos, h, n]
    C = comp.C.index_select(2, idx).index_select(1, rows)  # [batch, rows, h, n]
    dt = comp.dt.index_select(2, idx).transpose(1, 2)  # [batch, h, pos]
    A = comp.A.index_select(0, idx)  # [h]
    scores = torch.einsum("bthn,bshn->bhts", C, B)  # [batch, h, rows, k]
    decay = torch.exp(segsum(dt, rows) * A[None, :, None, None])  # [batch, h, rows, k]
    M = scores * decay * dt[:, :, None, :]
    return M.masked_fill(~_causal_rows(rows, comp.seq_len), 0)


def _causal_rows(rows: Tensor, seq_len: int) -> Tensor:
    return torch.arange(seq_len, device=rows.device)[None, :] <= rows[:, None]  # [rows, k]


def _mamba1_block(comp: SSMComponents, channels: Tensor, rows: Tensor) -> Tensor:
    """Per-channel Mamba-1 matrices for ``channels`` (long [c]) and query ``rows``: [batch, c, rows, k]."""
    dt = comp.dt.index_select(2, channels).transpose(1, 2)  # [batch, c, pos]
    A = comp.A.index_select(0, channels)  # [c, n]
    C = comp.C.index_select(1, rows)  # [batch, rows, n]
    summed = segsum(dt, rows)  # [batch, c, rows, k]
    M = torch.zeros_like(summed)
    for n in range(comp.B.shape[-1]):  # one state at a time keeps memory at a few [batch, c, rows, k]
        cb = C[:, :, n, None] * comp.B[:, None, :, n]  # [batch, rows, k]
        M += cb[:, None] * torch.exp(summed * A[None, :, n, None, None])
    M *= dt[:, :, None, :]
    return M.masked_fill(~_causal_rows(rows, comp.seq_len), 0)


def _mamba1_blocks(
    comp: SSMComponents, channels: Tensor, rows: Tensor, memory_budget: int
) -> Iterator[tuple[int, Tensor]]:
    """``(offset into channels, block [batch, c, rows, k])`` over ``channels`` in memory-bounded chunks."""
    batch, seq_len = comp.x.shape[:2]
    per_channel = 5 * batch * rows.numel() * seq_len * comp.x.element_size()  # segsum, exp, product, M
    step = max(1, memory_budget // max(per_channel, 1))
    for start in range(0, channels.numel(), step):
        yield start, _mamba1_block(comp, channels[start : start + step], rows)


def _check_units(indices: Sequence[int], count: int, what: str) -> list[int]:
    out = [int(i) for i in indices]
    bad = [i for i in out if not 0 <= i < count]
    if bad:
        raise GascanError(
            f"{what} index {bad[0]} is out of range (there are {count})", f"use {what} 0..{count - 1}"
        )
    return out


def _mamba1_selection(
    comp: SSMComponents, heads: Sequence[int] | None, channel_group: int | None, channels: slice | None
) -> tuple[Tensor, Tensor, int]:
    """Channels to compute, the output unit of each, and the group width (1 = per channel)."""
    n_channels = comp.n_units
    width = 1 if channel_group is None else int(channel_group)
    if width < 1 or n_channels % width:
        raise GascanError(
            f"channel_group={channel_group} does not divide the {n_channels} Mamba-1 channels",
            "use a group width that divides the channel count",
        )
    if heads is not None and channels is not None:
        raise GascanError(
            "give heads or channels, not both", "select units with heads= or a channel slice with channels="
        )
    n_units = n_channels // width
    if channels is not None:
        start, stop, step = channels.indices(n_channels)
        if step != 1 or start % width or stop % width:
            raise GascanError(
                f"channels slice {channels} must be contiguous and aligned to channel_group={width}",
                f"use a slice whose start and stop are multiples of {width}",
            )
        units = list(range(start // width, stop // width))
    else:
        units = _check_units(
            range(n_units) if heads is None else heads, n_units, "channel group" if width > 1 else "channel"
        )
    device = comp.x.device
    unit_t = torch.tensor(units, dtype=torch.long, device=device)
    chan = (unit_t[:, None] * width + torch.arange(width, device=device)[None, :]).reshape(-1)
    owner = torch.arange(len(units), device=device).repeat_interleave(width)
    return chan, owner, width


def implicit_attention(
    comp: SSMComponents,
    heads: Sequence[int] | None = None,
    *,
    channel_group: int | None = None,
    channels: slice | None = None,
    rows: Sequence[int] | Tensor | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """The SSM heads' ``[query, key]`` matrices, causal (0 above the diagonal), ``D`` excluded.

    Mamba-2: ``[batch, head, q, k]`` for ``heads`` (default all). Mamba-1: per channel
    ``[batch, channel, q, k]``; with ``channel_group=w`` the mean over each group of ``w``
    contiguous channels, ``[batch, group, q, k]``. For Mamba-1, ``heads`` are channel (or group)
    indices and ``channels`` a contiguous channel slice (aligned to the group width); the work is
    chunked over channels to stay within ``memory_budget`` bytes. ``rows`` keeps only those query
    positions (e.g. ``[-1]``: the final token), ``q = len(rows)``, at a fraction of the cost.
    """
    with torch.no_grad():
        query_rows = _rows(rows, comp.seq_len, comp.x.device)
        if comp.family == "mamba2":
            if channel_group is not None or channels is not None:
                raise GascanError(
                    "channel_group and channels apply to Mamba-1 only", "select Mamba-2 heads with heads="
                )
            units = _check_units(range(comp.n_units) if heads is None else heads, comp.n_units, "head")
            return _mamba2_matrix(comp, units, query_rows)
        chan, owner, width = _mamba1_selection(comp, heads, channel_group, channels)
        n_out = int(owner[-1]) + 1 if owner.numel() else 0
        # [batch, unit, q, k]
        out = comp.x.new_zeros(comp.x.shape[0], n_out, query_rows.numel(), comp.seq_len)
        for start, block in _mamba1_blocks(comp, chan, query_rows, memory_budget):
            out.index_add_(1, owner[start : start + block.shape[1]], block)
        return out / width if width > 1 else out


def span_attention(
    comp: SSMComponents,
    spans: Sequence[tuple[int, int]],
    *,
    rows: Sequence[int] | Tensor | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """Mamba-1: the mean per-channel matrix of each channel range ``[start, end)`` of ``spans`` (ranges may
    overlap and need no alignment), ``[batch, span, q, k]``: the pattern of a refined channel head."""
    if comp.family != "mamba1":
        raise GascanError("channel spans apply to Mamba-1 only", "select Mamba-2 heads with heads=")
    with torch.no_grad():
        device = comp.x.device
        for start, end in spans:
            _check_units([start, end - 1], comp.n_units, "channel")
            if end <= start:
                raise GascanError(f"empty channel span {start}:{end}", "give spans with start < end")
        query_rows = _rows(rows, comp.seq_len, device)
        out = comp.x.new_zeros(comp.x.shape[0], len(spans), query_rows.numel(), comp.seq_len)
        if not spans:
            return out
        chan = torch.cat([torch.arange(s, e, device=device) for s, e in spans])
        owner = torch.cat([torch.full((e - s,), i, device=device) for i, (s, e) in enumerate(spans)])
        for start, block in _mamba1_blocks(comp, chan, query_rows, memory_budget):
            out.index_add_(1, owner[start : start + block.shape[1]], block)
        sizes = torch.tensor([e - s for s, e in spans], dtype=out.dtype, device=device)
        return out / sizes[None, :, None, None]


def scan_output(
    comp: SSMComponents, M: Tensor | None = None, *, memory_budget: int = DEFAULT_MEMORY_BUDGET
) -> Tensor:
    """The pre-gate scan output ``y = M x + D x``.

    ``M`` is the full per-unit matrix (every Mamba-2 head, or every Mamba-1 channel); when ``None``
    it is computed (for Mamba-1 in channel chunks, never whole). Returns mamba2
    [batch, pos, head, d_head], mamba1 [batch, pos, channel].
    """
    with torch.no_grad():
        skip = comp.x * (comp.D[:, None] if comp.family == "mamba2" else comp.D)  # D x, y's layout
        if M is not None:
            _check_full(comp, M)
            return _apply(comp, M.to(comp.x.dtype), None) + skip
        every = torch.arange(comp.seq_len, device=comp.x.device)
        if comp.family == "mamba2":
            return _apply(comp, _mamba2_matrix(comp, list(range(comp.n_units)), every), None) + skip
        y = torch.empty_like(comp.x)  # [batch, pos, channel]
        chan = torch.arange(comp.n_units, device=comp.x.device)
        for start, block in _mamba1_blocks(comp, chan, every, memory_budget):
            cols = slice(start, start + block.shape[1])
            y[:, :, cols] = torch.einsum("bcts,bsc->btc", block, comp.x[:, :, cols])
        return y + skip


def _check_full(comp: SSMComponents, M: Tensor) -> None:
    batch, seq_len = comp.x.shape[:2]
    want = (batch, comp.n_units, seq_len, seq_len)
    if tuple(M.shape) != want:
        raise GascanError(
            f"M has shape {tuple(M.shape)}, expected {want} "
            f"(every {'head' if comp.family == 'mamba2' else 'channel'})",
            "pass implicit_attention(comp) with no head selection, grouping or rows",
        )


def _apply(comp: SSMComponents, M: Tensor, units: Tensor | None) -> Tensor:
    """``M x`` ([batch, unit, q, k] against the units' keys), in the units' own y layout, q rows."""
    x = comp.x if units is None else comp.x.index_select(2, units)
    if comp.family == "mamba2":
        return torch.einsum("bhts,bshp->bthp", M, x)  # [batch, q, h, d_head]
    return torch.einsum("bcts,bsc->btc", M, x)  # [batch, q, c]


def post_scan(mixer: nn.Module, y: Tensor, comp: SSMComponents) -> Tensor:
    """The mixer's own path from the pre-gate scan output ``y`` to the input of ``out_proj``.

    Mamba-1: ``y * silu(z)``. Mamba-2 family: the gated RMSNorm (gate before the grouped norm;
    Falcon-H1 may normalise before gating, or have no norm and just gate). Returns
    [batch, pos, inner] in ``y``'s dtype (at least float32). Falcon-H1's ``ssm_out_multiplier`` is
    applied by the decoder layer after ``out_proj``, outside this path.
    """
    batch, seq_len = y.shape[:2]
    y = y.reshape(batch, seq_len, -1)  # [batch, pos, inner]
    work = y.dtype if y.dtype == torch.float64 else torch.float32
    y = y.to(work)
    gate = F.silu(comp.gate.to(work))  # [batch, pos, inner]
    if comp.family == "mamba1":
        return y * gate
    norm = mixer.norm
    if isinstance(norm, nn.Identity) or not getattr(mixer, "mamba_rms_norm", True):
        return y * gate
    before = bool(getattr(norm, "norm_before_gate", False))
    inner = y.shape[-1]
    group = int(getattr(norm, "group_size", 0)) or inner // int(norm.n_groups)
    out = y if before else y * gate
    out = out.reshape(batch, seq_len, inner // group, group)
    out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + _norm_eps(norm))
    out = norm.weight.to(work) * out.reshape(batch, seq_len, inner)
    return out * gate if before else out


# ------------------------------------------------------------------------------------------ knockouts


def _query_mask(query_pos: Tensor, batch: int, seq_len: int) -> Tensor:
    """``[batch, pos]`` bool from a bool mask, or integer positions [batch] / [batch, k] (negative ok)."""
    if query_pos.dtype == torch.bool:
        if tuple(query_pos.shape) != (batch, seq_len):
            raise GascanError(
                f"query_pos mask has shape {tuple(query_pos.shape)}, expected {(batch, seq_len)}",
                "pass a [batch, pos] bool mask or integer positions [batch] / [batch, k]",
            )
        return query_pos
    if query_pos.ndim not in (1, 2) or query_pos.shape[0] != batch or query_pos.is_floating_point():
        raise GascanError(
            f"query_pos must be integer positions [batch] or [batch, k] with batch={batch}, "
            f"got {query_pos.dtype} {tuple(query_pos.shape)}",
            "pass one position per prompt (e.g. the final position) or a [batch, pos] bool mask",
        )
    pos = query_pos.reshape(batch, -1).long()
    if bool(((pos < -seq_len) | (pos >= seq_len)).any()):
        raise GascanError(
            f"query position out of range for {seq_len} tokens", f"use positions in -{seq_len}..{seq_len - 1}"
        )
    mask = torch.zeros(batch, seq_len, dtype=torch.bool, device=query_pos.device)
    return mask.scatter(1, pos % seq_len, True)


def knockout_delta(
    comp: SSMComponents,
    M: Tensor | None,
    query_pos: Tensor,
    key_mask: Tensor,
    *,
    heads: Sequence[int] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """Correction to ``y`` when the query positions may not read the keys in ``key_mask``.

    ``delta_y[q] = - sum_{s in keys} M[q, s] x_s`` at the query positions, zero elsewhere, in y's
    layout (mamba2 [batch, pos, head, d_head], mamba1 [batch, pos, channel]); ``y + delta_y`` is the
    knocked-out scan output (then ``post_scan``). ``M`` holds per-unit matrices [batch, unit, q, k]
    for ``heads`` (Mamba-2 heads or Mamba-1 *channels*; default every unit; other units get 0), or
    is ``None``: then only the query rows are computed (cheap for a final-token knockout).
    ``query_pos``: [batch, pos] bool, or integer positions [batch] / [batch, k]. ``key_mask``:
    [batch, pos] bool.
    """
    batch, seq_len = comp.x.shape[:2]
    kind = "head" if comp.family == "mamba2" else "channel"
    units = _check_units(range(comp.n_units) if heads is None else heads, comp.n_units, kind)
    if M is not None and tuple(M.shape) != (batch, len(units), seq_len, seq_len):
        raise GascanError(
            f"M has shape {tuple(M.shape)}, expected {(batch, len(units), seq_len, seq_len)}",
            "pass per-unit matrices (no channel grouping or rows) for exactly the units in heads=, or M=None",
        )
    if tuple(key_mask.shape) != (batch, seq_len):
        raise GascanError(
            f"key_mask has shape {tuple(key_mask.shape)}, expected {(batch, seq_len)}",
            "pass a [batch, pos] bool mask",
        )
    qmask = _query_mask(query_pos, batch, seq_len).to(comp.x.device)  # [batch, pos] bool
    rows = qmask.any(0).nonzero().reshape(-1)  # query rows used by any prompt
    idx = torch.tensor(units, dtype=torch.long, device=comp.x.device)
    kmask = key_mask.to(device=comp.x.device, dtype=torch.bool).to(comp.x.dtype)  # [batch, k]
    qrows = qmask.index_select(1, rows).to(comp.x.dtype)  # [batch, rows]
    delta = torch.zeros_like(comp.x)
    if rows.numel() == 0:
        return delta

    def cut(block: Tensor) -> Tensor:  # [batch, u, rows, k] -> only the knocked-out entries
        return block.to(comp.x.dtype) * qrows[:, None, :, None] * kmask[:, None, None, :]

    with torch.no_grad():
        if M is not None:
            blocks: Iterator[tuple[int, Tensor]] = iter([(0, M.index_select(2, rows))])
        elif comp.family == "mamba2":
            blocks = iter([(0, _mamba2_matrix(comp, units, rows))])
        else:
            blocks = _mamba1_blocks(comp, idx, rows, memory_budget)
        for start, block in blocks:
            part = idx[start : start + block.shape[1]]
            values = -_apply(comp, cut(block), part)  # [batch, rows, u(, d_head)]
            at_rows = torch.zeros_like(comp.x.index_select(2, part)).index_copy_(1, rows, values)
            delta.index_copy_(2, part, at_rows)
    return delta
