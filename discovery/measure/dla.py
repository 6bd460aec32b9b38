"""Direct logit attribution per head at the query position: each head's slice of the out-projection
input, projected through its columns, the final norm (linearised at the clean residual) and the
unembedding onto the gold-vs-rest candidate logits."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from discovery.heads import HeadGroup
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch

if TYPE_CHECKING:
    from discovery.measure.ablation import AblationEngine


def head_dla(lm: LoadedModel, batch: AnnotatedBatch, groups: list[HeadGroup],
             engine: AblationEngine | None = None) -> dict[tuple[int, str], torch.Tensor]:
    """Direct logit attribution per head ``[head]`` at the query position (final norm frozen), from what the
    clean pass of ``engine`` (this batch's; default a new one) kept: each group's out-projection input at the
    query and the last layer's output, so it runs no forward of its own."""
    from discovery.measure.ablation import AblationEngine

    engine = engine or AblationEngine(lm, batch)
    if len(engine.batch) != len(batch) or engine.readout_layer is not None:
        raise ValueError("head_dla needs the untruncated engine of this batch")
    part = batch.to(engine.device)
    rows = torch.arange(len(batch), device=engine.device)
    resid = engine.hidden[lm.inventory.n_layers - 1][rows, part.query_pos].float()  # [batch, d_model]
    with torch.no_grad():
        return _group_dla(lm, part, groups, engine.query_inputs, lm.adapter.final_norm(), resid)


def _group_dla(lm: LoadedModel, part: AnnotatedBatch, groups: list[HeadGroup], captured: dict, norm: torch.nn.Module,
               resid: torch.Tensor) -> dict[tuple[int, str], torch.Tensor]:
    """Each group's per-head DLA ``[head]`` from its captured query inputs and the clean final residual."""
    from discovery.measure import metrics

    scale = metrics.linearised_norm_scale(norm, resid)  # [batch, d_model]
    unembed = lm.adapter.unembed().weight.float()  # [vocab, d_model]
    out = {}
    for g in groups:
        key = (g.layer, g.kind)
        heads = metrics.group_head_outputs(captured[key].float(), lm.adapter.out_proj_weight(g.layer, g.kind).float(),
                                           g)  # [batch, head, d_model], refined heads after the group's
        values = metrics.dla(heads * scale[:, None, :], unembed, part.cand_first_token, part.gold, None,
                             center=isinstance(norm, torch.nn.LayerNorm), cand_mask=part.cand_mask)
        out[key] = torch.nanmean(values.cpu(), dim=0)
    return out
