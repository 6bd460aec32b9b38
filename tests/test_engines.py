"""One process's engines (discovery.measure.engines): a stage that gets a cached engine skips the clean pass,
then plans and scores exactly as on a fresh engine; another batch or model gets its own engine."""
from __future__ import annotations

import pytest
import torch

from discovery.heads import HeadId
from discovery.measure.ablation import Ablation, AblationEngine
from discovery.measure.engines import EngineCache
from discovery.model.loading import load_model
from discovery.tasks.base import annotate
from tests.helpers import mc_prompts


def _later_stage(heads: list[HeadId]) -> list[Ablation]:
    """What a later stage asks for: query-scoped (the fast path's prefix), mean and held ablations."""
    return [Ablation((heads[0],), "zero", ("query",)), Ablation((heads[1],), "mean", ("all",)),
            Ablation((heads[2],), "zero", ("segment",), hold=(heads[3],))]


def test_a_cached_engine_plans_and_scores_as_a_fresh_one():
    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(4), lm.tokenizer, padding_side="left")
    heads = list(lm.inventory.heads())
    cache = EngineCache()
    first = cache.engine("mc", lm, batch)
    first.run(_later_stage(heads))  # an earlier stage kept the prefix, mean and held values
    rebuilt = annotate(mc_prompts(4), lm.tokenizer, padding_side="left")  # the next stage rebuilds its batch
    again = cache.engine("mc", lm, rebuilt)
    assert again is first and (cache.built, cache.reused) == (1, 1)

    fresh = AblationEngine(lm, rebuilt)
    asked = _later_stage(heads)
    predicted = again.predicted_forward_equivalents(asked)
    assert predicted == fresh.predicted_forward_equivalents(asked) > 0
    before = again.layer_rows
    got, want = again.run(asked), fresh.run(asked)
    for metric in ("acc", "logit_diff", "gold_logprob"):
        assert torch.allclose(got[metric], want[metric], atol=1e-5)
    assert (again.layer_rows - before) / (again.n_prompts * lm.inventory.n_layers) == pytest.approx(predicted)


def test_another_batch_or_model_gets_its_own_engine():
    lm = load_model("tiny:llama")
    cache = EngineCache()
    one = cache.engine("mc", lm, annotate(mc_prompts(4), lm.tokenizer, padding_side="left"))
    other = cache.engine("mc", lm, annotate(mc_prompts(3), lm.tokenizer, padding_side="left"))
    assert other is not one and len(other.batch) == 3
    twin = load_model("tiny:llama")
    third = cache.engine("mc", twin, annotate(mc_prompts(3), twin.tokenizer, padding_side="left"))
    assert third is not other and (cache.built, cache.reused) == (3, 0)
