"""Evidence standards: the minimal model's readout, position-resolved effects, group ablations against
random controls, and verdicts on a planted circuit with a redundant aggregate head and on the toy model
trained on single-word options (a model full of decoys)."""
from __future__ import annotations

import copy

import pytest
import torch

from discovery.ablation import AblationEngine, single_head_ablations
from discovery.loading import LoadedModel, load_model
from discovery.models.adapter import adapter_for
from discovery.tasks.base import annotate
from tests.helpers import mc_prompts


def _truncated_copy(lm: LoadedModel, keep: int) -> LoadedModel:
    """The model with only its first ``keep`` layers (a real truncation, for reference)."""
    model = copy.deepcopy(lm.model)
    del adapter_for(model).layers()[keep:]
    model.config.num_hidden_layers = keep
    for name in ("layers_block_type", "n_layer"):
        value = getattr(model.config, name, None)
        if isinstance(value, list):
            setattr(model.config, name, value[:keep])
        elif value is not None:
            setattr(model.config, name, keep)
    return LoadedModel(model, lm.tokenizer, adapter_for(model), lm.spec + f"[:{keep}]")


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_readout_layer_equals_a_truncated_model(arch):
    """AblationEngine(readout_layer=k) gives the scores of the model cut after layer k, for clean runs and
    for ablations (full-sequence and query fast path), at the truncated model's cost."""
    lm = load_model(f"tiny:{arch}")
    batch = annotate(mc_prompts(4), lm.tokenizer, padding_side="left")
    engine = AblationEngine(lm, batch, readout_layer=1)
    reference = AblationEngine(_truncated_copy(lm, 2), batch)
    heads = [h for h in lm.inventory.heads() if h.layer <= 1 and h.index < 2]
    ablations = single_head_ablations(heads) + single_head_ablations(heads, scope=("query",))
    ours, theirs = engine.run(ablations), reference.run(ablations)
    assert torch.allclose(engine.clean.logit_diff, reference.clean.logit_diff, atol=1e-5)
    assert torch.allclose(ours.logit_diff, theirs.logit_diff, atol=1e-5)
    assert (ours.logit_diff - engine.clean.logit_diff).abs().max() > 1e-3  # the ablations do something
    assert engine.layer_rows == reference.layer_rows
    full = AblationEngine(lm, batch)
    assert (full.clean.logit_diff - engine.clean.logit_diff).abs().max() > 1e-3  # truncation is not a no-op
    with pytest.raises(ValueError, match="after readout layer"):
        engine.run(single_head_ablations([lm.inventory.heads()[-1]]))
