"""Prompts with exactly annotated positions, and their tokenization into padded batches.

A task renders tokenizer-free :class:`Prompt` objects whose annotations are *character* spans
(each segment, each option label). :func:`annotate` maps them through any tokenizer onto token
positions in a padded batch (:class:`AnnotatedBatch`), so every metric and ablation downstream
looks at the same, exactly known tokens whatever the tokenizer (byte-level BPE, SentencePiece
style with "▁", GGUF-loaded), with or without BOS, under left or right padding.

Token ↔ character rule (deterministic, also for tokens that straddle a boundary):

* a token covers the characters ``[start, end)`` given by the tokenizer's offset mapping (fast
  tokenizers) or by decoding growing prefixes (other tokenizers);
* a segment's token span is every token that overlaps its character span; its **summary token**
  is the token that holds the segment's *last character* (so it decodes to the segment's last
  characters, or — if the tokenizer merged that character with the following text — to a string
  that contains them; two neighbouring segments may then share that token);
* a segment's trailing spaces are left out of it: byte-level BPE and SentencePiece alike attach a
  space to the word that *follows* it, so an option rendered as ``"lute: F "`` would otherwise end
  in (and be summarised by) the next option's first word;
* a label's token is the token holding the label's last character;
* the **query position** is the last real token of the prompt.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from discovery.errors import TaskError

SCORING_MODES = ("next_token", "continuation")


@dataclass
class Prompt:
    """One tokenizer-free prompt: rendered text plus character-span annotations.

    ``text`` ends right at the query character (e.g. ``...Answer:``); ``segments`` are ``[start,
    end)`` character spans (an option line including its trailing newline, a ``key:value`` line, an
    assignment, a needle); ``labels`` the spans of the option labels of lettered tasks;
    ``candidates`` the continuations to score and ``gold`` the index of the right one.
    ``meta`` carries the source row, the scoring mode (``meta["scoring"]``) and rendering flags.
    """

    text: str
    segments: list[tuple[int, int]]
    labels: list[tuple[int, int]] | None
    gold: int
    candidates: list[str]
    gold_segment: int | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.gold_segment is None and self.segments:
            self.gold_segment = self.gold if self.gold < len(self.segments) else None

    @property
    def scoring(self) -> str:
        return str(self.meta.get("scoring", "next_token"))

    def where(self, index: int | None = None) -> str:
        """How to name this prompt in an error message: its source row when known, else its index."""
        if "row" in self.meta:
            src = self.meta.get("source")
            return f"row {self.meta['row']}" + (f" of {src}" if src else "")
        return f"prompt {self.meta.get('index', '?') if index is None else index}"


def check_prompt(p: Prompt) -> str | None:
    """Return what is wrong with a prompt's annotations (``None`` when it is consistent)."""
    n = len(p.text)
    if not p.text:
        return "empty text"
    for what, spans in (("segment", p.segments), ("label", p.labels or [])):
        for k, span in enumerate(spans):
            if len(span) != 2:
                return f"{what} {k} is not a [start, end] pair"
            s, e = span
            if not (isinstance(s, int) and isinstance(e, int)) or not 0 <= s < e <= n:
                return f"{what} {k} span [{s}, {e}) is not inside the text of {n} characters"
    if p.labels is not None and len(p.labels) != len(p.segments):
        return f"{len(p.labels)} labels for {len(p.segments)} segments"
    if len(p.candidates) < 2:
        return f"fewer than two candidates ({len(p.candidates)})"
    if len(set(p.candidates)) != len(p.candidates):
        dup = sorted({c for c in p.candidates if p.candidates.count(c) > 1})
        return f"duplicate candidates {dup}"
    if any(not c for c in p.candidates):
        return "an empty candidate"
    if not 0 <= p.gold < len(p.candidates):
        return f"gold {p.gold} out of range 0..{len(p.candidates) - 1}"
    if p.gold_segment is not None and not 0 <= p.gold_segment < len(p.segments):
        return f"gold_segment {p.gold_segment} out of range 0..{len(p.segments) - 1}"
    if p.scoring not in SCORING_MODES:
        return f"scoring {p.scoring!r} is not one of {SCORING_MODES}"
    return None


