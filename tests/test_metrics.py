"""Gather/aggregate/retrieval/DLA metrics on hand-built patterns with hand-computed values."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from discovery.errors import GascanError
from discovery.measure import metrics as M
from discovery.model.tiny import tiny_tokenizer
from discovery.tasks import build_task
from discovery.tasks.base import AnnotatedBatch, Prompt, annotate
from discovery.tasks.scoring import next_token_scores
from tests.helpers import mc_prompts

NAN = float("nan")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def close(a: torch.Tensor, b, **kw) -> bool:
    b = torch.as_tensor(b, dtype=a.dtype)
    return torch.allclose(a, b, equal_nan=True, atol=kw.get("atol", 1e-6), rtol=0)


# ---------------------------------------------------------------------------------------------
# A hand-laid-out prompt: 10 tokens, three segments, query at 9, gold segment 1
# ---------------------------------------------------------------------------------------------


def hand_batch() -> AnnotatedBatch:
    """Segments [1,4) summary 3, [4,7) summary 6, [7,9) summary 8; query 9; gold segment 1."""
    t = 10
    return AnnotatedBatch(
        prompts=[Prompt("x" * t, [(0, 1)], None, 1, [" A", " B", " C"])],
        input_ids=torch.arange(t)[None], attention_mask=torch.ones(1, t, dtype=torch.long),
        seg_start=torch.tensor([[1, 4, 7]]), seg_end=torch.tensor([[4, 7, 9]]),
        seg_mask=torch.ones(1, 3, dtype=torch.bool), summary_pos=torch.tensor([[3, 6, 8]]),
        label_pos=None, query_pos=torch.tensor([9]), gold=torch.tensor([1]), gold_segment=torch.tensor([1]),
        cand_first_token=torch.tensor([[0, 1, 2]]), cand_tokens=[[[0], [1], [2]]], padding_side="right",
    )


def causal_uniform(t: int) -> torch.Tensor:
    """[t, t]: each row uniform over keys 0..q."""
    tri = torch.tril(torch.ones(t, t, dtype=torch.float64))
    return tri / tri.sum(-1, keepdim=True)


def hand_pattern() -> torch.Tensor:
    """[1, 2, 10, 10]: head 0 is a hand-set G&A head, head 1 spreads uniformly (causal)."""
    p = causal_uniform(10)[None, None].repeat(1, 2, 1, 1)
    h0 = p[0, 0]
    h0[3] = 0
    h0[3, [1, 2]] = 0.5  # gathers uniformly over segment 0's other tokens
    h0[6] = 0
    h0[6, [0, 5]] = 0.5  # half outside the segment, half on the previous token
    h0[8] = 0
    h0[8, 7] = 1.0  # the one other token of a two-token segment
    h0[9] = 0
    h0[9, 6], h0[9, 4], h0[9, 3], h0[9, 9] = 0.6, 0.1, 0.2, 0.1  # query: 0.6 on the gold summary
    return p


def test_hand_pattern_gives_hand_computed_values() -> None:
    got = M.pattern_metrics(hand_pattern(), hand_batch())
    # head 0: segment masses from the query 0.2 / 0.7 / 0; head 1: 0.3 / 0.3 / 0.2 (0.1 per key)
    expected = {
        "agg_focus": [0.6, 0.1],
        "agg_focus_segment": [0.7, 0.3],
        "agg_select": [1.0, 0.0],  # head 1 ties segment 0 and 1: not a strict win
        "agg_margin": [0.5, 0.0],
        "selectivity": [0.7 / 0.9, 0.3 / 0.8],
        # head 0: segments 1.0, 0.5, 1.0; head 1 (uniform causal): 2/4, 2/7, 1/9
        "gather_score": [(1 + 0.5 + 1) / 3, (2 / 4 + 2 / 7 + 1 / 9) / 3],
        # head 0: 1 (uniform over 2), 0 (all on the previous token), NaN (one other token)
        "gather_entropy": [0.5, 1.0],
        # segment 0 has no earlier segment (NaN); head 0 reads key 0 (no segment), 5, 7: nothing elsewhere;
        # head 1 (uniform causal): 3 of segment 1's 7 keys lie in segment 0, 6 of segment 2's 9 in 0 and 1
        "gather_cross": [0.0, (3 / 7 + 6 / 9) / 2],
        # the two keys after the gold segment [4, 7) are 7 and 8: head 0 puts nothing there, head 1 0.1 each
        "agg_after": [0.0, 0.2],
    }
    for name, want in expected.items():
        assert close(got[name][0], want), (name, got[name], want)
    # the single-metric functions agree with pattern_metrics
    for name in M.PATTERN_METRICS:
        assert close(getattr(M, name)(hand_pattern(), hand_batch()), got[name]), name
    assert set(M.PATTERN_METRICS) <= set(M.METRICS)


def test_agg_after_sees_a_query_that_reads_just_past_the_gold_segment() -> None:
    """A query row on the next segment's first two tokens (keys 7, 8 after gold [4, 7)) is selection one
    step late: agg_after 0.9 while agg_select is 0 (segment 2 wins). With the gold segment last, the
    window is cut at the sequence end and holds only the query itself."""
    p = hand_pattern()
    p[0, 0, 9] = 0
    p[0, 0, 9, 7], p[0, 0, 9, 8], p[0, 0, 9, 5] = 0.5, 0.4, 0.1
    got = M.pattern_metrics(p, hand_batch())
    assert close(got["agg_after"][0, 0], 0.9) and close(got["agg_select"][0, 0], 0.0)
    last = hand_batch()
    last.gold_segment = torch.tensor([2])  # segment [7, 9): the keys after it are 9 (the query) and 10 (none)
    p[0, 0, 9, 9] = 0.25
    got = M.pattern_metrics(p, last)
    assert close(got["agg_after"][0], [0.25 / 1.25, 0.1], atol=1e-6)


def test_ssm_rows_use_absolute_share_and_zero_rows_are_nan() -> None:
    """A signed, scaled row gives the same metrics as its normalised magnitude; an empty row gives NaN."""
    att = hand_pattern()
    signs = torch.where(torch.rand(att.shape, generator=torch.Generator().manual_seed(0)) > 0.5, 1.0, -1.0)
    ssm = att * signs.double() * 7.5
    a, s = M.pattern_metrics(att, hand_batch()), M.pattern_metrics(ssm, hand_batch())
    for name in M.PATTERN_METRICS:
        assert close(a[name], s[name], atol=1e-9), name
    dead = att.clone()
    dead[0, 1, 9] = 0  # head 1's query row has no mass at all
    d = M.pattern_metrics(dead, hand_batch())
    assert torch.isnan(d["agg_focus"][0, 1]) and torch.isnan(d["selectivity"][0, 1])
    assert d["agg_focus"][0, 0] == pytest.approx(0.6)


def test_prompt_without_segments_or_gold_is_nan() -> None:
    b = hand_batch()
    b.seg_mask = torch.zeros(1, 3, dtype=torch.bool)
    got = M.pattern_metrics(hand_pattern(), b)
    assert all(torch.isnan(v).all() for v in got.values())
    b = hand_batch()
    b.seg_mask = torch.tensor([[True, False, True]])  # the gold segment does not exist
    got = M.pattern_metrics(hand_pattern(), b)
    assert torch.isnan(got["agg_focus"]).all() and torch.isnan(got["agg_select"]).all()
    assert not torch.isnan(got["gather_score"]).any()
    b = hand_batch()
    b.seg_mask = torch.tensor([[False, True, False]])  # only the gold segment: nothing to compare
    got = M.pattern_metrics(hand_pattern(), b)
    assert close(got["agg_focus_segment"][0], [0.7, 0.3])
    for name in ("agg_select", "agg_margin", "selectivity"):
        assert torch.isnan(got[name]).all(), name


def test_pattern_not_matching_batch_is_a_one_line_error() -> None:
    with pytest.raises(GascanError, match="does not match the batch"):
        M.gather_score(hand_pattern()[:, :, :9, :9], hand_batch())
    with pytest.raises(GascanError, match=r"\[batch, head, q, k\]"):
        M.agg_focus(hand_pattern()[0], hand_batch())


def test_summarise_is_nanmean_over_prompts() -> None:
    v = torch.tensor([[1.0, NAN, NAN], [3.0, 2.0, NAN]])
    out = M.summarise({"x": v})
    assert close(out["x"], [2.0, 2.0, NAN])
    with pytest.raises(GascanError):
        M.summarise({"x": torch.ones(3)})


# ---------------------------------------------------------------------------------------------
# Real annotations (tiny byte-level tokenizer), left and right padding
# ---------------------------------------------------------------------------------------------


def real_rows(batch: AnnotatedBatch) -> list[torch.Tensor]:
    return [torch.nonzero(batch.attention_mask[i]).flatten() for i in range(len(batch))]


def place(batch: AnnotatedBatch, per_prompt: list[torch.Tensor]) -> torch.Tensor:
    """Per-prompt [head, L, L] patterns -> [batch, head, T, T] at the batch's real positions."""
    t = batch.input_ids.shape[1]
    out = torch.zeros(len(batch), per_prompt[0].shape[0], t, t, dtype=per_prompt[0].dtype)
    for i, pos in enumerate(real_rows(batch)):
        out[i][:, pos[:, None], pos[None, :]] = per_prompt[i]
    return out


