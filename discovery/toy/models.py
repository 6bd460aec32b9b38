"""Toy model builders: a Llama-style transformer, a Mamba-1 model, a Mamba-2 model and a Bamba hybrid.

Plain ``transformers`` configs and classes, so a trained toy model is an ordinary Hugging Face
checkpoint that every later stage loads like a real one. One registry entry per ``--arch``.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from discovery.registry import Registry
from discovery.toy.config import TrainConfig

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


@TOY_ARCHES.register("mamba1", aliases=("mamba",))
def mamba1_config(cfg: TrainConfig, special: dict[str, int]):
    """Pure Mamba-1 stack (``MambaForCausalLM``): expand 2, so ``2 * width`` channels per layer, each with
    its own ``ssm_state`` decays; no MLPs, no attention. Time-step rank ``width / 16`` (Mamba's default)."""
    from transformers import MambaConfig

    return MambaConfig(
        **_common(cfg, special), state_size=cfg.ssm_state, expand=2, conv_kernel=cfg.conv_kernel,
        time_step_rank=max(1, cfg.width // 16),
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
    if cfg.arch == "hybrid" and cfg.ssm_init == "mamba2":
        mamba2_style_init(model)
    return model


def mamba2_style_init(model) -> None:
    """Re-initialise every Mamba-2 mixer of a Bamba model the way ``Mamba2ForCausalLM`` does.

    Bamba sets each head's time-step bias to 1 (dt = softplus(1) = 1.31, so with A = -1..-H a state
    keeps at most e^-1.31 = 0.27 of itself per token) and draws the convolution and output projection
    from N(0, init_std). Mamba-2 draws dt log-uniformly from [0.001, 0.1] (memories of tens to
    thousands of tokens) and uses Kaiming-uniform convolution and output weights. Uses the global
    torch RNG, so the model stays deterministic for the seed set before it was built.
    """
    import math

    import torch

    dt_min, dt_max, dt_floor = 1e-3, 1e-1, 1e-4  # Mamba2Config's time_step_min / max / floor
    with torch.no_grad():
        for module in model.modules():
            if not (hasattr(module, "dt_bias") and hasattr(module, "A_log") and hasattr(module, "conv1d")):
                continue
            heads = module.dt_bias.shape[0]
            module.A_log.copy_(torch.log(torch.arange(1, heads + 1, dtype=torch.float32)))
            module.D.fill_(1.0)
            dt = torch.exp(torch.rand(heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            dt = dt.clamp(min=dt_floor)
            module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            torch.nn.init.kaiming_uniform_(module.conv1d.weight, a=math.sqrt(5))
            if module.conv1d.bias is not None:
                module.conv1d.bias.zero_()
            torch.nn.init.kaiming_uniform_(module.out_proj.weight, a=math.sqrt(5))
