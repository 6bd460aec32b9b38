"""Per-head ``[query, key]`` patterns, streamed layer by layer.

Attention heads: softmax probabilities (gascan's attention function computes them eagerly only for
the captured layers). SSM heads: the exact implicit attention of :mod:`discovery.ssm`, from the
mixer's captured input (Mamba-2 per head; Mamba-1 per channel group, the mean of its channels),
with the ``D`` skip passed separately. Nothing is kept for all layers at once: each layer's pattern
is handed to a callback as soon as it is computed, and prompts are processed in chunks.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from discovery.heads import HeadGroup, HeadId
from discovery.model.intervene import Intervener, PassConfig
from discovery.model.loading import LoadedModel
from discovery.model.ssm import SSMComponents
from discovery.tasks.base import AnnotatedBatch

if TYPE_CHECKING:
    from discovery.measure.ablation import AblationEngine

# (group, prompt rows, pattern [batch, head, q, k], extras e.g. {"D": [head]}) -> None
PatternSink = Callable[[HeadGroup, slice, torch.Tensor, dict], None]


def model_inputs(model: torch.nn.Module, batch: AnnotatedBatch) -> dict[str, torch.Tensor]:
    """Forward kwargs for a (left- or right-padded) batch, with mask-aware position ids."""
    mask = batch.attention_mask
    kwargs = {"input_ids": batch.input_ids, "attention_mask": mask, "use_cache": False}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    return kwargs


def group_pattern(group: HeadGroup, comp: SSMComponents) -> tuple[torch.Tensor, torch.Tensor]:
    """An SSM group's patterns ``[batch, head, q, k]`` and ``D`` skips ``[head]`` from its mixer's components:
    Mamba-2 per head; Mamba-1 per channel group (the mean of its channels), then its refined channel heads."""
    from discovery.model import ssm

    if group.pattern != "mamba1":
        return ssm.implicit_attention(comp), comp.D
    pattern = ssm.implicit_attention(comp, channel_group=group.width)
    d_skip = comp.D.view(group.count, group.width).mean(-1)
    if group.spans:
        pattern = torch.cat([pattern, ssm.span_attention(comp, group.spans)], dim=1)
        d_skip = torch.cat([d_skip, torch.stack([comp.D[s:e].mean() for s, e in group.spans])])
    return pattern, d_skip


def for_each_pattern(lm: LoadedModel, batch: AnnotatedBatch, sink: PatternSink, *,
                     layers: Iterable[int] | None = None, kinds: Iterable[str] = ("attn", "ssm"),
                     chunk_prompts: int = 8, edits_for: Callable[[slice], PassConfig] | None = None,
                     engine: AblationEngine | None = None) -> None:
    """Call ``sink`` once per (layer, kind, prompt chunk) with that group's patterns.

    ``edits_for(rows)`` optionally returns the Intervener edits to apply to those prompts (e.g.
    ``lambda rows: engine.plan([Ablation((gather_head,))], rows)``): patterns under an ablation, for
    the pair interaction test. Every pass stops after the last wanted layer (patterns need no logits);
    given the ``engine`` of this batch, it also starts at the first layer it edits or reads, from the
    engine's clean hidden states (:meth:`~discovery.measure.ablation.AblationEngine.watch`).
    """
    from discovery.model import ssm

    wanted_layers = set(range(lm.inventory.n_layers) if layers is None else layers)
    groups = [g for g in lm.inventory.groups if g.layer in wanted_layers and g.kind in set(kinds)]
    if not groups:
        return
    if engine is not None and len(engine.batch) != len(batch):
        raise ValueError("the engine was built on another batch; pass the engine of this batch")
    last = max(g.layer for g in groups)
    intervener = Intervener(lm.adapter)
    device = next(lm.model.parameters()).device
    for start in range(0, len(batch), chunk_prompts):
        rows = slice(start, min(start + chunk_prompts, len(batch)))
        config = edits_for(rows) if edits_for is not None else PassConfig()
        for group in groups:
            if group.pattern == "attention":
                config.prob_sinks[group.layer] = lambda p, g=group, r=rows: sink(g, r, p.detach(), {})
            else:
                mixer = lm.adapter.mixer(group.layer, group.kind)

                def on_mixer(hidden, mask, g=group, r=rows, mixer=mixer):
                    pattern, d_skip = group_pattern(g, ssm.ssm_components(mixer, hidden, mask))
                    sink(g, r, pattern, {"D": d_skip})

                config.mixer_sinks[group.layer] = on_mixer
        if engine is not None:
            engine.watch(config, [g.layer for g in groups], rows)
            continue
        config.halt_after = last
        with torch.no_grad(), intervener.run(config):
            lm.model(**model_inputs(lm.model, batch.select(rows).to(device)))


def watch_passes_fe(engine: AblationEngine, pairs: Sequence[tuple[HeadId, HeadId]]) -> float:
    """What reading heads under single-head ablations costs through ``engine.watch``, in forward-equivalents:
    for ``(ablated, watched)`` pairs, one clean pass over the watched heads' layers and one pass per ablated
    head from its layer to the last of its watched heads' (the read test, patterns under ablation)."""
    if not pairs:
        return 0.0
    watched = [w.layer for _, w in pairs]
    return engine.predicted_watch_fe(min(watched), max(watched)) + sum(
        engine.predicted_watch_fe(a.layer, max(w.layer for a2, w in pairs if a2 == a)) for a in {a for a, _ in pairs})


def pattern_metric_values(lm: LoadedModel, batch: AnnotatedBatch, *, layers: Iterable[int] | None = None,
                          kinds: Iterable[str] = ("attn", "ssm"), chunk_prompts: int = 8,
                          edits_for: Callable[[slice], PassConfig] | None = None,
                          on_chunk: Callable[[], None] | None = None, engine: AblationEngine | None = None) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """Every pattern metric per prompt, ``{(layer, kind): {name: [batch, head]}}`` (NaN where undefined).

    The one loop from patterns to metrics (scan, ground truth and the pair test all call it), so the
    patterns are never held beyond one chunk. ``on_chunk`` is called after each (group, chunk), for
    progress bars; ``edits_for`` and ``engine`` are passed to :func:`for_each_pattern`.
    """
    from discovery.measure import metrics

    parts: dict[tuple[int, str], dict[str, list[torch.Tensor]]] = {}

    def sink(group, rows, pattern, extras) -> None:  # pattern [batch, head, q, k]
        found = metrics.pattern_metrics(pattern.float(), batch.select(rows))
        named = parts.setdefault((group.layer, group.kind), {})
        for name, values in found.items():
            named.setdefault(name, []).append(values.cpu())
        if on_chunk is not None:
            on_chunk()

    for_each_pattern(lm, batch, sink, layers=layers, kinds=kinds, chunk_prompts=chunk_prompts, edits_for=edits_for,
                     engine=engine)
    return {key: {name: torch.cat(v) for name, v in named.items()} for key, named in parts.items()}


def collect_patterns(lm: LoadedModel, batch: AnnotatedBatch, **kwargs) -> dict[tuple[int, str], torch.Tensor]:
    """All patterns as ``{(layer, kind): [batch, head, q, k]}`` — for small models, tests and figures."""
    parts: dict[tuple[int, str], list[torch.Tensor]] = {}
    for_each_pattern(lm, batch, lambda g, r, p, e: parts.setdefault((g.layer, g.kind), []).append(p.cpu()), **kwargs)
    return {k: torch.cat(v) for k, v in parts.items()}
