"""The read test: knock out a gather candidate at the segments and watch each later aggregate head
(its selectivity / agg_select and its direct logit effect at the query)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import polars as pl
import torch

from discovery.evidence.common import _num
from discovery.evidence.thresholds import EvidenceThresholds
from discovery.heads import HeadId
from discovery.measure.ablation import Ablation, AblationEngine
from discovery.measure.metrics import SELECTION_METRICS, linearised_norm_scale, selection
from discovery.measure.patterns import group_pattern, watch_passes_fe


def _reader_values(engine: AblationEngine, readers: Sequence[HeadId], ablation: Ablation | None
                   ) -> dict[HeadId, dict[str, float | None]]:
    """Selectivity, agg_select (attention readers) and direct logit effect at the query of each reader,
    in one pass with ``ablation`` applied (None: clean)."""
    batch = engine.batch
    rows = torch.arange(len(batch), device=engine.device)
    config = engine.plan([ablation]) if ablation is not None else engine.plan([])
    by_group: dict[tuple[int, str], list[HeadId]] = {}
    for h in readers:
        by_group.setdefault((h.layer, h.kind), []).append(h)
    inputs: dict[tuple[int, str], torch.Tensor] = {}
    probs: dict[tuple[int, str], torch.Tensor] = {}  # [batch, head, q, k] per reader group
    for (layer, kind) in by_group:
        previous = config.proj_edits.get((layer, kind))

        def grab(x: torch.Tensor, key=(layer, kind), previous=previous) -> torch.Tensor:  # x [batch, pos, in]
            x = previous(x) if previous is not None else x
            inputs[key] = x[rows, batch.query_pos].detach().float()  # [batch, in]
            return x

        config.proj_edits[(layer, kind)] = grab
        group = engine.inventory.group(layer, kind)
        if group.pattern == "attention":
            config.prob_sinks[layer] = lambda p, key=(layer, kind): probs.__setitem__(key, p.detach().float())
        else:  # SSM readers: their implicit attention, as the pattern pass computes it
            config.mixer_sinks[layer] = _implicit_sink(engine, group, probs, config.mixer_sinks.get(layer))
    engine.watch(config, [layer for layer, _ in by_group])  # from the ablated layer to the last reader
    with torch.no_grad():
        return _reader_readout(engine, by_group, inputs, probs)


def _implicit_sink(engine: AblationEngine, group: Any, probs: dict, previous: Callable | None) -> Callable:
    """A mixer sink that stores an SSM group's implicit attention ``[batch, head, q, k]`` in ``probs``."""
    from discovery.model import ssm

    mixer = engine.lm.adapter.mixer(group.layer, group.kind)

    def sink(hidden: torch.Tensor, mask: torch.Tensor | None) -> None:
        if previous is not None:
            previous(hidden, mask)
        pattern, _ = group_pattern(group, ssm.ssm_components(mixer, hidden, mask))
        probs[(group.layer, group.kind)] = pattern.detach().float()

    return sink


def _reader_readout(engine: AblationEngine, by_group: Mapping[tuple[int, str], list[HeadId]],
                    inputs: Mapping[tuple[int, str], torch.Tensor],
                    probs: Mapping[tuple[int, str], torch.Tensor]
                    ) -> dict[HeadId, dict[str, float | None]]:
    """The readers' values from the captured out-projection inputs and attention probabilities."""
    from discovery.measure import metrics

    lm, batch = engine.lm, engine.batch
    rows = torch.arange(len(batch), device=engine.device)
    last = engine.n_active_layers - 1
    resid = engine.hidden[last][rows, batch.query_pos].float()  # clean final residual [batch, d_model]
    norm = lm.adapter.final_norm()
    scale = linearised_norm_scale(norm, resid)  # [batch, d_model]
    unembed = lm.adapter.unembed().weight.float()  # [vocab, d_model]
    out: dict[HeadId, dict[str, float | None]] = {}
    for (layer, kind), heads in by_group.items():
        group = engine.inventory.group(layer, kind)
        head_out = metrics.group_head_outputs(inputs[(layer, kind)], lm.adapter.out_proj_weight(layer, kind).float(),
                                              group)  # [batch, head, d_model]
        dla = metrics.dla(head_out * scale[:, None, :], unembed, batch.cand_first_token, batch.gold, None,
                          center=isinstance(norm, torch.nn.LayerNorm), cand_mask=batch.cand_mask)  # [batch, head]
        found = metrics.pattern_metrics(probs[(layer, kind)], batch) if (layer, kind) in probs else {}
        for h in heads:
            values: dict[str, float | None] = {"dla": _num(dla[:, h.index].mean())}
            for name in ("selectivity", *SELECTION_METRICS):
                values[name] = _num(torch.nanmean(found[name][:, h.index])) if name in found else None
            values["selection"] = selection(values) if found else None
            out[h] = values
    return out


