"""The engine (and the attribution screen) takes a gascan LoadedModel, an nnsight LanguageModel or a plain transformers model, and
gives identical effects for all three (one engine, whoever wraps the model)."""
from __future__ import annotations

import warnings

import pytest
import torch

from discovery.errors import ModelLoadError
from discovery.measure.ablation import AblationEngine, single_head_ablations
from discovery.measure.attribution import atp_effects
from discovery.model.loading import as_loaded, load_model
from discovery.tasks.base import annotate
from tests.helpers import mc_prompts


def test_nnsight_and_transformers_models_give_identical_effects():
    nnsight = pytest.importorskip("nnsight", reason="nnsight is optional: pip install gascan[nnsight] (dev has it)")

    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(4), lm.tokenizer, padding_side="left")
    ablations = single_head_ablations(lm.inventory.heads(), "zero", ("all",)) + \
        single_head_ablations(lm.inventory.heads(), "mean", ("query",))
    engine = AblationEngine(lm, batch)
    reference = engine.run(ablations)
    assert (reference.logit_diff - engine.clean.logit_diff).abs().max() > 1e-4  # the ablations do something
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = nnsight.LanguageModel(lm.model, tokenizer=lm.tokenizer)
    via_nnsight = AblationEngine(wrapped, batch).run(ablations)
    via_hf = AblationEngine(as_loaded(lm.model, lm.tokenizer), batch).run(ablations)
    for other in (via_nnsight, via_hf):
        assert torch.equal(other.logit_diff, reference.logit_diff)
        assert torch.equal(other.gold_logprob, reference.gold_logprob)
    assert as_loaded(wrapped).model is lm.model
    # the attribution screen takes them too, with identical estimates
    screen = atp_effects(lm, batch, qk_fix=True).estimate
    for handed in (wrapped, as_loaded(lm.model, lm.tokenizer)):
        assert torch.equal(atp_effects(handed, batch, qk_fix=True).estimate, screen)


def test_bad_objects_are_refused_with_a_clear_error():
    with pytest.raises(ModelLoadError, match="cannot use a str"):
        as_loaded("not a model")
    with pytest.raises(ModelLoadError, match="without its tokenizer"):
        as_loaded(load_model("tiny:llama").model)