class TextBuilder:
    """Append text pieces and remember their character spans (for rendering prompts)."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._len = 0

    def add(self, piece: str) -> tuple[int, int]:
        start = self._len
        self._parts.append(piece)
        self._len += len(piece)
        return (start, self._len)

    def __len__(self) -> int:
        return self._len

    @property
    def text(self) -> str:
        return "".join(self._parts)


# ---------------------------------------------------------------------------------------------
# The annotated batch
# ---------------------------------------------------------------------------------------------


@dataclass
class AnnotatedBatch:
    """Tokenized, padded prompts; every position is an index into the padded row."""

    prompts: list[Prompt]
    input_ids: torch.Tensor  # [batch, pos] long
    attention_mask: torch.Tensor  # [batch, pos] long
    seg_start: torch.Tensor  # [batch, seg] long, first token of each segment
    seg_end: torch.Tensor  # [batch, seg] long, exclusive
    seg_mask: torch.Tensor  # [batch, seg] bool, False for padding segments
    summary_pos: torch.Tensor  # [batch, seg] long, token holding the segment's last character
    label_pos: torch.Tensor | None  # [batch, seg] long, token holding the label's last character
    query_pos: torch.Tensor  # [batch] long, last real token
    gold: torch.Tensor  # [batch] long, index into candidates
    gold_segment: torch.Tensor  # [batch] long, index into segments (gold when not given)
    cand_first_token: torch.Tensor  # [batch, cand] long, first token id of each continuation
    cand_tokens: list[list[list[int]]]  # [batch][cand] -> token ids of the continuation
    padding_side: str
    cand_mask: torch.Tensor | None = None  # [batch, cand] bool, False for padding candidates
    label_mask: torch.Tensor | None = None  # [batch, seg] bool, where label_pos is meaningful
    scoring: str = "next_token"  # "continuation" when any prompt asked for continuation scoring

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def position_classes(self) -> dict[str, torch.Tensor]:
        """Boolean ``[batch, pos]`` masks: query, summary, segment, label, all (real tokens)."""
        b, t = self.input_ids.shape
        rows = torch.arange(b, device=self.input_ids.device)
        query = torch.zeros(b, t, dtype=torch.bool, device=self.input_ids.device)
        query[rows, self.query_pos] = True
        summary = torch.zeros_like(query)
        r, s = torch.nonzero(self.seg_mask, as_tuple=True)
        summary[r, self.summary_pos[r, s]] = True
        pos = torch.arange(t, device=self.input_ids.device)  # [pos]
        inside = (pos[None, None, :] >= self.seg_start[:, :, None]) & (
            pos[None, None, :] < self.seg_end[:, :, None]
        )  # [batch, seg, pos]
        segment = (inside & self.seg_mask[:, :, None]).any(dim=1)
        label = torch.zeros_like(query)
        if self.label_pos is not None:
            lmask = self.label_mask if self.label_mask is not None else self.seg_mask
            r, s = torch.nonzero(lmask, as_tuple=True)
            label[r, self.label_pos[r, s]] = True
        return {
            "query": query,
            "summary": summary,
            "segment": segment,
            "label": label,
            "all": self.attention_mask.bool(),
        }

    def to(self, device: torch.device | str) -> AnnotatedBatch:
        """Move every tensor to ``device``."""
        changes = {
            k: v.to(device) for k, v in self.__dict__.items() if isinstance(v, torch.Tensor)
        }
        return replace(self, **changes)

    def select(self, rows: Sequence[int] | torch.Tensor | slice) -> AnnotatedBatch:
        """A batch of a subset of the prompts (same padding width; for chunking)."""
        if isinstance(rows, slice):
            idx = list(range(len(self)))[rows]
        elif isinstance(rows, torch.Tensor):
            idx = [int(i) for i in rows.flatten().tolist()]
        else:
            idx = [int(i) for i in rows]
        index = torch.tensor(idx, dtype=torch.long)
        changes: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if isinstance(v, torch.Tensor):
                changes[k] = v.index_select(0, index.to(v.device))
        changes["prompts"] = [self.prompts[i] for i in idx]
        changes["cand_tokens"] = [self.cand_tokens[i] for i in idx]
        return replace(self, **changes)


# ---------------------------------------------------------------------------------------------
# Tokenization with character offsets
# ---------------------------------------------------------------------------------------------


def _encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of ``text`` (no special tokens) and each token's character span."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
        return ids, _repair_offsets(offsets, len(text))
    return _offsets_by_decoding(tokenizer, text)


def _repair_offsets(offsets: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """Give tokens with an empty span (trimmed offsets) the uncovered characters before them."""
    out: list[tuple[int, int]] = []
    covered = 0
    for s, e in offsets:
        if e <= s:  # e.g. a whitespace token whose offsets were trimmed away
            s, e = covered, min(n, max(covered, e))
            if e <= s and covered < n:
                e = s + 1
        out.append((s, e))
        covered = max(covered, e)
    return out


def _offsets_by_decoding(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Offsets for tokenizers without an offset mapping: decode growing prefixes of the ids."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))

    def dec(k: int) -> str:
        return tokenizer.decode(ids[:k], clean_up_tokenization_spaces=False)

    if dec(len(ids)) != text:
        raise TaskError(
            "this tokenizer does not decode its own encoding back to the prompt text, so token "
            "positions cannot be located",
            "use a fast (tokenizers-backed) tokenizer, which reports character offsets",
        )
    offsets: list[tuple[int, int]] = []
    prev = 0
    for k in range(1, len(ids) + 1):
        cur = len(dec(k))
        # A token that decodes to part of a multi-byte character yields no new characters yet.
        offsets.append((min(prev, cur), cur) if cur > prev else (max(prev - 1, 0), prev))
        prev = max(prev, cur)
    return ids, offsets


def tokenizer_adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts a BOS token first by default (Llama, Gemma: yes; GPT-2: no)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def _token_index_of_char(offsets: list[tuple[int, int]], char: int) -> int | None:
    """Index of the last token whose span contains character ``char``."""
    found = None
    for i, (s, e) in enumerate(offsets):
        if s <= char < e:
            found = i
        elif s > char:
            break
    return found


def _without_trailing_spaces(text: str, start: int, end: int) -> int:
    """``end`` moved back over the spaces that close ``text[start:end]`` (kept if it is all spaces)."""
    trimmed = start + len(text[start:end].rstrip(" "))
    return trimmed if trimmed > start else end


def _span_tokens(offsets: list[tuple[int, int]], start: int, end: int) -> tuple[int, int] | None:
    """[first, last] indices of tokens overlapping characters [start, end)."""
    hits = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
    return (hits[0], hits[-1]) if hits else None


def _apply_chat_template(p: Prompt, tokenizer: Any) -> Prompt:
    """Wrap the prompt as one user turn plus the assistant's generation prompt.

    The candidates lose their leading space (the answer starts a fresh assistant turn). Done at
    annotate time because the template belongs to the tokenizer.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise TaskError(
            f"chat_template=true but this tokenizer has no chat template ({p.where()})",
            "set --task-option chat_template=false or use an instruction-tuned model's tokenizer",
        )
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": p.text}], add_generation_prompt=True, tokenize=False
    )
    where = templated.find(p.text)
    if where < 0:
        raise TaskError(
            f"the chat template changed the prompt text, so its annotations cannot be kept ({p.where()})",
            "set --task-option chat_template=false",
        )

    def shift(spans: list[tuple[int, int]] | None) -> list[tuple[int, int]] | None:
        return None if spans is None else [(s + where, e + where) for s, e in spans]

    cands = [c.lstrip(" ") or c for c in p.candidates]
    meta = dict(p.meta, chat_template="applied")
    return Prompt(templated, shift(p.segments), shift(p.labels), p.gold, cands, p.gold_segment, meta)


