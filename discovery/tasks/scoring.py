"""Scoring as lm-evaluation-harness does it, with per-prompt values kept.

* **Next-token scoring** (lettered tasks): the logits at the query position over each candidate's
  first token: accuracy, logit difference (gold minus the mean of the other candidates) and the
  gold token's log-probability under the full vocabulary.
* **Continuation log-likelihood** (labels that are not single tokens, or non-lettered tasks):
  the summed log-probability of every token of each candidate continuation given the prompt;
  accuracy, and ``acc_norm`` (log-likelihood divided by the continuation's UTF-8 byte length).
"""
from __future__ import annotations

from typing import Any

import torch

from discovery.tasks.base import AnnotatedBatch


def query_logits(logits: torch.Tensor, batch: AnnotatedBatch) -> torch.Tensor:
    """``[batch, pos, vocab]`` logits -> ``[batch, vocab]`` at each prompt's query position."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, batch.query_pos.to(logits.device)]


def _cand_mask(batch: AnnotatedBatch, device: torch.device) -> torch.Tensor:
    if batch.cand_mask is not None:
        return batch.cand_mask.to(device)
    return torch.ones(batch.cand_first_token.shape, dtype=torch.bool, device=device)


def next_token_scores(query_logits: torch.Tensor, batch: AnnotatedBatch) -> dict[str, torch.Tensor]:
    """Per-prompt ``acc``, ``logit_diff``, ``gold_logprob`` (each ``[batch]``) and ``cand_logits``.

    ``query_logits``: ``[batch, vocab]``, the next-token logits at ``batch.query_pos``.
    """
    logits = query_logits.float()  # [batch, vocab]
    cand = batch.cand_first_token.to(logits.device)  # [batch, cand]
    scores = candidate_scores(logits.gather(1, cand), batch)
    rows = torch.arange(logits.shape[0], device=logits.device)
    gold = batch.gold.to(logits.device)  # [batch]
    scores["gold_logprob"] = torch.log_softmax(logits, dim=-1)[rows, cand[rows, gold]]
    return scores


def candidate_scores(cand_logits: torch.Tensor, batch: AnnotatedBatch) -> dict[str, torch.Tensor]:
    """:func:`next_token_scores` from the candidates' first-token logits alone (``[batch, cand]``, the batch's
    ``cand_first_token`` order): ``acc`` and ``logit_diff`` need nothing else; ``gold_logprob`` needs the whole
    vocabulary and is NaN (not scored)."""
    device = cand_logits.device
    mask = _cand_mask(batch, device)  # [batch, cand]
    gold = batch.gold.to(device)  # [batch]
    rows = torch.arange(cand_logits.shape[0], device=device)
    cand_logits = cand_logits.float().masked_fill(~mask, float("-inf"))  # [batch, cand]
    gold_logit = cand_logits[rows, gold]  # [batch]
    others = mask.clone()
    others[rows, gold] = False
    other_mean = cand_logits.masked_fill(~others, 0.0).sum(1) / others.sum(1).clamp(min=1)  # [batch]
    return {
        "acc": (cand_logits.argmax(dim=1) == gold).float(),
        "logit_diff": gold_logit - other_mean,
        "gold_logprob": torch.full_like(gold_logit, float("nan")),
        "cand_logits": cand_logits,
    }


@torch.inference_mode()
def continuation_loglik(model: Any, batch: AnnotatedBatch, *, max_tokens: int = 4096) -> torch.Tensor:
    """``[batch, cand]`` summed log-probs of each candidate's tokens given its prompt.

    Each (prompt, candidate) pair is run as ``prompt tokens + candidate tokens[:-1]`` (right padded,
    so positions are those of the unpadded sequence), and the log-probabilities of the candidate's
    tokens are summed, as lm-evaluation-harness does. Pairs are run in chunks of at most
    ``max_tokens`` padded tokens (at least one pair). Padding candidates get ``-inf``.
    """
    device = next(model.parameters()).device
    contexts = [batch.input_ids[i][batch.attention_mask[i].bool()].tolist() for i in range(len(batch))]
    seqs = {
        (i, k): (contexts[i] + batch.cand_tokens[i][k])[:-1]
        for i in range(len(batch)) for k in range(len(batch.cand_tokens[i]))
    }
    pairs = sorted(seqs, key=lambda ik: len(seqs[ik]))  # similar lengths together: less padding
    out = torch.full(batch.cand_first_token.shape, float("-inf"))
    pad = int(batch.input_ids[0, 0]) if len(batch) else 0
    start = 0
    while start < len(pairs):
        stop = start + 1
        while stop < len(pairs) and (stop - start + 1) * len(seqs[pairs[stop]]) <= max_tokens:
            stop += 1
        chunk = pairs[start:stop]
        start = stop
        width = max(len(seqs[ik]) for ik in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)  # [chunk, pos]
        att = torch.zeros(len(chunk), width, dtype=torch.long)  # [chunk, pos]
        for j, ik in enumerate(chunk):
            ids[j, : len(seqs[ik])] = torch.tensor(seqs[ik], dtype=torch.long)
            att[j, : len(seqs[ik])] = 1
        result = model(input_ids=ids.to(device), attention_mask=att.to(device))
        logits = result.logits if hasattr(result, "logits") else result[0]  # [chunk, pos, vocab]
        for j, (i, k) in enumerate(chunk):
            cont = batch.cand_tokens[i][k]
            first = len(contexts[i]) - 1  # the position that predicts the first continuation token
            logprobs = torch.log_softmax(logits[j, first: first + len(cont)].float(), dim=-1)  # [cont, vocab]
            tgt = torch.tensor(cont, dtype=torch.long, device=logprobs.device)
            out[i, k] = logprobs.gather(1, tgt[:, None]).sum().cpu()
    return out


def continuation_scores(loglik: torch.Tensor, batch: AnnotatedBatch) -> dict[str, torch.Tensor]:
    """Per-prompt ``acc`` and ``acc_norm`` (byte-length normalised) from ``[batch, cand]`` log-likelihoods."""
    gold = batch.gold.to(loglik.device)
    nbytes = torch.ones_like(loglik)
    for i, p in enumerate(batch.prompts):
        for k, c in enumerate(p.candidates):
            nbytes[i, k] = max(1, len(c.encode("utf-8")))
    return {
        "loglik": loglik,
        "acc": (loglik.argmax(dim=1) == gold).float(),
        "acc_norm": ((loglik / nbytes).argmax(dim=1) == gold).float(),
        "gold_loglik": loglik[torch.arange(len(gold), device=loglik.device), gold],
    }


def score_batch(model: Any, batch: AnnotatedBatch, *, max_tokens: int = 4096) -> dict[str, torch.Tensor]:
    """Score a batch the way its task asked: next-token at the query or continuation log-likelihood.

    Next-token scoring runs the batch as padded; under left padding the model must be one whose
    positions do not shift with padding, or the batch must be right padded, for exact results.
    """
    if batch.scoring == "continuation":
        return continuation_scores(continuation_loglik(model, batch, max_tokens=max_tokens), batch)
    device = next(model.parameters()).device
    with torch.inference_mode():
        result = model(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device))
    logits = result.logits if hasattr(result, "logits") else result[0]
    return next_token_scores(query_logits(logits, batch), batch)
