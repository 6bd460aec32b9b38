"""Tiny random-initialised models of every supported architecture, built from configs.

They need no download and run in milliseconds: tests use them for plumbing, and
``gascan inspect tiny:ARCH`` shows an architecture's head layout without a checkpoint.
"""
from __future__ import annotations

from typing import Any

import torch

TINY_VOCAB = 324  # 256 byte tokens + " A".." Z", " a".." z", " 0".." 9" + <bos>, <eos>, <pad> (see tiny_tokenizer())

# Small but structurally faithful: several layers, GQA where the family has it, hybrids with both
# kinds of layer. Widths are chosen so every family's constraints hold (head_dim * heads, SSM
# expand / head_dim, n_groups dividing heads).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB, max_position_embeddings=256),
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB, max_position_embeddings=256,
                   sliding_window=32),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=16, vocab_size=TINY_VOCAB, max_position_embeddings=256,
                        sliding_window=32),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=TINY_VOCAB, max_position_embeddings=256, pad_token_id=0),
    "gpt2": dict(n_embd=64, n_layer=3, n_head=4, vocab_size=TINY_VOCAB, n_positions=256),
    "mamba": dict(hidden_size=64, state_size=8, num_hidden_layers=3, vocab_size=TINY_VOCAB, expand=2,
                  conv_kernel=4, use_mambapy=False),
    "falcon_mamba": dict(hidden_size=64, state_size=8, num_hidden_layers=3, vocab_size=TINY_VOCAB, expand=2,
                         conv_kernel=4, use_mambapy=False),
    "mamba2": dict(hidden_size=64, state_size=16, num_hidden_layers=3, vocab_size=TINY_VOCAB, expand=2,
                   head_dim=16, num_heads=8, n_groups=2, conv_kernel=4, chunk_size=16),
    "zamba2": dict(hidden_size=64, num_hidden_layers=4, vocab_size=TINY_VOCAB, mamba_d_state=16,
                   mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=2, mamba_expand=2,
                   num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1,
                   chunk_size=16, use_mem_rope=True, max_position_embeddings=256),
    "jamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, mamba_d_state=8, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=8, attn_layer_period=2, attn_layer_offset=1,
                  expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                  use_mamba_kernels=False),
    "bamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=TINY_VOCAB, mamba_d_state=16, mamba_d_head=16,
                  mamba_n_heads=8, mamba_n_groups=2, mamba_expand=2, mamba_chunk_size=16,
                  attn_layer_indices=[1, 3], max_position_embeddings=256),
    "falcon_h1": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=TINY_VOCAB, mamba_d_state=16,
                      mamba_d_head=16, mamba_n_heads=8, mamba_n_groups=2, mamba_expand=2, mamba_d_ssm=128,
                      mamba_chunk_size=16, max_position_embeddings=256),
}


def tiny_model(arch: str, seed: int = 0, attn_implementation: str = "eager") -> torch.nn.Module:
    """Build a tiny random model of ``arch`` (a key of ``TINY_CONFIGS``), deterministic for ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from discovery.errors import GascanError

    if arch not in TINY_CONFIGS:
        raise GascanError(f"no tiny config for {arch!r}", f"use one of: {', '.join(sorted(TINY_CONFIGS))}")
    config = AutoConfig.for_model(arch, **TINY_CONFIGS[arch])
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    except ValueError:  # pure SSMs support no sdpa: fall back to eager, as load_model does
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval()


def tiny_tokenizer():
    """A byte-level tokenizer with no merges (256 byte tokens + specials) that fits ``TINY_VOCAB``.

    Real (the same byte-level pre-tokenizer and decoder GPT-2 uses), deterministic, and built in code
    so tiny models can be fed real text offline.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    # single tokens for " A", " b", " 7"...: labels and small numbers score as one next token
    merges = [("Ġ", c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    for special in ("<bos>", "<eos>", "<pad>"):
        vocab[special] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<bos>", "<eos>", "<pad>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
