"""The one mechanism that reads and edits a model's heads during a forward pass.

Every caller (pattern capture, the ablation engine, attribution, pair tests, placement) goes through
:class:`Intervener`. It installs, for the duration of a ``with`` block:

- a pre-hook on every layer that records which layer is running (Zamba2's shared attention block
  runs inside several layers, so edits are keyed by the *calling* layer, never by module);
- a pre-hook on each output projection, which edits the projection's input columns of the chosen
  heads (zero / mean / any function) — the head's contribution, before heads are mixed;
- gascan's attention function (registered with transformers' ``AttentionInterface``), which computes
  eager attention probabilities only where they are captured or edited (edge knockout) and uses the
  model's fast path (sdpa) everywhere else; it can also hand the queries and keys it receives to a
  sink (the attribution screen's QK fix);
- pre-hooks on SSM mixers that hand their input to whoever asked (implicit-attention patterns and
  SSM edge knockout);
- optional layer stubs: layers before ``start_layer`` return cached clean hidden states instead of
  computing, so an edit in layer l only recomputes layers l..L (prefix reuse); layers after
  ``stop_layer`` pass their input through, so the model is truncated there and read out through its
  own final norm and unembedding (the minimal model);
- an optional halt: the forward stops right after layer ``halt_after`` (no later layer, no unembedding),
  for passes that only read heads (patterns, read tests); ``run`` swallows the stop.

Weights are never modified (Zamba2 shares weight tensors across layers).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from discovery.errors import GascanError
from discovery.model.adapter import Adapter

GASCAN_ATTENTION = "gascan"

ProjEdit = Callable[[torch.Tensor], torch.Tensor]  # [batch, pos, in_features] -> same
ProbEdit = Callable[[torch.Tensor], torch.Tensor]  # [batch, head, q, k] -> same
ProbSink = Callable[[torch.Tensor], None]
# (query [batch, head, q, d_head], key [batch, kv_head, k, d_head], attention mask, attention kwargs): the
# states the attention function receives (after position encoding and any QK norm)
QKSink = Callable[[torch.Tensor, torch.Tensor, Any, dict], None]
MixerSink = Callable[[torch.Tensor, torch.Tensor | None], None]  # (hidden [batch, pos, d], mask [batch, pos])


@dataclass
class PassConfig:
    """What one forward pass should capture and edit, keyed by layer (and head kind)."""

    proj_edits: dict[tuple[int, str], ProjEdit] = field(default_factory=dict)
    prob_edits: dict[int, ProbEdit] = field(default_factory=dict)
    prob_sinks: dict[int, ProbSink] = field(default_factory=dict)
    qk_sinks: dict[int, QKSink] = field(default_factory=dict)
    mixer_sinks: dict[int, MixerSink] = field(default_factory=dict)
    layer_sinks: dict[int, Callable[[Any], None]] = field(default_factory=dict)
    start_layer: int = 0
    start_hidden: torch.Tensor | None = None  # [batch, pos, d_model]: output of layer start_layer-1
    stop_layer: int | None = None  # layers after this one pass their input through (truncated model)
    halt_after: int | None = None  # the forward ends after this layer: no logits (a pass that only reads heads)


class _Halt(Exception):
    """Raised after :attr:`PassConfig.halt_after` ran; :meth:`Intervener.run` catches it."""


@dataclass
class _State:
    base_attention: str
    current_layer: int | None = None
    config: PassConfig = field(default_factory=PassConfig)


def _repeat_kv(value: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[batch, kv_head, k, d] -> [batch, head, k, d] (grouped-query attention)."""
    n_rep = n_heads // value.shape[1]
    return value if n_rep == 1 else value.repeat_interleave(n_rep, dim=1)


def _gascan_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Attention that exposes probabilities only where gascan needs them (see module docstring)."""
    # the documented way to delegate to sdpa from a custom attention function
    # (https://huggingface.co/docs/transformers/attention_interface)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state: _State | None = getattr(module, "_gascan_state", None)
    eager = sys.modules[type(module).__module__].eager_attention_forward
    layer = state.current_layer if state is not None else None
    if state is not None and layer in state.config.qk_sinks:
        state.config.qk_sinks[layer](query, key, attention_mask, kwargs)
    wants_probs = state is not None and (layer in state.config.prob_edits or layer in state.config.prob_sinks)
    if not wants_probs:
        base = state.base_attention if state is not None else "sdpa"
        if base == "sdpa" and kwargs.get("softcap") is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return eager(module, query, key, value, attention_mask, **kwargs)
    out, probs = eager(module, query, key, value, attention_mask, **kwargs)  # probs [batch, head, q, k]
    if layer in state.config.prob_edits:
        probs = state.config.prob_edits[layer](probs)
        out = torch.matmul(probs, _repeat_kv(value, probs.shape[1])).transpose(1, 2).contiguous()
    if layer in state.config.prob_sinks:
        state.config.prob_sinks[layer](probs)
    return out, probs


def register_attention() -> None:
    """Register gascan's attention function and its (eager) mask with transformers; idempotent.

    Only public API: ``AttentionInterface`` / ``AttentionMaskInterface`` are documented dict-like registries
    (``register`` adds a key library-wide; an instance answers ``in`` for registered keys).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if GASCAN_ATTENTION not in AttentionInterface():
        AttentionInterface.register(GASCAN_ATTENTION, _gascan_attention)
    if GASCAN_ATTENTION not in AttentionMaskInterface():
        AttentionMaskInterface.register(GASCAN_ATTENTION, eager_mask)


