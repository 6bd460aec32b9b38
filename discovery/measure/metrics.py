"""Gather and aggregate metrics per head: pure functions of a pattern and the annotations.

Every pattern metric takes ``pattern: [batch, head, q, k]`` (one layer group's patterns for the
prompts of an :class:`~discovery.tasks.base.AnnotatedBatch`, positions indexing the padded rows)
and returns **per-prompt, per-head** values ``[batch, head]``, NaN where the metric is undefined
for a prompt (no segments, no gold segment, a one-token segment...). Callers concatenate chunks
along the batch and reduce with :func:`summarise` (a NaN-mean over prompts).

**Row convention (attention and SSM heads alike).** Only the rows a metric reads (summary rows,
the query row) are used, and each is turned into weights over the prompt's real keys::

    w[k] = |pattern[q, k]| * real[k] / sum_k' |pattern[q, k']| * real[k']

For softmax attention this changes nothing (rows are non-negative and sum to one over real keys).
For an SSM head's implicit attention ``M`` (signed, unnormalised, its ``D`` skip kept outside the
pattern) the weights are each key's *share of the row's absolute influence*: masses, entropies and
margins are then on the same 0..1 scale as for attention heads and comparable across heads
whose ``dt``/``C·B`` scales differ, and negative entries cannot cancel positive ones. A row that is
zero on every real key gives NaN. The raw signed values are not used by any metric here.

**Segments.** A segment is the token span ``[seg_start, seg_end)``; its summary token
``summary_pos`` lies inside it. Gather metrics read each segment's summary row and look at the
segment's *other* tokens (the summary token excluded); a segment with no other token gives NaN
for that segment, and a prompt's value is the NaN-mean over its segments. ``gather_cross`` reads
the same rows and looks at the *other* segments' tokens instead (NaN for a segment with no earlier
segment, such as the first). Aggregate metrics read the query row (``query_pos``). Metrics that
compare the gold segment with distractors (``agg_select``, ``agg_margin``, ``selectivity``) need at
least two segments (NaN otherwise: with one segment, e.g. ``niah``'s needle, they are trivially
perfect; use ``agg_focus_segment`` there).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

import torch
from torch import Tensor

from discovery.errors import GascanError
from discovery.heads import HeadGroup
from discovery.tasks.base import AnnotatedBatch

METRICS: Mapping[str, str] = MappingProxyType({
    "gather_score": "mass from each segment's summary token onto its segment's other tokens, "
                    "mean over segments",
    "gather_entropy": "normalised entropy (0 focused .. 1 uniform) of the summary token's "
                      "within-segment attention",
    "gather_cross": "mass from each segment's summary token onto earlier segments' tokens, mean over the "
                    "segments that have one (high: the summary reads another segment, not its own)",
    "agg_focus": "mass from the query position onto the gold segment's summary token",
    "agg_focus_segment": "mass from the query position onto the whole gold segment",
    "agg_select": "1 if the gold segment gets strictly the most query mass of all segments, else 0 "
                  "(mean = fraction)",
    "agg_margin": "query mass on the gold segment minus the largest distractor segment's mass",
    "selectivity": "query mass on the gold segment divided by the query mass on all segments",
    "agg_after": "mass from the query position onto the two tokens right after the gold segment (high with "
                 "a low agg_select: the head reads the finished option one step late, as width-2 SSM toys do)",
    "retrieval_score": "fraction of copyable gold tokens whose top-attended key is that token in the "
                       "gold segment (Wu et al.)",
    "dla": "direct logit attribution of the head's output at the query: gold minus mean other candidates",
})
"""Metric name -> one-line description (table columns, report legends). Read-only."""

PATTERN_METRICS: tuple[str, ...] = (
    "gather_score", "gather_entropy", "gather_cross", "agg_focus", "agg_focus_segment", "agg_select",
    "agg_margin", "selectivity", "agg_after",
)
"""The metrics :func:`pattern_metrics` computes from one pattern on the prompt itself."""


# ---------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------


def _work_dtype(pattern: Tensor) -> torch.dtype:
    return torch.promote_types(pattern.dtype, torch.float32)


def _check(pattern: Tensor, batch: AnnotatedBatch) -> None:
    """One-line errors for a pattern that does not belong to ``batch``."""
    if pattern.ndim != 4:
        raise GascanError(f"a pattern must be [batch, head, q, k], got shape {tuple(pattern.shape)}",
                          "pass one layer group's patterns as for_each_pattern hands them out")
    b, _, q, k = pattern.shape
    t = int(batch.input_ids.shape[1])
    if b != len(batch) or q != t or k != t:
        raise GascanError(
            f"pattern of shape {tuple(pattern.shape)} does not match the batch "
            f"({len(batch)} prompts x {t} positions)",
            "pass batch.select(rows) for the rows the pattern was computed on",
        )


def row_weights(rows: Tensor, key_mask: Tensor) -> Tensor:
    """``|rows|`` over real keys, normalised to sum 1 per row; NaN for rows with no mass.

    ``rows``: ``[batch, head, n, k]`` (any rows of a pattern); ``key_mask``: ``[batch, k]`` real keys.
    """
    mag = rows.abs() * key_mask[:, None, None, :].to(rows.dtype)  # [batch, head, n, k]
    total = mag.sum(-1, keepdim=True)  # [batch, head, n, 1]
    return torch.where(total > 0, mag / total.clamp(min=torch.finfo(rows.dtype).tiny),
                       torch.full_like(mag, float("nan")))


def _pick_rows(pattern: Tensor, pos: Tensor) -> Tensor:
    """Rows ``pos`` ``[batch, n]`` of ``pattern`` ``[batch, head, q, k]`` -> ``[batch, head, n, k]``."""
    b, h, _, k = pattern.shape
    index = pos[:, None, :, None].expand(b, h, pos.shape[1], k)
    return pattern.gather(2, index)


def _in_span(start: Tensor, end: Tensor, width: int) -> Tensor:
    """``[*start.shape, k]`` bool: key k (of ``width``) lies in ``[start, end)``."""
    pos = torch.arange(width, device=start.device)  # [k]
    return (pos >= start[..., None]) & (pos < end[..., None])


def _segments_inside(batch: AnnotatedBatch, width: int, device: torch.device) -> Tensor:
    """``[batch, seg, k]`` bool: key k lies in segment s (False for padding segments)."""
    inside = _in_span(batch.seg_start.to(device), batch.seg_end.to(device), width)  # [batch, seg, k]
    return inside & batch.seg_mask.to(device)[:, :, None]


def _gold_index(batch: AnnotatedBatch, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(gold segment clamped into range [batch], whether it is a real segment [batch])``."""
    n_seg = batch.seg_mask.shape[1]
    gold = batch.gold_segment.to(device)
    in_range = (gold >= 0) & (gold < n_seg)
    safe = gold.clamp(0, n_seg - 1)
    rows = torch.arange(len(gold), device=device)
    return safe, in_range & batch.seg_mask.to(device)[rows, safe]


