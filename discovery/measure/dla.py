"""Direct logit attribution per head at the query position: each head's slice of the out-projection
input, projected through its columns, the final norm (linearised at the clean residual) and the
unembedding onto the gold-vs-rest candidate logits."""
from __future__ import annotations

import torch

from discovery.heads import HeadGroup
from discovery.model.loading import LoadedModel
from discovery.tasks.base import AnnotatedBatch


def head_dla(lm: LoadedModel, batch: AnnotatedBatch, groups: list[HeadGroup]) -> dict[tuple[int, str], torch.Tensor]:
    """Direct logit attribution per head ``[head]`` at the query position (final norm frozen)."""
    from discovery.measure import metrics
    from discovery.measure.patterns import model_inputs
    from discovery.model.intervene import Intervener, PassConfig

    device = next(lm.model.parameters()).device
    part = batch.to(device)
    rows = torch.arange(len(batch), device=device)
    captured: dict[tuple[int, str], torch.Tensor] = {}
    norm_in: list[torch.Tensor] = []

    def grab(key):
        def edit(x):
            captured[key] = x[rows, part.query_pos].detach()  # [batch, in_features]
            return x
        return edit

    config = PassConfig(proj_edits={(g.layer, g.kind): grab((g.layer, g.kind)) for g in groups})
    norm = lm.adapter.final_norm()
    handle = norm.register_forward_pre_hook(lambda m, a: norm_in.append(a[0].detach()))
    try:
        with torch.no_grad(), Intervener(lm.adapter).run(config):
            lm.model(**model_inputs(lm.model, part))
    finally:
        handle.remove()
    resid = norm_in[-1][rows, part.query_pos].float()  # [batch, d_model]
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