def test_perfect_gatherer_and_previous_token_head_on_real_annotations(tok) -> None:
    batch = annotate(mc_prompts(6), tok, padding_side="left")
    t = batch.input_ids.shape[1]
    pattern = causal_uniform(t)[None, None].repeat(len(batch), 2, 1, 1)
    for i in range(len(batch)):
        for s in range(int(batch.seg_mask[i].sum())):
            a, e, m = (int(batch.seg_start[i, s]), int(batch.seg_end[i, s]), int(batch.summary_pos[i, s]))
            others = [k for k in range(a, e) if k != m]
            assert len(others) >= 2  # real multi-token segments ("A. cat\n")
            pattern[i, 0, m] = 0
            pattern[i, 0, m, others] = 1.0 / len(others)  # head 0: perfect gatherer
    prev = torch.zeros(t, t, dtype=torch.float64)
    prev[torch.arange(1, t), torch.arange(t - 1)] = 1.0
    prev[0, 0] = 1.0
    pattern[:, 1] = prev  # head 1: previous-token head (segments start at their label, so t-1 is inside)
    score, entropy = M.gather_score(pattern, batch), M.gather_entropy(pattern, batch)
    assert close(score[:, 0], [1.0] * len(batch)) and close(entropy[:, 0], [1.0] * len(batch))
    assert close(entropy[:, 1], [0.0] * len(batch)) and close(score[:, 1], [1.0] * len(batch))