# ---------------------------------------------------------------------------------------------
# Gather
# ---------------------------------------------------------------------------------------------


def _gather_parts(pattern: Tensor, batch: AnnotatedBatch) -> tuple[Tensor, Tensor, Tensor]:
    """``(gather_score, gather_entropy, gather_cross)``, each ``[batch, head]``."""
    _check(pattern, batch)
    device = pattern.device
    p = pattern.to(_work_dtype(pattern))
    summary = batch.summary_pos.to(device)  # [batch, seg]
    key_mask = batch.attention_mask.to(device).bool()  # [batch, k]
    w = row_weights(_pick_rows(p, summary), key_mask)  # [batch, head, seg, k]
    inside = _segments_inside(batch, p.shape[-1], device)  # [batch, seg, k]
    keys = torch.arange(p.shape[-1], device=device)
    other = inside & (keys[None, None, :] != summary[:, :, None]) & key_mask[:, None, :]  # [batch, seg, k]
    n_other = other.sum(-1)  # [batch, seg]
    w_other = w * other[:, None].to(w.dtype)  # [batch, head, seg, k]
    mass = w_other.sum(-1)  # [batch, head, seg]
    nan = torch.tensor(float("nan"), dtype=w.dtype, device=device)
    score = torch.where((n_other > 0)[:, None, :], mass, nan)  # [batch, head, seg]
    share = w_other / mass[..., None].clamp(min=torch.finfo(w.dtype).tiny)  # [batch, head, seg, k]
    entropy = -torch.special.xlogy(share, share).sum(-1)  # [batch, head, seg]
    log_n = torch.log(n_other.to(w.dtype).clamp(min=1))[:, None, :]  # [batch, 1, seg]
    ok = (n_other >= 2)[:, None, :] & (mass > 0)  # [batch, head, seg]
    entropy = torch.where(ok, entropy / log_n.clamp(min=torch.finfo(w.dtype).tiny), nan)
    # keys of the other (real) segments that a real segment's summary token sees: the earlier segments
    elsewhere = (inside.any(1)[:, None, :] & ~inside & (keys[None, None, :] < summary[:, :, None])
                 & batch.seg_mask.to(device)[:, :, None])  # [batch, seg, k]
    cross_mass = (w * elsewhere[:, None].to(w.dtype)).sum(-1)  # [batch, head, seg]
    cross = torch.where(elsewhere.any(-1)[:, None, :], cross_mass, nan)  # [batch, head, seg]
    return score.nanmean(-1), entropy.nanmean(-1), cross.nanmean(-1)