def annotate(
    prompts: list[Prompt],
    tokenizer: Any,
    *,
    padding_side: str = "left",
    add_bos: bool | None = None,
    max_length: int | None = None,
) -> AnnotatedBatch:
    """Tokenize ``prompts`` and map every annotation onto positions in a padded batch.

    ``add_bos=None`` follows the tokenizer's default (prepend BOS when it would). Prompts with
    ``meta["chat_template"] is True`` are wrapped in the tokenizer's chat template first.
    Raises :class:`TaskError` for inconsistent prompts, prompts longer than ``max_length`` (naming
    them), and — unless a prompt asked for continuation scoring — candidates whose first tokens
    are not single, distinct tokens in this tokenizer.
    """
    if padding_side not in ("left", "right"):
        raise TaskError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if not prompts:
        raise TaskError("no prompts to annotate", "check the task's size option n and its input file")
    for i, p in enumerate(prompts):
        problem = check_prompt(p)
        if problem:
            raise TaskError(f"malformed prompt ({p.where(i)}): {problem}")
    if add_bos is None:
        add_bos = tokenizer_adds_bos(tokenizer)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos_id is None:
        raise TaskError("add_bos=True but this tokenizer has no BOS token", "pass add_bos=False")

    prompts = [_apply_chat_template(p, tokenizer) if p.meta.get("chat_template") is True else p
               for p in prompts]
    rows_ids: list[list[int]] = []
    rows_seg: list[list[tuple[int, int, int]]] = []  # (first, last+1, summary) per segment
    rows_lab: list[list[int] | None] = []
    cand_tokens: list[list[list[int]]] = []
    too_long: list[str] = []
    not_single: list[str] = []
    for i, p in enumerate(prompts):
        ids, offsets = _encode_with_offsets(tokenizer, p.text)
        if add_bos:
            ids = [bos_id] + ids
            offsets = [(0, 0)] + offsets
        segs = []
        for k, (s, e) in enumerate(p.segments):
            e = _without_trailing_spaces(p.text, s, e)
            span = _span_tokens(offsets, s, e)
            summary = _token_index_of_char(offsets, e - 1)
            if span is None or summary is None:
                raise TaskError(f"segment {k} of {p.where(i)} covers no token in this tokenizer")
            segs.append((span[0], span[1] + 1, summary))
        labs = None
        if p.labels is not None:
            labs = []
            for k, (s, e) in enumerate(p.labels):
                pos = _token_index_of_char(offsets, e - 1)
                if pos is None:
                    raise TaskError(f"label {k} of {p.where(i)} covers no token in this tokenizer")
                labs.append(pos)
        if max_length is not None and len(ids) > max_length:
            too_long.append(f"{p.where(i)} ({len(ids)} tokens)")
        conts = [_continuation_ids(tokenizer, p.text, ids, c, add_bos, bos_id) for c in p.candidates]
        if p.scoring == "next_token":
            firsts = [c[0] for c in conts]
            if any(len(c) != 1 for c in conts) or len(set(firsts)) != len(firsts):
                shown = ", ".join(
                    f"{c!r}->{tokenizer.convert_ids_to_tokens(t)}" for c, t in zip(p.candidates, conts)
                )
                not_single.append(f"{p.where(i)}: {shown}")
        rows_ids.append(ids)
        rows_seg.append(segs)
        rows_lab.append(labs)
        cand_tokens.append(conts)
    if too_long:
        raise TaskError(
            f"{len(too_long)} prompt(s) longer than the model context of {max_length} tokens: "
            + "; ".join(too_long[:5]) + (" ..." if len(too_long) > 5 else ""),
            "shorten the prompts (fewer shots, pairs or a shorter haystack) or drop those rows",
        )
    if not_single:
        raise TaskError(
            f"labels of {len(not_single)} prompt(s) are not single/distinct tokens in this tokenizer "
            f"({not_single[0]})",
            "use continuation scoring (--task-option scoring=continuation)",
        )
    return _pad(prompts, rows_ids, rows_seg, rows_lab, cand_tokens, tokenizer, padding_side)