@pytest.mark.parametrize("signed", [False, True])
def test_left_and_right_padding_give_the_same_values(tok, signed: bool) -> None:
    prompts = mc_prompts(7)
    left = annotate(prompts, tok, padding_side="left")
    right = annotate(prompts, tok, padding_side="right")
    assert not torch.equal(left.query_pos, right.query_pos)  # padding really moved the positions
    gen = torch.Generator().manual_seed(1)
    per_prompt = []
    for pos in real_rows(left):
        n = len(pos)
        raw = torch.rand(3, n, n, generator=gen, dtype=torch.float64) ** 4  # peaky rows
        if signed:  # SSM-like: signed, unnormalised
            raw = (raw - 0.3) * 5.0
        raw = torch.tril(raw)
        per_prompt.append(raw if signed else raw / raw.sum(-1, keepdim=True))
    a = M.pattern_metrics(place(left, per_prompt), left)
    b = M.pattern_metrics(place(right, per_prompt), right)
    for name in M.PATTERN_METRICS:
        assert close(a[name], b[name], atol=1e-9), name
        assert not torch.isnan(a[name]).any(), name
    assert 0 < a["agg_select"].mean() < 1  # values carry information, not constants


# ---------------------------------------------------------------------------------------------
# Retrieval score
# ---------------------------------------------------------------------------------------------


def niah_batch(tok, side: str) -> AnnotatedBatch:
    prompts = build_task("niah", {"n": 3, "length": 30, "seed": 2}).prompts()
    return annotate(prompts, tok, padding_side=side)


