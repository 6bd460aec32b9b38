"""The minimal model: the task score of the model cut after each layer, the shallowest depth that keeps
the clean score, and head ablations inside that truncated model."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import polars as pl
import torch

from discovery.errors import GascanError
from discovery.evidence.common import _chance, _clean, _num
from discovery.evidence.positions import position_effects
from discovery.evidence.thresholds import MINIMAL_SCOPES, EvidenceThresholds
from discovery.heads import HeadId
from discovery.measure.ablation import AblationEngine, Progress, query_scores
from discovery.measure.scores import readout_logits
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch


def depth_profile(lm: LoadedModel, batch: AnnotatedBatch, engine: AblationEngine | None = None) -> pl.DataFrame:
    """The task score of the model truncated after each layer: one row per depth ``1..n_layers``.

    Each layer's output at the query position comes from the clean pass of ``engine`` (this batch's, untruncated;
    default a new one), so no pass of its own, and is read out through the final norm and the unembedding; the
    last depth is the model itself. Columns: ``depth`` (layers kept), ``layer`` (the last one), ``acc``, ``logit_diff``,
    ``gold_logprob`` (means over prompts), ``chance`` and the shares of the clean score ``acc_frac``
    (above chance: ``(acc - chance) / (clean acc - chance)``, null when the clean model is not above
    chance by a margin) and ``ld_frac`` (``logit_diff / clean logit_diff``, null when that is <= 0).
    """
    engine = engine or AblationEngine(lm, batch)
    if len(engine.batch) != len(batch) or engine.readout_layer is not None:
        raise ValueError("depth_profile needs the untruncated engine of this batch")
    part = batch.to(engine.device)
    rows = torch.arange(len(part), device=engine.device)
    n_layers = lm.inventory.n_layers
    captured = {i: engine.hidden[i][rows, part.query_pos] for i in range(n_layers)}  # [prompt, d_model] per layer
    # truncated depths read out the candidates' unembedding rows only when the engine checked that shortcut
    # (accuracy and logit difference need nothing else; gold_logprob is then null): a whole-vocabulary
    # readout per layer cost Gemma3-270M 1.4 forward-equivalents. The model itself is read out in full.
    scores = [engine.readout.scores(captured[i][None]) if engine.readout is not None and i < n_layers - 1
              else query_scores(readout_logits(lm.adapter, captured[i])[None], part) for i in range(n_layers)]
    chance = _chance(batch)
    last = scores[-1]
    clean_acc, clean_ld = float(last.acc.mean()), float(last.logit_diff.mean())
    out = []
    for i, s in enumerate(scores):
        acc, ld = float(s.acc.mean()), float(s.logit_diff.mean())
        out.append({
            "depth": i + 1, "layer": i, "acc": acc, "logit_diff": ld,
            "gold_logprob": _num(float(s.gold_logprob.mean())),
            "chance": chance,
            "acc_frac": (acc - chance) / (clean_acc - chance) if clean_acc - chance > 1e-9 else None,
            "ld_frac": ld / clean_ld if clean_ld > 1e-9 else None,
        })
    return pl.DataFrame(out, schema_overrides={"acc_frac": pl.Float64, "ld_frac": pl.Float64, "gold_logprob": pl.Float64})


def minimal_depth(profile: pl.DataFrame, thresholds: EvidenceThresholds | None = None) -> int | None:
    """The shallowest depth whose score keeps ``thresholds.keep`` of the clean score (None: the clean
    model does not do the task, so there is no minimal model)."""
    th = thresholds or EvidenceThresholds()
    last = profile.row(profile.height - 1, named=True)
    if th.depth_metric == "acc" and last["acc"] - last["chance"] < th.min_margin:
        return None
    if last["logit_diff"] <= 0:
        return None
    column = "acc_frac" if th.depth_metric == "acc" else "ld_frac"
    for row in profile.iter_rows(named=True):
        if row[column] is not None and row[column] >= th.keep - 1e-9 and row["logit_diff"] > 0:
            return int(row["depth"])
    return int(last["depth"])


def minimal_model_effects(lm: LoadedModel, batch: AnnotatedBatch, depth: int, heads: Iterable[HeadId] | None = None,
                          *, scopes: Sequence[str] = MINIMAL_SCOPES, bootstrap: int = 1000, seed: int = 0,
                          max_memory_mb: float | None = None, progress: Progress | None = None,
                          engine: AblationEngine | None = None) -> tuple[pl.DataFrame, dict[str, float]]:
    """Head ablations repeated inside the model truncated to ``depth`` layers.

    Returns the :func:`position_effects` table with columns prefixed ``mm_`` (heads of the kept layers
    only) and the truncated model's clean scores (``acc``, ``logit_diff``, ``gold_logprob``, ``chance``).
    ``engine``: an engine of this batch already truncated to ``depth`` (saves its clean pass).
    """
    n_layers = lm.inventory.n_layers
    if not 1 <= depth <= n_layers:
        raise GascanError(f"minimal-model depth {depth} is outside 1..{n_layers}", "pass a depth from the profile")
    if engine is None or engine.readout_layer != depth - 1:
        engine = AblationEngine(lm, batch, readout_layer=depth - 1, max_memory_mb=max_memory_mb)
    frame = position_effects(engine, heads, scopes=scopes, bootstrap=bootstrap, seed=seed, prefix="mm_",
                             progress=progress)
    return frame, _clean(engine)
