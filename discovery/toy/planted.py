"""A planted G&A circuit: a tiny attention-only Llama whose weights are set by hand.

The prompt format (byte-level tokens of :func:`discovery.models.tiny.tiny_tokenizer`)::

    Ab\\nBe\\nCa\\nDg\\n?a      -> " C"

Each segment is a label, a content letter and ``\\n`` (its summary token); the last token repeats the
gold segment's content. The circuit:

- **gather** head (layer ``g``): at every position attends half to the previous token and half to the one
  before (a RoPE-only positional pattern), and copies label and content identity into "gathered"
  residual dimensions. At a segment's ``\\n`` that is exactly the segment's label and content.
- **aggregate** head (layer ``a > g``): at the query, matches the question's content against the gathered
  content (static RoPE dimensions), with a bonus for ``\\n`` keys, so it attends to the gold segment's
  summary token and copies its gathered label into output dimensions that the unembedding reads as
  " A".." D". Without the gather head the summary tokens are indistinguishable and accuracy falls to chance.
- **decoys** (optional): a head with the aggregate head's query/key weights and a head with the gather
  head's, whose outputs go to unused dimensions: G&A patterns without any effect (DESIGN.md's decoys).
- every other head is a filler with random query/key weights whose small outputs go mostly to unused
  dimensions (a little into the output dimensions, so fillers have small nonzero effects).
- ``aggregate_copies > 1`` adds redundant copies of the aggregate head sharing its output, so a single
  copy's ablation barely matters while ablating all copies breaks the task.

MLPs are zero. Residual layout (``d_model`` 64): 0 constant, 1–4 label, 5–12 content, 13 newline,
14 "?", 15–18 gathered label, 19–26 gathered content, 27–30 output label, 31–63 unused.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from discovery.heads import HeadId
from discovery.tasks.base import Prompt

LABELS = "ABCD"
CONTENTS = "abcdefgh"
D_MODEL, HEAD_DIM = 64, 32
CONST, LAB, CON, NL, QM, GLAB, GCON, OUT, JUNK = 0, 1, 5, 13, 14, 15, 19, 27, 31
ROPE_THETA = 1e6
POS_PAIRS = (0, 1, 2, 3)  # RoPE pairs with fast rotation: the gather head's positional pattern
STATIC = 8  # RoPE pairs 8..15 rotate < 1e-3 rad per token: content matching ignores position there


@dataclass
class PlantedCircuit:
    """A planted model with its known answer."""

    lm: Any  # discovery.loading.LoadedModel
    gather: HeadId
    aggregate: HeadId
    decoys: dict[str, HeadId] = field(default_factory=dict)
    copies: list[HeadId] = field(default_factory=list)  # redundant aggregate copies (besides `aggregate`)

    @property
    def name(self) -> str:
        return self.lm.spec

    def truth(self) -> dict[str, Any]:
        """Known roles, in the labels format of :mod:`discovery.classifier` plus the planted pair."""
        heads = [{"model": self.name, **self.gather.as_dict(), "role": "gather"}]
        heads += [{"model": self.name, **h.as_dict(), "role": "aggregate"} for h in [self.aggregate, *self.copies]]
        return {"model": self.name, "labels": heads,
                "pairs": [{"gather": self.gather.as_dict(), "aggregate": self.aggregate.as_dict()}],
                "decoys": {k: v.as_dict() for k, v in self.decoys.items()}}


def planted_prompts(n: int, seed: int = 0) -> list[Prompt]:
    """``n`` prompts of the planted format, gold position and contents drawn from ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        contents = rng.sample(CONTENTS, len(LABELS))
        gold = rng.randrange(len(LABELS))
        text, segments, labels = "", [], []
        for label, content in zip(LABELS, contents):
            start = len(text)
            text += f"{label}{content}\n"
            segments.append((start, len(text)))
            labels.append((start, start + 1))
        text += f"?{contents[gold]}"
        out.append(Prompt(text=text, segments=segments, labels=labels, gold=gold,
                          candidates=[f" {x}" for x in LABELS], meta={"index": i, "source": "planted"}))
    return out


