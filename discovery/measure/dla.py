"""Direct logit attribution per head at the query position: each head's slice of the out-projection
input, projected through its columns, the final norm (linearised at the clean residual) and the
unembedding onto the gold-vs-rest candidate logits."""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from discovery.heads import HeadGroup
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch

if TYPE_CHECKING:
    from discovery.measure.ablation import AblationEngine


def head_dla(lm: LoadedModel, batch: AnnotatedBatch, groups: list[HeadGroup],
             engine: AblationEngine | None = None) -> dict[tuple[int, str], torch.Tensor]:
    """Direct logit attribution per head ``[head]`` at the query position (final norm frozen).

    Given the ``engine`` of this batch, from what its clean pass kept (each group's out-projection input at
    the query, the last layer's output): no forward of its own."""
    from discovery.measure.patterns import model_inputs
    from discovery.model.intervene import Intervener, PassConfig

    device = next(lm.model.parameters()).device
    part = batch.to(device)
    rows = torch.arange(len(batch), device=device)
    norm = lm.adapter.final_norm()
    if engine is not None and engine.readout_layer is None:
        if len(engine.batch) != len(batch):
            raise ValueError("the engine was built on another batch; pass the engine of this batch")
        captured = engine.query_inputs  # (layer, kind) -> [batch, in_features]
        resid = engine.hidden[lm.inventory.n_layers - 1][rows, part.query_pos].float()  # [batch, d_model]
    else:
        captured: dict[tuple[int, str], torch.Tensor] = {}
        norm_in: list[torch.Tensor] = []

        def grab(key):
            def edit(x):
                captured[key] = x[rows, part.query_pos].detach()  # [batch, in_features]
                return x
            return edit

        config = PassConfig(proj_edits={(g.layer, g.kind): grab((g.layer, g.kind)) for g in groups})
        handle = norm.register_forward_pre_hook(lambda m, a: norm_in.append(a[0].detach()))
        inputs = model_inputs(lm.model, part)
        if "logits_to_keep" in inspect.signature(lm.model.forward).parameters:
            inputs["logits_to_keep"] = 1  # the final norm's input is all it needs
        try:
            with torch.no_grad(), Intervener(lm.adapter).run(config):
                lm.model(**inputs)
        finally:
            handle.remove()
        resid = norm_in[-1][rows, part.query_pos].float()  # [batch, d_model]
    with torch.no_grad():
        return _group_dla(lm, part, groups, captured, norm, resid)


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
