"""Toy model builders: a Llama-style transformer, a Mamba-2 model and a Bamba hybrid.

Plain ``transformers`` configs and classes, so a trained toy model is an ordinary Hugging Face
checkpoint that every later stage loads like a real one. One registry entry per ``--arch``.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from ..registry import Registry
from .config import TrainConfig

# arch name -> function(config, special token ids) -> transformers config
TOY_ARCHES: Registry[Callable[[TrainConfig, dict[str, int]], Any]] = Registry("toy architecture")


def _common(cfg: TrainConfig, special: dict[str, int]) -> dict[str, Any]:
    return {
        "vocab_size": special["vocab_size"], "hidden_size": cfg.width, "num_hidden_layers": cfg.layers,
        "initializer_range": cfg.init_std, "tie_word_embeddings": True, "bos_token_id": special["bos"],
        "eos_token_id": special["eos"], "pad_token_id": special["pad"], "use_cache": False,
    }


@TOY_ARCHES.register("transformer", aliases=("llama",))
def transformer_config(cfg: TrainConfig, special: dict[str, int]):
    """Llama-style decoder: RoPE, RMSNorm, SwiGLU MLP, full multi-head attention (no GQA)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **_common(cfg, special), intermediate_size=cfg.mlp_ratio * cfg.width,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, max_position_embeddings=1024,
        attention_dropout=0.0,
    )


@TOY_ARCHES.register("mamba2")
def mamba2_config(cfg: TrainConfig, special: dict[str, int]):
    """Pure Mamba-2 stack (no MLPs, no attention), expand 2, one B/C group."""
    from transformers import Mamba2Config

    return Mamba2Config(
        **_common(cfg, special), num_heads=cfg.ssm_heads, head_dim=2 * cfg.width // cfg.ssm_heads,
        expand=2, n_groups=1, state_size=cfg.ssm_state, conv_kernel=cfg.conv_kernel, chunk_size=32,
    )


@TOY_ARCHES.register("hybrid", aliases=("bamba",))
def hybrid_config(cfg: TrainConfig, special: dict[str, int]):
    """Bamba hybrid: Mamba-2 mixers, attention at ``cfg.hybrid_attn_layers()``, an MLP in every layer."""
    from transformers import BambaConfig

    return BambaConfig(
        **_common(cfg, special), intermediate_size=cfg.mlp_ratio * cfg.width,
        num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, max_position_embeddings=1024,
        attn_layer_indices=cfg.hybrid_attn_layers(), mamba_n_heads=cfg.ssm_heads,
        mamba_d_head=2 * cfg.width // cfg.ssm_heads, mamba_n_groups=1, mamba_d_state=cfg.ssm_state,
        mamba_expand=2, mamba_chunk_size=32, mamba_d_conv=cfg.conv_kernel,
    )


def build_model(cfg: TrainConfig, special: dict[str, int]):
    """A freshly initialised causal LM for ``cfg.arch``, deterministic for ``cfg.seed``.

    ``special`` holds ``vocab_size``, ``bos``, ``eos`` and ``pad`` ids from the trained tokenizer.
    """
    import torch
    from transformers import AutoModelForCausalLM

    hf_config = TOY_ARCHES.get(cfg.arch)(cfg, special)
    torch.manual_seed(cfg.seed)
    with warnings.catch_warnings():  # --mlp-ratio 0: torch warns that initialising empty MLP weights is a no-op
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        model = AutoModelForCausalLM.from_config(hf_config)  # sdpa where the family has it
    return model