def write_prompts(path: str | Path, n: int, seed: int = 0) -> Path:
    """The prompts as a ``jsonl:`` task file, so ``gascan scan DIR --task jsonl:PATH`` can use them."""
    from discovery.io import write_text

    lines = [json.dumps({"text": p.text, "segments": p.segments, "labels": p.labels, "gold": p.gold,
                         "candidates": p.candidates}) for p in planted_prompts(n, seed)]
    return write_text(path, "\n".join(lines) + "\n")


def _token_id(tokenizer: Any, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"{text!r} is not one token")
    return int(ids[0])


def _rows(head: int, dims: range | list[int] | int) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [head * HEAD_DIM + d for d in dims]


def planted_model(n_layers: int = 4, n_heads: int = 4, gather: tuple[int, int] = (1, 2),
                  aggregate: tuple[int, int] = (2, 1), *, decoys: bool = True, aggregate_copies: int = 1,
                  filler_scale: float = 0.01, seed: int = 0, name: str | None = None) -> PlantedCircuit:
    """Build the planted circuit (see module docstring) as a gascan ``LoadedModel``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from discovery.model.adapter import adapter_for
    from discovery.model.loading import LoadedModel
    from discovery.model.tiny import TINY_VOCAB, tiny_tokenizer

    (gl, gh), (al, ah) = gather, aggregate
    if not 0 <= gl < al < n_layers or not (0 <= gh < n_heads and 0 <= ah < n_heads):
        raise ValueError("need 0 <= gather layer < aggregate layer < n_layers and heads < n_heads")
    gen = torch.Generator().manual_seed(seed)
    config = LlamaConfig(hidden_size=D_MODEL, intermediate_size=16, num_hidden_layers=n_layers,
                         num_attention_heads=n_heads, num_key_value_heads=n_heads, head_dim=HEAD_DIM,
                         vocab_size=TINY_VOCAB, max_position_embeddings=256, rope_theta=ROPE_THETA,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False)
    model = LlamaForCausalLM(config).eval()
    tok = tiny_tokenizer()
    used = {(gl, gh), (al, ah)}
    slots = [(layer, h) for layer in range(n_layers) for h in range(n_heads) if (layer, h) not in used]
    pick = random.Random(seed)
    copies = []
    for _ in range(aggregate_copies - 1):  # same layer as the aggregate head when there is room
        room = [s for s in slots if s[0] == al] or [s for s in slots if s[0] > gl]
        slot = pick.choice(room)
        slots.remove(slot)
        copies.append(slot)
    decoy_slots: dict[str, tuple[int, int]] = {}
    if decoys:
        for role, low in (("aggregate", gl + 1), ("gather", 0)):
            room = [s for s in slots if s[0] >= low]
            if room:
                slot = pick.choice(room)
                slots.remove(slot)
                decoy_slots[role] = slot

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.model.embed_tokens.weight  # [vocab, d_model]
        emb[:, CONST] = 1.0
        for i, ch in enumerate(LABELS):
            emb[_token_id(tok, ch), LAB + i] = 1.0
        for i, ch in enumerate(CONTENTS):
            emb[_token_id(tok, ch), CON + i] = 1.0
        emb[_token_id(tok, "\n"), NL] = 1.0
        emb[_token_id(tok, "?"), QM] = 1.0
        model.model.norm.weight.fill_(1.0)
        unembed = model.lm_head.weight  # [vocab, d_model]
        for i, ch in enumerate(LABELS):
            unembed[_token_id(tok, f" {ch}"), OUT + i] = 1.0
        inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
        norm0 = math.sqrt(D_MODEL / 2)  # an embedding (constant + one indicator) after RMSNorm
        scale = math.sqrt(HEAD_DIM)

        for layer_index, layer in enumerate(model.model.layers):
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
            attn = layer.self_attn
            q, k, v, o = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight
            for h in range(n_heads):
                slot = (layer_index, h)
                if slot in used or slot in copies or slot in decoy_slots.values():
                    continue
                # filler: random pattern, small output mostly into unused dimensions
                q[_rows(h, range(HEAD_DIM))] = torch.randn(HEAD_DIM, D_MODEL, generator=gen) * 0.3
                k[_rows(h, range(HEAD_DIM))] = torch.randn(HEAD_DIM, D_MODEL, generator=gen) * 0.3
                v[_rows(h, range(HEAD_DIM))] = torch.randn(HEAD_DIM, D_MODEL, generator=gen) * 0.05
                out = torch.zeros(D_MODEL, HEAD_DIM)
                out[JUNK:] = torch.randn(D_MODEL - JUNK, HEAD_DIM, generator=gen) * filler_scale
                out[OUT:OUT + len(LABELS)] = torch.randn(len(LABELS), HEAD_DIM, generator=gen) * filler_scale
                o[:, _rows(h, range(HEAD_DIM))] = out

        def gather_qk(layer: int, h: int) -> None:
            attn = model.model.layers[layer].self_attn
            gain = math.sqrt(20.0 * scale) / norm0  # score gap ≈ 20 logits between d∈{1,2} and d∈{0,3}
            for j in POS_PAIRS:
                w = float(inv_freq[j])
                attn.k_proj.weight[h * HEAD_DIM + j, CONST] = gain
                attn.q_proj.weight[h * HEAD_DIM + j, CONST] = gain * math.cos(1.5 * w)
                attn.q_proj.weight[h * HEAD_DIM + j + HEAD_DIM // 2, CONST] = -gain * math.sin(1.5 * w)
            for i in range(len(LABELS)):
                attn.v_proj.weight[h * HEAD_DIM + i, LAB + i] = 1.0
            for i in range(len(CONTENTS)):
                attn.v_proj.weight[h * HEAD_DIM + len(LABELS) + i, CON + i] = 1.0

        def aggregate_qk(layer: int, h: int) -> None:
            attn = model.model.layers[layer].self_attn
            match, bonus = 15.0, 10.0  # logits: content match at a gathered summary token; any newline key
            for i in range(len(CONTENTS)):
                attn.q_proj.weight[h * HEAD_DIM + STATIC + i, CON + i] = math.sqrt(match * scale) / norm0
                attn.k_proj.weight[h * HEAD_DIM + STATIC + i, GCON + i] = math.sqrt(match * scale) / 4.0
            last = HEAD_DIM - 1  # partner of pair 15: static
            attn.q_proj.weight[h * HEAD_DIM + last, CONST] = math.sqrt(bonus * scale) / norm0
            attn.k_proj.weight[h * HEAD_DIM + last, NL] = math.sqrt(bonus * scale) / 4.0
            for i in range(len(LABELS)):
                attn.v_proj.weight[h * HEAD_DIM + i, GLAB + i] = 1.0

        gather_qk(gl, gh)
        o = model.model.layers[gl].self_attn.o_proj.weight
        for i in range(len(LABELS) + len(CONTENTS)):  # gathered label and content ≈ 1 at a summary token
            target = GLAB + i if i < len(LABELS) else GCON + (i - len(LABELS))
            o[target, gh * HEAD_DIM + i] = 2.0 / norm0
        for layer, h in [(al, ah), *copies]:
            aggregate_qk(layer, h)
            o = model.model.layers[layer].self_attn.o_proj.weight
            for i in range(len(LABELS)):
                o[OUT + i, h * HEAD_DIM + i] = 1.0 / aggregate_copies
        for role, (layer, h) in decoy_slots.items():
            (aggregate_qk if role == "aggregate" else gather_qk)(layer, h)
            o = model.model.layers[layer].self_attn.o_proj.weight
            o[JUNK + 8 * (role == "gather"): JUNK + 8 * (role == "gather") + 8, _rows(h, range(8))] = torch.eye(8) * 0.2

    spec = name or f"planted:L{n_layers}xH{n_heads}-g{gl}.{gh}-a{al}.{ah}-s{seed}"
    lm = LoadedModel(model, tok, adapter_for(model), spec)
    return PlantedCircuit(lm, HeadId(gl, gh, "attn"), HeadId(al, ah, "attn"),
                          {k: HeadId(l_, h_, "attn") for k, (l_, h_) in decoy_slots.items()},
                          [HeadId(l_, h_, "attn") for l_, h_ in copies])


def save_planted(circuit: PlantedCircuit, out: str | Path, n_prompts: int = 64, seed: int = 0) -> Path:
    """Save as a Hugging Face directory (safetensors, tokenizer), ``prompts.jsonl`` and ``truth.json``."""
    from discovery.io import write_json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    circuit.lm.model.save_pretrained(out, safe_serialization=True)
    circuit.lm.tokenizer.save_pretrained(out)
    write_prompts(out / "prompts.jsonl", n_prompts, seed)
    write_json(out / "truth.json", circuit.truth())
    return out
