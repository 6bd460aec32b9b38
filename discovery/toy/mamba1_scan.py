"""A training-speed Mamba-1 mixer forward for the toy trainer (same numbers as transformers' own).

transformers' pure-PyTorch ``MambaMixer`` path indexes one position at a time (``x[:, :, i]``); on a CPU
the backward of each such select writes a zero tensor the size of the whole sequence, so a 4-layer toy
step took ~4.5 s, 77% of it in ``fill_``. This forward follows the same computation (in_proj, causal
depthwise conv + activation, x_proj, dt_proj + softplus, the selective scan with ``D`` skip, the
``act(gate)`` gating, out_proj) but walks the sequence with ``unbind``/``stack``, whose backward is one
stack: the step is several times faster. It is installed only while training (:func:`fast_mamba1`);
the saved checkpoint is a plain ``MambaForCausalLM`` and every later stage runs transformers' own code.
It applies to full sequences with no cache and no padding mask (how the trainer calls the model), and
defers to the mixer's own forward otherwise.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


def _mixers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "MambaMixer"]


def mixer_forward(mixer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``mixer``'s output for ``hidden_states`` [batch, pos, hidden], differentiable: [batch, pos, hidden]."""
    from transformers.activations import ACT2FN

    seq_len = hidden_states.shape[1]
    x, gate = mixer.in_proj(hidden_states).chunk(2, dim=-1)  # [batch, pos, inner] each
    conv = mixer.conv1d
    x = F.conv1d(x.transpose(1, 2), conv.weight, conv.bias, padding=conv.weight.shape[-1] - 1,
                 groups=conv.weight.shape[0])[:, :, :seq_len]
    x = ACT2FN[mixer.activation](x).transpose(1, 2)  # [batch, pos, inner]
    rank, n_state = int(mixer.time_step_rank), int(mixer.ssm_state_size)
    time_step, B, C = torch.split(mixer.x_proj(x), [rank, n_state, n_state], dim=-1)
    dt = F.softplus(mixer.dt_proj(time_step))  # [batch, pos, inner]
    A = -torch.exp(mixer.A_log.float())  # [inner, n]
    decay = torch.exp(dt[..., None] * A)  # [batch, pos, inner, n]
    write = (dt * x)[..., None] * B[:, :, None, :]  # [batch, pos, inner, n]
    state = torch.zeros_like(write[:, 0])
    states = []
    for a_t, b_t in zip(decay.unbind(1), write.unbind(1)):
        state = a_t * state + b_t
        states.append(state)
    y = torch.einsum("btin,btn->bti", torch.stack(states, 1), C) + x * mixer.D  # [batch, pos, inner]
    return mixer.out_proj((y * ACT2FN[mixer.activation](gate)).to(hidden_states.dtype))


@contextmanager
def fast_mamba1(model: nn.Module) -> Iterator[None]:
    """While inside, every ``MambaMixer`` of ``model`` runs :func:`mixer_forward` for plain full-sequence
    calls (no cache, no mask); the instances' own ``forward`` is restored on exit."""
    patched = []
    for mixer in _mixers(model):
        original = mixer.forward

        def forward(hidden_states, cache=None, attention_mask=None, *args, _original=original, _mixer=mixer,
                    **kwargs):
            if cache is not None or attention_mask is not None or args or kwargs.get("cache_params") is not None:
                return _original(hidden_states, cache, attention_mask, *args, **kwargs)
            return mixer_forward(_mixer, hidden_states)

        mixer.forward = forward
        patched.append(mixer)
    try:
        yield
    finally:
        for mixer in patched:
            del mixer.forward