def read_pairs(engine: AblationEngine, gathers: Sequence[HeadId], readers: Sequence[HeadId]
               ) -> list[tuple[HeadId, HeadId]]:
    """The (gather, reader) pairs a read test watches: every reader in a later layer the engine reads out."""
    return [(g, r) for g in gathers for r in readers if r.layer > g.layer and r.layer < engine.n_active_layers]


def read_test_cost(engine: AblationEngine, gathers: Sequence[HeadId], readers: Sequence[HeadId]) -> float:
    """What :func:`read_test` costs in forward-equivalents: the readers' layers clean, then each gather
    candidate's pass from its own layer to its last reader's."""
    return watch_passes_fe(engine, read_pairs(engine, gathers, readers))


def read_test(engine: AblationEngine, gathers: Sequence[HeadId], readers: Sequence[HeadId],
              thresholds: EvidenceThresholds | None = None, *, scope: Sequence[str] = ("segment",)) -> pl.DataFrame:
    """Knock out each gather candidate at ``scope`` (default: the segment positions) and watch every
    reader in a later layer: its selectivity and ``agg_select`` (attention readers) and its direct logit
    effect at the query (final norm frozen at the clean run). One row per (gather, reader) pair;
    ``reads`` is true when the reader's direct effect falls by ``thresholds.read`` of its clean value
    (which must itself be >= noise * clean logit difference) or its selectivity / selection
    (:func:`~discovery.metrics.selection`) falls by ``thresholds.read_select``."""
    th = thresholds or EvidenceThresholds()
    clean_ld = float(engine.clean.logit_diff.mean())
    pairs = read_pairs(engine, gathers, readers)
    columns = ["gather", "reader", "select_clean", "select_ablated", "agg_select_clean", "agg_select_ablated",
               "dla_clean", "dla_ablated", "dla_drop", "reads"]
    if not pairs:
        return pl.DataFrame(schema={c: (pl.Utf8 if c in ("gather", "reader") else
                                        pl.Boolean if c == "reads" else pl.Float64) for c in columns})
    watch = sorted({r for _, r in pairs})
    clean = _reader_values(engine, watch, None)
    rows = []
    for g in sorted({g for g, _ in pairs}):
        mine = [r for gg, r in pairs if gg == g]
        under = _reader_values(engine, mine, Ablation((g,), "zero", tuple(scope), label=f"read:{g}"))
        for r in mine:
            c, u = clean[r], under[r]
            dla_drop = None
            if c["dla"] is not None and u["dla"] is not None and c["dla"] > max(th.noise * clean_ld, 1e-9):
                dla_drop = (c["dla"] - u["dla"]) / c["dla"]
            sel_fall = [c[k] - u[k] for k in ("selectivity", "selection") if c[k] is not None and u[k] is not None]
            reads = (dla_drop is not None and dla_drop >= th.read) or any(f >= th.read_select for f in sel_fall)
            rows.append({"gather": str(g), "reader": str(r), "select_clean": c["selectivity"],
                         "select_ablated": u["selectivity"], "agg_select_clean": c["agg_select"],
                         "agg_select_ablated": u["agg_select"], "dla_clean": c["dla"], "dla_ablated": u["dla"],
                         "dla_drop": dla_drop, "reads": bool(reads)})
    return pl.DataFrame(rows, schema_overrides={c: pl.Float64 for c in columns[2:-1]}, infer_schema_length=None)