def _continuation_ids(
    tokenizer: Any, text: str, ids: list[int], cand: str, add_bos: bool, bos_id: int | None
) -> list[int]:
    """Token ids of ``cand`` as it continues ``text`` (encode the whole, drop the context's ids)."""
    ctx = ids[1:] if add_bos else ids
    whole = list(tokenizer(text + cand, add_special_tokens=False)["input_ids"])
    if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
        return whole[len(ctx):]
    alone = list(tokenizer(cand, add_special_tokens=False)["input_ids"])
    if not alone:
        raise TaskError(f"candidate {cand!r} encodes to no tokens in this tokenizer")
    return alone


def _pad(
    prompts: list[Prompt],
    rows_ids: list[list[int]],
    rows_seg: list[list[tuple[int, int, int]]],
    rows_lab: list[list[int] | None],
    cand_tokens: list[list[list[int]]],
    tokenizer: Any,
    padding_side: str,
) -> AnnotatedBatch:
    b = len(prompts)
    t = max(len(r) for r in rows_ids)
    n_seg = max(1, max(len(s) for s in rows_seg))
    n_cand = max(len(c) for c in cand_tokens)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(tokenizer, "eos_token_id", None) or 0
    input_ids = torch.full((b, t), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros(b, t, dtype=torch.long)
    seg_start = torch.zeros(b, n_seg, dtype=torch.long)
    seg_end = torch.zeros(b, n_seg, dtype=torch.long)
    summary = torch.zeros(b, n_seg, dtype=torch.long)
    seg_mask = torch.zeros(b, n_seg, dtype=torch.bool)
    has_labels = any(lab is not None for lab in rows_lab)
    label_pos = torch.zeros(b, n_seg, dtype=torch.long) if has_labels else None
    label_mask = torch.zeros(b, n_seg, dtype=torch.bool) if has_labels else None
    query = torch.zeros(b, dtype=torch.long)
    cand_first = torch.zeros(b, n_cand, dtype=torch.long)
    cand_mask = torch.zeros(b, n_cand, dtype=torch.bool)
    for i, ids in enumerate(rows_ids):
        off = t - len(ids) if padding_side == "left" else 0
        input_ids[i, off: off + len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, off: off + len(ids)] = 1
        query[i] = off + len(ids) - 1
        for k, (s, e, m) in enumerate(rows_seg[i]):
            seg_start[i, k], seg_end[i, k], summary[i, k] = s + off, e + off, m + off
            seg_mask[i, k] = True
        if rows_lab[i] is not None:
            for k, pos in enumerate(rows_lab[i]):
                label_pos[i, k] = pos + off  # type: ignore[index]
                label_mask[i, k] = True  # type: ignore[index]
        for k, c in enumerate(cand_tokens[i]):
            cand_first[i, k] = c[0]
            cand_mask[i, k] = True
    gold = torch.tensor([p.gold for p in prompts], dtype=torch.long)
    gold_seg = torch.tensor(
        [p.gold_segment if p.gold_segment is not None else p.gold for p in prompts], dtype=torch.long
    )
    scoring = "continuation" if any(p.scoring == "continuation" for p in prompts) else "next_token"
    return AnnotatedBatch(
        prompts=prompts, input_ids=input_ids, attention_mask=attention_mask, seg_start=seg_start,
        seg_end=seg_end, seg_mask=seg_mask, summary_pos=summary, label_pos=label_pos, query_pos=query,
        gold=gold, gold_segment=gold_seg, cand_first_token=cand_first, cand_tokens=cand_tokens,
        padding_side=padding_side, cand_mask=cand_mask, label_mask=label_mask, scoring=scoring,
    )