def gather_score(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: mass from each summary token onto its segment's other tokens, mean over segments."""
    return _gather_parts(pattern, batch)[0]


def gather_cross(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: mass from each summary token onto earlier segments' tokens, mean over segments.

    Tells a head that reads *another* option from its summary token (for example the first option's
    label, read from every option) apart from one that reads nothing: both have a low gather score.
    """
    return _gather_parts(pattern, batch)[2]


def gather_entropy(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: entropy of the summary row renormalised over its segment's other tokens.

    Divided by ``log(n)`` with ``n`` the number of those tokens, so 0 = all on one token (e.g. a
    previous-token head) and 1 = uniform (a gatherer that reads the whole segment). NaN for
    segments with fewer than two other tokens or no mass on them; mean over segments.
    """
    return _gather_parts(pattern, batch)[1]


# ---------------------------------------------------------------------------------------------
# Aggregate
# ---------------------------------------------------------------------------------------------


AFTER_TOKENS = 2
"""How many tokens right after the gold segment ``agg_after`` counts (the separator and the next label)."""


def _query_weights(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head, k]``: the query row as weights (see the module's row convention)."""
    _check(pattern, batch)
    device = pattern.device
    rows = _pick_rows(pattern.to(_work_dtype(pattern)), batch.query_pos.to(device)[:, None])
    return row_weights(rows, batch.attention_mask.to(device).bool())[:, :, 0]


def _segment_mass(query_w: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head, seg]`` from query weights ``[batch, head, k]``; NaN for padding segments."""
    device = query_w.device
    inside = _segments_inside(batch, query_w.shape[-1], device).to(query_w.dtype)  # [batch, seg, k]
    mass = torch.einsum("bhk,bsk->bhs", query_w, inside)  # [batch, head, seg]
    return mass.masked_fill(~batch.seg_mask.to(device)[:, None, :], float("nan"))


def query_segment_mass(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head, seg]``: the query row's weight summed over each segment (NaN for padding segments)."""
    return _segment_mass(_query_weights(pattern, batch), batch)


def _agg_parts(pattern: Tensor, batch: AnnotatedBatch) -> dict[str, Tensor]:
    """Every aggregate metric, each ``[batch, head]``, from one pass over the query rows."""
    device = pattern.device
    query_w = _query_weights(pattern, batch)  # [batch, head, k]
    seg_mass = _segment_mass(query_w, batch)  # [batch, head, seg]
    b, h, n_seg = seg_mass.shape
    nan = torch.tensor(float("nan"), dtype=seg_mass.dtype, device=device)
    gold, gold_ok = _gold_index(batch, device)  # [batch], [batch]
    rows = torch.arange(b, device=device)
    gold_summary = batch.summary_pos.to(device)[rows, gold]  # [batch]
    focus = query_w.gather(2, gold_summary[:, None, None].expand(b, h, 1))[..., 0]  # [batch, head]
    gold_mass = seg_mass.gather(2, gold[:, None, None].expand(b, h, 1))[..., 0]  # [batch, head]

    seg_mask = batch.seg_mask.to(device)  # [batch, seg]
    is_gold = torch.arange(n_seg, device=device)[None, :] == gold[:, None]  # [batch, seg]
    distract = seg_mask & ~is_gold  # [batch, seg]
    max_other = seg_mass.masked_fill(~distract[:, None, :], float("-inf")).amax(-1)  # [batch, head]
    total = seg_mass.nan_to_num(0.0).sum(-1)  # [batch, head]
    compare = (gold_ok & (distract.sum(-1) >= 1))[:, None]  # [batch, 1]: gold plus >= 1 distractor
    ok = gold_ok[:, None]
    tiny = torch.finfo(total.dtype).tiny
    win = (gold_mass > max_other).to(seg_mass.dtype)
    gold_end = batch.seg_end.to(device)[rows, gold]  # [batch], exclusive
    after = _in_span(gold_end, gold_end + AFTER_TOKENS, query_w.shape[-1])  # [batch, k]
    after_mass = (query_w * after[:, None, :].to(query_w.dtype)).sum(-1)  # [batch, head]
    return {
        "agg_focus": torch.where(ok, focus, nan),
        "agg_focus_segment": torch.where(ok, gold_mass, nan),
        "agg_select": torch.where(compare & ~gold_mass.isnan(), win, nan),
        "agg_margin": torch.where(compare, gold_mass - max_other, nan),
        "selectivity": torch.where(compare & (total > 0), gold_mass / total.clamp(min=tiny), nan),
        "agg_after": torch.where(ok, after_mass, nan),
    }


def agg_focus(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: query mass on the gold segment's summary token."""
    return _agg_parts(pattern, batch)["agg_focus"]


def agg_focus_segment(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: query mass on every token of the gold segment."""
    return _agg_parts(pattern, batch)["agg_focus_segment"]


def agg_select(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: 1.0 when the gold segment's query mass is strictly the largest (ties: 0.0)."""
    return _agg_parts(pattern, batch)["agg_select"]


def agg_margin(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: gold segment mass minus the largest distractor segment mass."""
    return _agg_parts(pattern, batch)["agg_margin"]


def selectivity(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: gold segment mass over the mass on all segments (NaN when that is zero)."""
    return _agg_parts(pattern, batch)["selectivity"]


def agg_after(pattern: Tensor, batch: AnnotatedBatch) -> Tensor:
    """``[batch, head]``: query mass on the ``AFTER_TOKENS`` tokens right after the gold segment.

    An SSM head can read an option where its state holds the *finished* option: the separator or
    the next option's label just after it. Such a head has a low ``agg_select`` and a high
    ``agg_after``; a head that reads the option itself has ``agg_after`` near 0.
    """
    return _agg_parts(pattern, batch)["agg_after"]


SELECTION_METRICS = ("agg_select", "agg_after")
"""The metrics whose larger value is a head's :func:`selection`."""


def selection(values: Mapping[str, float | None]) -> float:
    """How strongly a head's query picks the gold option, from its mean metrics: ``agg_select`` (the
    option's own tokens win) or ``agg_after`` (the tokens right after it, where an SSM state holds the
    finished option), whichever is larger; 0 where neither was measured. The ground-truth rules, the
    evidence roles, the pair tests and the classifier judge an aggregate head's selection by it."""
    found = [float(v) for v in (values.get(name) for name in SELECTION_METRICS)
             if v is not None and not math.isnan(float(v))]
    return max(found, default=0.0)


def pattern_metrics(pattern: Tensor, batch: AnnotatedBatch) -> dict[str, Tensor]:
    """Every metric of :data:`PATTERN_METRICS` for one pattern, each ``[batch, head]``."""
    score, entropy, cross = _gather_parts(pattern, batch)
    return {"gather_score": score, "gather_entropy": entropy, "gather_cross": cross, **_agg_parts(pattern, batch)}


def summarise(values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``{name: [batch, head]}`` -> ``{name: [head]}``: mean over prompts ignoring NaN (all NaN -> NaN)."""
    out: dict[str, Tensor] = {}
    for name, v in values.items():
        if v.ndim != 2:
            raise GascanError(f"metric {name!r} has shape {tuple(v.shape)}, expected [batch, head]",
                              "concatenate per-prompt values along dim 0 before summarising")
        out[name] = v.float().nanmean(0) if v.shape[0] else torch.full(v.shape[1:], float("nan"))
    return out


# ---------------------------------------------------------------------------------------------
# Retrieval score (Wu et al. 2024)
# ---------------------------------------------------------------------------------------------


@dataclass
class RetrievalSteps:
    """Where the gold continuation is predicted and where its tokens can be copied from.

    Step ``j`` of prompt ``b`` predicts the gold continuation's token ``target[b, j]`` from position
    ``pred_pos[b, j]`` of the prompt + continuation sequence; ``sources[b, j]`` marks the keys
    inside the gold segment holding that same token id; ``step_mask`` is False for padding steps
    and for tokens with no source (they cannot be copied and are not counted).
    """

    pred_pos: Tensor  # [batch, step] long
    target: Tensor  # [batch, step] long, token ids of the gold continuation
    sources: Tensor  # [batch, step, pos] bool
    step_mask: Tensor  # [batch, step] bool
    key_mask: Tensor  # [batch, pos] bool, real tokens of the sequence

    def __len__(self) -> int:
        return int(self.pred_pos.shape[0])

    def select(self, rows: slice | Sequence[int] | Tensor) -> RetrievalSteps:
        """The steps of a subset of prompts (to match a chunk from for_each_pattern)."""
        if isinstance(rows, slice):
            return RetrievalSteps(*(v[rows] for v in self._tensors()))
        index = torch.as_tensor(rows, dtype=torch.long)
        return RetrievalSteps(*(v.index_select(0, index.to(v.device)) for v in self._tensors()))

    def to(self, device: torch.device | str) -> RetrievalSteps:
        return RetrievalSteps(*(v.to(device) for v in self._tensors()))

    def _tensors(self) -> tuple[Tensor, ...]:
        return (self.pred_pos, self.target, self.sources, self.step_mask, self.key_mask)


def retrieval_batch(batch: AnnotatedBatch) -> tuple[AnnotatedBatch, RetrievalSteps]:
    """Each prompt followed by its gold continuation (all but the last token), left padded.

    Returns a batch over those sequences, every annotated position (segments, summary, labels,
    query) moved to the new layout so ``for_each_pattern`` and the pattern metrics work on it
    unchanged, and the :class:`RetrievalSteps` for :func:`retrieval_score`. The last continuation
    token is not appended: no position needs to see it (as in continuation scoring).
    """
    mask = batch.attention_mask.bool()
    lengths = mask.sum(1)  # [batch]
    first = torch.where(lengths > 0, mask.long().argmax(1), torch.zeros_like(lengths))  # [batch]
    conts = [batch.cand_tokens[i][int(batch.gold[i])] for i in range(len(batch))]
    if any(len(c) == 0 for c in conts):
        raise GascanError("a gold continuation has no tokens", "check the task's candidates")
    new_len = [int(lengths[i]) + len(conts[i]) - 1 for i in range(len(batch))]
    width = max(new_len)
    n_steps = max(len(c) for c in conts)
    pad_positions = batch.input_ids[~mask]
    pad_id = int(pad_positions[0]) if pad_positions.numel() else 0

    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [batch, pos]
    att = torch.zeros(len(batch), width, dtype=torch.long)  # [batch, pos]
    shift = torch.zeros(len(batch), dtype=torch.long)  # [batch]: new position - old position
    pred_pos = torch.zeros(len(batch), n_steps, dtype=torch.long)  # [batch, step]
    target = torch.zeros(len(batch), n_steps, dtype=torch.long)
    step_exists = torch.zeros(len(batch), n_steps, dtype=torch.bool)
    for i, cont in enumerate(conts):
        real = batch.input_ids[i][mask[i]].tolist()
        seq = real + cont[:-1]
        off = width - len(seq)
        ids[i, off:] = torch.tensor(seq, dtype=torch.long)
        att[i, off:] = 1
        shift[i] = off - int(first[i])
        steps = torch.arange(len(cont))
        pred_pos[i, : len(cont)] = off + len(real) - 1 + steps
        target[i, : len(cont)] = torch.tensor(cont, dtype=torch.long)
        step_exists[i, : len(cont)] = True

    def moved(t: Tensor | None) -> Tensor | None:
        return None if t is None else t + shift.view(-1, *([1] * (t.ndim - 1)))

    new = replace(
        batch, input_ids=ids, attention_mask=att, seg_start=moved(batch.seg_start),
        seg_end=moved(batch.seg_end), summary_pos=moved(batch.summary_pos),
        label_pos=moved(batch.label_pos), query_pos=moved(batch.query_pos),
        padding_side="left",
    )
    gold, gold_ok = _gold_index(new, ids.device)
    rows = torch.arange(len(batch))
    keys = torch.arange(width)
    in_gold = ((keys[None, :] >= new.seg_start[rows, gold][:, None])
               & (keys[None, :] < new.seg_end[rows, gold][:, None]) & gold_ok[:, None])  # [batch, pos]
    sources = ((ids[:, None, :] == target[:, :, None]) & in_gold[:, None, :]
               & step_exists[:, :, None])  # [batch, step, pos]
    steps = RetrievalSteps(pred_pos, target, sources, step_exists & sources.any(-1), att.bool())
    return new, steps


def retrieval_inputs(batch: AnnotatedBatch) -> tuple[Tensor, Tensor, RetrievalSteps]:
    """``(input_ids [batch, pos], attention_mask [batch, pos], steps)`` of :func:`retrieval_batch`."""
    new, steps = retrieval_batch(batch)
    return new.input_ids, new.attention_mask, steps


def retrieval_score(pattern: Tensor, steps: RetrievalSteps) -> Tensor:
    """``[batch, head]``: Wu et al.'s retrieval score on the prompt + gold continuation sequence.

    ``pattern`` is computed on :func:`retrieval_batch`'s sequences. A step is a *hit* for a head
    when the key with the largest ``|pattern|`` in the predicting row (real keys only; ties go to
    the earliest key) is one of that step's sources: a token of the gold segment with the same id
    as the token being produced. Score = hits / copyable steps (steps with at least one source);
    NaN when a prompt has none (e.g. the continuation is tokenised differently in the context).
    """
    if pattern.ndim != 4 or pattern.shape[0] != len(steps) or pattern.shape[-1] != steps.key_mask.shape[1]:
        raise GascanError(
            f"pattern of shape {tuple(pattern.shape)} does not match the retrieval sequences "
            f"({len(steps)} prompts x {steps.key_mask.shape[1]} positions)",
            "compute the pattern on retrieval_batch(batch) and pass steps.select(rows) for a chunk",
        )
    device = pattern.device
    s = steps.to(device)
    b, h = pattern.shape[:2]
    rows = _pick_rows(pattern.to(_work_dtype(pattern)), s.pred_pos).abs()  # [batch, head, step, k]
    rows = rows.masked_fill(~s.key_mask[:, None, None, :], -1.0)
    top = rows.argmax(-1)  # [batch, head, step]
    hit = s.sources[:, None].expand(b, h, *s.sources.shape[1:]).gather(-1, top[..., None])[..., 0]
    counted = s.step_mask[:, None, :]  # [batch, 1, step]
    hits = (hit & counted).sum(-1).to(rows.dtype)  # [batch, head]
    n = counted.sum(-1).to(rows.dtype)  # [batch, 1]
    return torch.where(n > 0, hits / n.clamp(min=1), torch.full_like(hits, float("nan")))


# ---------------------------------------------------------------------------------------------
# Direct logit attribution
# ---------------------------------------------------------------------------------------------


def head_outputs(x_query: Tensor, weight: Tensor, n_heads: int, width: int) -> Tensor:
    """``[batch, head, d_model]``: each head's share of an output projection at the query.

    ``x_query``: ``[batch, in_features]``, the projection's *input* at the query position;
    ``weight``: ``[d_model, in_features]`` (``nn.Linear`` layout). Head ``i`` owns input columns
    ``[i * width, (i + 1) * width)``; the shares sum to the projection's output minus its bias.
    """
    need = n_heads * width
    if x_query.ndim != 2 or weight.ndim != 2 or x_query.shape[1] != weight.shape[1] or weight.shape[1] < need:
        raise GascanError(
            f"head_outputs needs x [batch, in] and weight [d_model, in] with in >= {n_heads} x {width}, "
            f"got {tuple(x_query.shape)} and {tuple(weight.shape)}",
            "pass the out_proj input at the query and out_proj.weight of the same layer",
        )
    x = x_query[:, :need].reshape(x_query.shape[0], n_heads, width)  # [batch, head, width]
    w = weight[:, :need].reshape(weight.shape[0], n_heads, width).to(x.dtype)  # [d_model, head, width]
    return torch.einsum("bhw,dhw->bhd", x, w)


def group_head_outputs(x_query: Tensor, weight: Tensor, group: HeadGroup) -> Tensor:
    """:func:`head_outputs` for every head of ``group``, its refined channel heads (``group.spans``) after
    its ``count`` group heads: ``[batch, n_units, d_model]``."""
    out = head_outputs(x_query, weight, group.count, group.width)
    if not group.spans:
        return out
    extra = [x_query[:, s:e] @ weight[:, s:e].to(x_query.dtype).T for s, e in group.spans]  # [batch, d_model] each
    return torch.cat([out, torch.stack(extra, 1)], dim=1)


def final_norm_scale(resid_query: Tensor, eps: float, kind: str = "rms") -> Tensor:
    """``[batch]``: the clean run's ``1 / RMS`` (``kind="rms"``) or ``1 / std`` (``"layer"``) at the query."""
    x = resid_query.to(torch.promote_types(resid_query.dtype, torch.float32))  # [batch, d_model]
    if kind == "rms":
        return torch.rsqrt(x.pow(2).mean(-1) + eps)
    if kind == "layer":
        return torch.rsqrt(x.var(-1, unbiased=False) + eps)
    raise GascanError(f"unknown final norm kind {kind!r}", "use 'rms' or 'layer'")


def dla(
    head_out_at_query: Tensor,
    unembed: Tensor,
    cand_first_token: Tensor,
    gold: Tensor,
    final_norm_scale: Tensor | None = None,
    *,
    norm_weight: Tensor | None = None,
    center: bool = False,
    cand_mask: Tensor | None = None,
) -> Tensor:
    """``[batch, head]``: each head's direct contribution to the gold-minus-mean-other logit difference.

    ``head_out_at_query``: ``[batch, head, d_model]`` (e.g. from :func:`head_outputs`);
    ``unembed``: ``[vocab, d_model]``; ``cand_first_token``: ``[batch, cand]``; ``gold``: ``[batch]``.
    The final norm is linearised at the clean run: each head vector is (for LayerNorm, ``center``)
    centred, multiplied by ``norm_weight`` ``[d_model]`` (Gemma: pass ``1 + weight``) and by
    ``final_norm_scale`` (``[batch]``, the clean ``1 / RMS`` from :func:`final_norm_scale`, or
    ``[batch, d_model]`` already including the weight), then projected on ``u_gold - mean(u_other)``.
    With the scale frozen, the heads' values plus the rest of the residual's sum to the total
    (norm and unembedding biases add a constant that belongs to no head).
    """
    x = head_out_at_query.to(torch.promote_types(head_out_at_query.dtype, torch.float32))  # [batch, head, d]
    device = x.device
    if x.ndim != 3 or unembed.ndim != 2 or unembed.shape[1] != x.shape[-1]:
        raise GascanError(
            f"dla needs head outputs [batch, head, d_model] and unembed [vocab, d_model], "
            f"got {tuple(head_out_at_query.shape)} and {tuple(unembed.shape)}",
            "pass lm_head.weight and per-head vectors of the same width",
        )
    if center:
        x = x - x.mean(-1, keepdim=True)
    if norm_weight is not None:
        x = x * norm_weight.to(device, x.dtype)
    if final_norm_scale is not None:
        scale = final_norm_scale.to(device, x.dtype)
        x = x * (scale[:, None, None] if scale.ndim == 1 else scale[:, None, :])
    cand = cand_first_token.to(device)  # [batch, cand]
    mask = (torch.ones_like(cand, dtype=torch.bool) if cand_mask is None else cand_mask.to(device).bool())
    rows = torch.arange(cand.shape[0], device=device)
    g = gold.to(device)
    u = unembed.to(device, x.dtype)[cand]  # [batch, cand, d]
    others = mask.clone()
    others[rows, g] = False
    n_others = others.sum(1, keepdim=True).clamp(min=1)  # [batch, 1]
    other_mean = (u * others[..., None].to(x.dtype)).sum(1) / n_others  # [batch, d]
    direction = u[rows, g] - other_mean  # [batch, d]
    return torch.einsum("bhd,bd->bh", x, direction)


def linearised_norm_scale(norm: torch.nn.Module, resid: torch.Tensor) -> torch.Tensor:
    """The final norm linearised at the clean residual: per-dimension multiplier ``[batch, d_model]``."""
    weight = getattr(norm, "weight", None)
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    if isinstance(norm, torch.nn.LayerNorm):
        denom = torch.sqrt(resid.var(-1, unbiased=False, keepdim=True) + eps)
    else:
        denom = torch.sqrt(resid.pow(2).mean(-1, keepdim=True) + eps)
    w = torch.ones_like(resid[0]) if weight is None else weight.float()
    if type(norm).__name__.startswith("Gemma"):  # Gemma norms scale by (1 + weight)
        w = 1.0 + w
    return w[None, :] / denom