def test_retrieval_inputs_append_gold_and_locate_copy_sources(tok) -> None:
    src = niah_batch(tok, "right")
    new, steps = M.retrieval_batch(src)
    ids, mask, steps2 = M.retrieval_inputs(niah_batch(tok, "left"))
    assert torch.equal(ids, new.input_ids) and torch.equal(mask, new.attention_mask)
    assert torch.equal(steps.sources, steps2.sources) and torch.equal(steps.pred_pos, steps2.pred_pos)
    assert bool(new.attention_mask[:, -1].all())  # left padded: every sequence ends at the last column
    for i in range(len(src)):
        gold = src.cand_tokens[i][int(src.gold[i])]
        n = len(gold)
        assert n >= 2  # " 71432" is several tokens in this tokenizer
        assert steps.target[i, :n].tolist() == gold
        assert int(steps.pred_pos[i, 0]) == int(new.query_pos[i])
        # the position after each predicting position holds the token it predicts (appended gold)
        for j in range(n - 1):
            assert int(new.input_ids[i, steps.pred_pos[i, j] + 1]) == gold[j]
        assert bool(steps.step_mask[i, :n].all())  # the passkey is copyable from the needle
        for j in range(n):
            where = torch.nonzero(steps.sources[i, j]).flatten()
            assert (new.input_ids[i, where] == gold[j]).all()
            g = int(src.gold_segment[i])
            assert (where >= new.seg_start[i, g]).all() and (where < new.seg_end[i, g]).all()
        # moved annotations still point at the same tokens
        assert torch.equal(new.input_ids[i, new.summary_pos[i]], src.input_ids[i, src.summary_pos[i]])


def test_retrieval_score_counts_top_key_copies(tok) -> None:
    new, steps = M.retrieval_batch(niah_batch(tok, "left"))
    b, t = new.input_ids.shape
    pattern = torch.zeros(b, 4, t, t, dtype=torch.float64)
    real = new.attention_mask.bool()
    pattern[:] = (real[:, None, None, :].double() * 0.01)
    expected = torch.zeros(b, 4, dtype=torch.float64)
    for i in range(b):
        n = int(steps.step_mask[i].sum())
        for j in range(n):
            q = int(steps.pred_pos[i, j])
            source = int(torch.nonzero(steps.sources[i, j])[0])
            pattern[i, 0, q, source] = 0.9  # head 0: always copies
            pattern[i, 1, q, q] = 0.9  # head 1: looks at itself
            pattern[i, 2, q, source if j % 2 == 0 else 0] = 0.9  # head 2: copies on even steps only
            pattern[i, 3, q, source] = -5.0  # head 3: SSM-like, largest |value| on the source
        expected[i] = torch.tensor([1.0, 0.0, math.ceil(n / 2) / n, 1.0])
    got = M.retrieval_score(pattern, steps)
    assert close(got, expected)
    assert close(M.retrieval_score(pattern[1:], steps.select(slice(1, None))), expected[1:])


def test_retrieval_without_copy_sources_is_nan(tok) -> None:
    """A gold answer whose tokens do not occur in the gold segment cannot be copied: NaN, not 0."""
    text = "Pairs:\nkey one\nkey two\nAnswer:"
    prompts = [Prompt(text, [(7, 15), (15, 23)], None, 0, [" X", " Y"])]
    new, steps = M.retrieval_batch(annotate(prompts, tok, padding_side="left"))
    t = new.input_ids.shape[1]
    got = M.retrieval_score(torch.ones(1, 2, t, t), steps)
    assert not steps.step_mask.any() and torch.isnan(got).all()


# ---------------------------------------------------------------------------------------------
# Direct logit attribution
# ---------------------------------------------------------------------------------------------