def _hidden_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _with_hidden(template: Any, hidden: torch.Tensor) -> Any:
    if isinstance(template, torch.Tensor):
        return hidden
    return (hidden, *template[1:])


def _halt(module: nn.Module, args: Any, output: Any) -> None:
    raise _Halt


class Intervener:
    """Hooks for one model; use ``with intervener.run(config): model(...)``."""

    def __init__(self, adapter: Adapter) -> None:
        register_attention()
        self.adapter = adapter
        self.model = adapter.model
        base = getattr(self.model.config, "_attn_implementation", "eager") or "eager"
        self.base_attention = "sdpa" if base in ("sdpa", GASCAN_ATTENTION) else "eager"
        self._layer_template: Any = None  # structure of a layer's output (tensor or tuple)

    def _attention_modules(self) -> list[nn.Module]:
        mods = {}
        for group in self.adapter.inventory.groups:
            if group.pattern == "attention":
                module = self.adapter.mixer(group.layer, group.kind)
                mods[id(module)] = module
        return list(mods.values())

    @contextmanager
    def run(self, config: PassConfig):
        """Install hooks for one pass described by ``config``; everything is removed on exit."""
        state = _State(self.base_attention, config=config)
        handles: list[torch.utils.hooks.RemovableHandle] = []
        patched: list[nn.Module] = []
        layers = self.adapter.layers()
        previous_impl = self.model.config._attn_implementation
        attn_modules = self._attention_modules()
        try:
            for index, layer in enumerate(layers):
                handles.append(layer.register_forward_pre_hook(self._enter_layer(state, index)))
                if index in config.layer_sinks:
                    handles.append(layer.register_forward_hook(self._layer_sink(config.layer_sinks[index])))
            seen: set[int] = set()
            for group in self.adapter.inventory.groups:
                proj = self.adapter.out_proj(group.layer, group.kind)
                if (group.layer, group.kind) in config.proj_edits and id(proj) not in seen:
                    seen.add(id(proj))
                    handles.append(proj.register_forward_pre_hook(self._proj_hook(state, group.kind)))
                if group.kind == "ssm" and group.layer in config.mixer_sinks:
                    mixer = self.adapter.mixer(group.layer, group.kind)
                    handles.append(mixer.register_forward_pre_hook(self._mixer_hook(state), with_kwargs=True))
            for module in attn_modules:
                module._gascan_state = state
            if attn_modules:
                # public switch: dispatches to every sub-model and sub-config
                self.model.set_attn_implementation(GASCAN_ATTENTION)
                if self.model.config._attn_implementation != GASCAN_ATTENTION:  # transformers only warned
                    raise GascanError(
                        f"{type(self.model).__name__} cannot switch its attention function at run time",
                        "use a model whose attention dispatches through transformers' AttentionInterface",
                    )
            if config.start_layer > 0:
                if config.start_hidden is None:
                    raise ValueError("start_layer > 0 needs start_hidden")
                for index in range(config.start_layer):
                    layers[index].forward = self._stub(config.start_hidden)
                    patched.append(layers[index])
            if config.stop_layer is not None:
                for index in range(config.stop_layer + 1, len(layers)):
                    layers[index].forward = self._passthrough()
                    patched.append(layers[index])
            if config.halt_after is not None:  # after the layer's own sinks (hooks run in registration order)
                handles.append(layers[config.halt_after].register_forward_hook(_halt))
            try:
                yield state
            except _Halt:
                pass
        finally:
            for handle in handles:
                handle.remove()
            for module in attn_modules:
                if hasattr(module, "_gascan_state"):
                    del module._gascan_state
            for layer in patched:
                del layer.forward
            if attn_modules:
                self.model.set_attn_implementation(previous_impl)

    # -- hook factories -------------------------------------------------------------------------
    def _enter_layer(self, state: _State, index: int):
        def hook(module, args):
            state.current_layer = index

        return hook

    def _layer_sink(self, sink):
        def hook(module, args, output):
            if self._layer_template is None:
                self._layer_template = output
            sink(_hidden_of(output))

        return hook

    def _proj_hook(self, state: _State, kind: str):
        def hook(module, args):
            edit = state.config.proj_edits.get((state.current_layer, kind))
            if edit is None:
                return None
            return (edit(args[0]), *args[1:])

        return hook

    def _mixer_hook(self, state: _State):
        def hook(module, args, kwargs):
            sink = state.config.mixer_sinks.get(state.current_layer)
            if sink is not None:
                from discovery.model.ssm import mixer_inputs

                sink(*mixer_inputs(args, kwargs))

        return hook

    def _stub(self, hidden: torch.Tensor):
        template = self._layer_template

        def forward(*args, **kwargs):
            return _with_hidden(template, hidden) if template is not None else hidden

        return forward

    def _passthrough(self):
        """A layer that returns its input hidden state unchanged (in the layer's output structure)."""

        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            template = self._layer_template
            return _with_hidden(template, hidden) if template is not None else hidden

        return forward

    def learn_layer_output_format(self, input_ids: torch.Tensor) -> None:
        """Run one token through the model once to learn the structure a layer returns."""
        if self._layer_template is not None:
            return
        with torch.no_grad(), self.run(PassConfig(layer_sinks={0: lambda h: None})):
            self.model(input_ids=input_ids[:1, :1])
