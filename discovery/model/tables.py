"""One table per architecture family: where the layers, heads and output projections live.

Adding a model family means adding a table here (pyvene-style), never editing the engine. Paths are
relative to the model (``layers``, ``final_norm``, ``unembed``) or to one layer (components). A
component is present in a layer when its paths resolve there, which is how hybrids (Jamba, Bamba,
Zamba2) get attention in some layers and SSM mixers in others, and Falcon-H1 gets both in every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from discovery.heads import HeadKind
from discovery.registry import Registry


@dataclass(frozen=True)
class Component:
    """One kind of head inside a layer.

    ``mixer`` is the module computing the heads (attention module or SSM mixer); ``out_proj`` is the
    projection whose input columns carry the heads (ablations edit that input); ``pattern`` says how
    a head's ``[query, key]`` pattern is computed: ``attention`` (softmax probabilities),
    ``mamba1`` (per-channel implicit attention) or ``mamba2`` (per-head implicit attention).
    ``direct_write``: the out-projection's output is added to the residual stream as it is (times
    the layer attribute ``write_scale`` names, when set), which is what the attribution screen's QK
    fix needs to know a head's direct write; ``False`` where it passes through more computation first.
    """

    kind: HeadKind
    mixer: str
    out_proj: str
    pattern: str
    direct_write: bool = True
    write_scale: str | None = None


@dataclass(frozen=True)
class ArchTable:
    """Module paths of one architecture family."""

    family: str
    model_types: tuple[str, ...]
    layers: str
    final_norm: str
    components: tuple[Component, ...]
    unembed: str = "lm_head"
    description: str = ""


ARCHITECTURES: Registry[ArchTable] = Registry("architecture")

_ATTN = Component("attn", "self_attn", "self_attn.o_proj", "attention")

_TABLES = [
    ArchTable(
        "llama",
        ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "smollm3", "olmo2"),
        layers="model.layers",
        final_norm="model.norm",
        components=(_ATTN,),
        description="Llama-family decoders (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3); GQA heads are query heads",
    ),
    ArchTable(
        "gpt2",
        ("gpt2",),
        layers="transformer.h",
        final_norm="transformer.ln_f",
        components=(Component("attn", "attn", "attn.c_proj", "attention"),),
        description="GPT-2",
    ),
    ArchTable(
        "mamba",
        ("mamba", "falcon_mamba"),
        layers="backbone.layers",
        final_norm="backbone.norm_f",
        components=(Component("ssm", "mixer", "mixer.out_proj", "mamba1"),),
        description="Mamba-1 and Falcon-Mamba: heads are contiguous channel groups",
    ),
    ArchTable(
        "mamba2",
        ("mamba2",),
        layers="backbone.layers",
        final_norm="backbone.norm_f",
        components=(Component("ssm", "mixer", "mixer.out_proj", "mamba2"),),
        description="Mamba-2",
    ),
    ArchTable(
        "zamba2",
        ("zamba2",),
        layers="model.layers",
        final_norm="model.final_layernorm",
        components=(
            Component("attn", "shared_transformer.self_attn", "shared_transformer.self_attn.o_proj", "attention",
                      direct_write=False),  # the shared block's MLP and linear sit between it and the residual
            Component("ssm", "mamba", "mamba.out_proj", "mamba2"),
            Component("ssm", "mamba_decoder.mamba", "mamba_decoder.mamba.out_proj", "mamba2"),
        ),
        description="Zamba2: Mamba-2 layers with a shared attention block in hybrid layers",
    ),
    ArchTable(
        "jamba",
        ("jamba",),
        layers="model.layers",
        final_norm="model.final_layernorm",
        components=(_ATTN, Component("ssm", "mamba", "mamba.out_proj", "mamba1")),
        description="Jamba: Mamba-1 and attention layers",
    ),
    ArchTable(
        "bamba",
        ("bamba",),
        layers="model.layers",
        final_norm="model.final_layernorm",
        components=(_ATTN, Component("ssm", "mamba", "mamba.out_proj", "mamba2")),
        description="Bamba: Mamba-2 and attention layers",
    ),
    ArchTable(
        "falcon_h1",
        ("falcon_h1",),
        layers="model.layers",
        final_norm="model.final_layernorm",
        components=(
            Component("attn", "self_attn", "self_attn.o_proj", "attention", write_scale="attn_out_multiplier"),
            Component("ssm", "mamba", "mamba.out_proj", "mamba2", write_scale="ssm_out_multiplier"),
        ),
        description="Falcon-H1: attention and Mamba-2 side by side in every layer",
    ),
]

for _table in _TABLES:
    ARCHITECTURES.add(_table.family, _table, aliases=tuple(t for t in _table.model_types if t != _table.family))


def table_for(model_type: str) -> ArchTable:
    """The table whose family covers ``model_type`` (a config's ``model_type``)."""
    return ARCHITECTURES.get(model_type)


def supported_model_types() -> list[str]:
    return sorted({t for name in ARCHITECTURES.names() for t in ARCHITECTURES.get(name).model_types})