def test_dla_hand_computed_and_equals_ablation_change() -> None:
    unembed = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0]])  # [vocab, d]
    cands, gold = torch.tensor([[0, 1, 2]]), torch.tensor([0])
    heads = torch.tensor([[[2.0, 1.0], [1.0, -1.0]]])  # [batch, head, d]
    # direction u0 - mean(u1, u2) = (0.5, -1)
    assert close(M.dla(heads, unembed, cands, gold), [[0.0, 1.5]])
    weight, scale = torch.tensor([1.0, 0.5]), torch.tensor([2.0])
    # head 0 -> (4, 1) . (0.5, -1) = 1; head 1 -> (2, -1) . (0.5, -1) = 2
    got = M.dla(heads, unembed, cands, gold, scale, norm_weight=weight)
    assert close(got, [[1.0, 2.0]])
    rest = torch.tensor([[0.3, -0.7]])
    fake = SimpleNamespace(cand_first_token=cands, cand_mask=None, gold=gold)

    def logit_diff(resid: torch.Tensor) -> float:
        logits = (resid * weight * scale[:, None]) @ unembed.T  # frozen norm scale
        return float(next_token_scores(logits, fake)["logit_diff"][0])

    full = heads.sum(1) + rest
    for h in range(2):
        change = logit_diff(full) - logit_diff(full - heads[:, h])  # zero-ablate head h at the query
        assert change == pytest.approx(float(got[0, h]), abs=1e-6)


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_dla_heads_plus_rest_equal_total(tok, norm: str) -> None:
    batch = annotate(mc_prompts(5), tok, padding_side="left")
    gen = torch.Generator().manual_seed(3)
    n_heads, width, d, vocab = 3, 4, 16, len(tok)
    proj = torch.nn.Linear(n_heads * width, d, bias=True).double()
    x = torch.randn(len(batch), n_heads * width, generator=gen, dtype=torch.float64)
    other = torch.randn(len(batch), d, generator=gen, dtype=torch.float64)
    unembed = torch.randn(vocab, d, generator=gen, dtype=torch.float64)
    weight = 1 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64)
    with torch.no_grad():  # from the test's own generator: the default init draws from the global RNG, whose
        # state depends on what ran before (one CI run got a head contributing 4e-4 and failed the last check)
        proj.weight.copy_(0.3 * torch.randn(d, n_heads * width, generator=gen, dtype=torch.float64))
        proj.bias.copy_(0.3 * torch.randn(d, generator=gen, dtype=torch.float64))
    heads = M.head_outputs(x, proj.weight.detach(), n_heads, width)  # [batch, head, d]
    with torch.no_grad():
        assert torch.allclose(heads.sum(1), proj(x) - proj.bias, atol=1e-10)
        resid = proj(x) + other  # clean residual at the query
        rest = (proj.bias + other)[:, None, :]  # everything that is not a head
    scale = M.final_norm_scale(resid, 1e-6, norm)
    if norm == "rms":
        normed = resid * torch.rsqrt(resid.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
        bias_term = torch.zeros(len(batch))
    else:
        ln = torch.nn.LayerNorm(d, eps=1e-6).double()
        with torch.no_grad():
            ln.weight.copy_(weight)
            ln.bias.copy_(torch.randn(d, generator=gen, dtype=torch.float64))
            normed = ln(resid)
        bias_term = M.dla(ln.bias.detach()[None, None].expand(len(batch), 1, d), unembed,
                          batch.cand_first_token, batch.gold)[:, 0]
    total = next_token_scores(normed @ unembed.T, batch)["logit_diff"]
    kw = {"norm_weight": weight, "center": norm == "layer"}
    per_head = M.dla(heads, unembed, batch.cand_first_token, batch.gold, scale, **kw)
    rest_part = M.dla(rest, unembed, batch.cand_first_token, batch.gold, scale, **kw)[:, 0]
    assert per_head.shape == (len(batch), n_heads)
    assert torch.allclose(per_head.sum(1) + rest_part + bias_term, total.double(), atol=1e-4)
    assert per_head.abs().min() > 1e-3  # every head contributes something: the check is not vacuous


# ---------------------------------------------------------------------------------------------
# End to end: patterns streamed from real tiny models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "mamba2"])
def test_streamed_patterns_give_padding_independent_metrics(arch: str) -> None:
    """Streamed attention and implicit-attention patterns: same metrics under left and right padding."""
    from discovery.measure.patterns import collect_patterns
    from discovery.model.loading import load_model

    lm = load_model(f"tiny:{arch}")
    prompts = mc_prompts(4)
    per_side = {}
    for side in ("left", "right"):
        batch = annotate(prompts, lm.tokenizer, padding_side=side)
        per_side[side] = {key: M.pattern_metrics(p, batch) for key, p in collect_patterns(lm, batch).items()}
    assert len(per_side["left"]) == 3
    for key, values in per_side["left"].items():
        for name in M.PATTERN_METRICS:
            assert values[name].shape == (4, lm.inventory.group(*key).count)
            assert not values[name].isnan().any(), (key, name)
            assert torch.allclose(values[name], per_side["right"][key][name], atol=1e-5), (key, name)
