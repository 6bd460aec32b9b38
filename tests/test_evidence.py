"""Evidence standards: the minimal model's readout, position-resolved effects, group ablations against
random controls, and verdicts on a planted circuit with a redundant aggregate head and on the toy model
trained on single-word options (a model full of decoys)."""
from __future__ import annotations

import copy

import pytest
import torch

from discovery.measure.ablation import AblationEngine, single_head_ablations
from discovery.measure.flops import MatmulFlops
from discovery.model.adapter import adapter_for
from discovery.model.loading import LoadedModel, load_model
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
    with MatmulFlops() as our_flops:
        ours = engine.run(ablations)
    with MatmulFlops() as their_flops:
        theirs = reference.run(ablations)
    assert torch.allclose(engine.clean.logit_diff, reference.clean.logit_diff, atol=1e-5)
    assert torch.allclose(ours.logit_diff, theirs.logit_diff, atol=1e-5)
    assert (ours.logit_diff - engine.clean.logit_diff).abs().max() > 1e-3  # the ablations do something
    assert our_flops.total == their_flops.total > 0  # the truncated model's cost: later layers do not run
    full = AblationEngine(lm, batch)
    assert (full.clean.logit_diff - engine.clean.logit_diff).abs().max() > 1e-3  # truncation is not a no-op
    with pytest.raises(ValueError, match="after readout layer"):
        engine.run(single_head_ablations([lm.inventory.heads()[-1]]))


# ---------------------------------------------------------------------------------------------
# A planted circuit whose aggregate head has a redundant copy
# ---------------------------------------------------------------------------------------------

LETTERS = (" A", " B", " C", " D")
D_MODEL, N_HEADS, HEAD_DIM = 64, 8, 16
CONST, LETTER, MARK, GATHERED, OUT, JUNK = 0, 1, 5, 6, 10, 20  # residual layout
GATHER, COPIES, DECOY = (0, 0), ((1, 0), (1, 1)), (1, 2)


def redundant_circuit(copies: int = 2) -> LoadedModel:
    """A 2-layer attention-only Llama, weights set by hand (MLPs zero, norm weights 1).

    Prompt ``Pick: A p B y C q D r\\nAnswer:`` (segments ``A p``..., summary token = the option word; the
    gold option is the one whose word is ``y``). L0H0 is a previous-token head (RoPE-only pattern) that
    copies each option's letter into the word's "gathered" dimensions. L1H0 and L1H1 are identical
    aggregate heads: the query attends to the word marked ``y`` and copies its gathered letter into output
    dimensions that the unembedding reads as " A".." D". The final RMSNorm makes the two copies
    redundant: one copy alone yields nearly the same normalised logits, both ablated leave none. L1H2
    attends like them but writes nothing (a decoy). The other heads attend uniformly and write nothing.
    With ``copies=1`` L1H1 keeps its pattern but writes nothing: one clean aggregate head and two decoys.
    """
    import math

    from transformers import LlamaConfig, LlamaForCausalLM

    from discovery.model.tiny import TINY_VOCAB, tiny_tokenizer

    tok = tiny_tokenizer()
    config = LlamaConfig(hidden_size=D_MODEL, intermediate_size=16, num_hidden_layers=2, num_attention_heads=N_HEADS,
                         num_key_value_heads=N_HEADS, head_dim=HEAD_DIM, vocab_size=TINY_VOCAB,
                         max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()

    def token(text: str) -> int:
        (index,) = tok(text, add_special_tokens=False)["input_ids"]
        return index

    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        emb = model.model.embed_tokens.weight  # [vocab, d_model]
        emb[:, CONST] = 1.0
        for t in range(TINY_VOCAB):  # every token: constant + one identity dimension (same RMS for all)
            emb[t, JUNK + t % (D_MODEL - JUNK)] = 1.0
        special = {token(x): LETTER + k for k, x in enumerate(LETTERS)} | {token(" y"): MARK}
        for t, dim in special.items():
            emb[t, JUNK + t % (D_MODEL - JUNK)] = 0.0
            emb[t, dim] = 1.0
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        normed = math.sqrt(D_MODEL / 2)  # a (constant + indicator) embedding after RMSNorm
        theta = float(model.config.rope_parameters["rope_theta"])
        gather = model.model.layers[0].self_attn
        for i in range(3):  # fast RoPE pairs: score peaks at distance 1 (previous token)
            omega = theta ** (-2 * i / HEAD_DIM)
            gather.k_proj.weight[i, CONST] = 1.8
            gather.q_proj.weight[i, CONST] = 1.8 * math.cos(omega)
            gather.q_proj.weight[i + HEAD_DIM // 2, CONST] = -1.8 * math.sin(omega)
        for k in range(4):
            gather.v_proj.weight[k, LETTER + k] = 1.0
            gather.o_proj.weight[GATHERED + k, k] = 1.0 / normed
        agg = model.model.layers[1].self_attn
        for h in (COPIES[0][1], COPIES[1][1], DECOY[1]):  # a static RoPE pair: query finds the marked word
            agg.q_proj.weight[h * HEAD_DIM + HEAD_DIM - 1, CONST] = 1.75
            agg.k_proj.weight[h * HEAD_DIM + HEAD_DIM - 1, MARK] = 1.75
        for _, h in COPIES[:copies]:
            for k in range(4):
                agg.v_proj.weight[h * HEAD_DIM + k, GATHERED + k] = 1.0
                agg.o_proj.weight[OUT + k, h * HEAD_DIM + k] = 3.0
        for k, x in enumerate(LETTERS):
            model.lm_head.weight[token(x), OUT + k] = 1.0
    return LoadedModel(model, tok, adapter_for(model), "planted-redundant")


def redundant_prompts(n: int, seed: int = 0) -> list:
    import random

    from discovery.tasks.base import Prompt, TextBuilder

    rng = random.Random(seed)
    out = []
    for i in range(n):
        b = TextBuilder()
        b.add("Pick" + " one" * (i % 3) + ":")
        gold = rng.randrange(4)
        words = rng.sample("pqrstuvw", 4)
        segments, labels = [], []
        for k in range(4):
            b.add(" ")
            start = len(b)
            b.add(f"{'ABCD'[k]} {'y' if k == gold else words[k]}")
            segments.append((start, len(b)))
            labels.append((start, start + 1))
        b.add("\nAnswer:")
        out.append(Prompt(b.text, segments, labels, gold, list(LETTERS), meta={"index": i}))
    return out


def pattern_table(lm: LoadedModel, batch):
    """The scan's pattern columns (per-head means over prompts) for a hand-made batch."""
    import polars as pl

    from discovery.measure import metrics
    from discovery.measure.patterns import collect_patterns

    rows = []
    for (layer, kind), pattern in collect_patterns(lm, batch).items():
        values = metrics.summarise(metrics.pattern_metrics(pattern.float(), batch))
        for h in range(pattern.shape[1]):
            rows.append({"task": "planted", "layer": layer, "head": h, "kind": kind,
                         **{name: float(v[h]) for name, v in values.items()}})
    return pl.DataFrame(rows)


FAST = {"bootstrap": 200}


@pytest.fixture(scope="module")
def redundant():
    from discovery.evidence import EvidenceThresholds, evidence_report

    lm = redundant_circuit(copies=2)
    batch = annotate(redundant_prompts(12), lm.tokenizer, padding_side="left")
    report = evidence_report(lm, batch, pattern_table(lm, batch), EvidenceThresholds(n_controls=12), **FAST)
    return lm, batch, report


def test_redundant_aggregate_single_ablation_misses_it_group_finds_it(redundant):
    _, _, report = redundant
    heads = {f"L{r['layer']}H{r['head']}": r for r in report.heads.iter_rows(named=True)}
    clean = report.summary["details"]["clean"]["logit_diff"]
    assert clean > 7.0 and report.summary["details"]["clean"]["acc"] == 1.0
    for name in ("L1H0", "L1H1"):  # each copy alone: under 1% of the clean logit difference
        assert abs(heads[name]["d_ld_all"]) < 0.01 * clean
        assert abs(heads[name]["d_ld_query"]) < 0.01 * clean
    assert heads["L0H0"]["d_ld_segment"] < -0.95 * clean  # the gather head lives at the segments
    assert abs(heads["L0H0"]["d_ld_query"]) < 1e-4
    groups = {r["group"]: r for r in report.groups.iter_rows(named=True)}
    both = groups["selective@query"]
    assert both["heads"] == ["L1H0", "L1H1", "L1H2"]  # every selective head, the decoy included
    assert both["significant"] and both["rel_drop"] > 0.95
    assert both["control_n"] == 10  # all C(5, 3) draws from the 5 other heads of layer 1
    assert both["effect_hi"] < both["control_p05"]  # beyond every control draw
    assert both["credited"] == ["L1H0", "L1H1"]  # sparing either copy restores the task; sparing the decoy does not
    assert report.summary["verdict"] == "distributed"
    roles = {r["head"]: r["role"] for r in report.summary["roles"]}
    assert roles == {"L0H0": "gather", "L1H0": "aggregate", "L1H1": "aggregate", "L1H2": "decoy"}
    pairs = report.summary["details"]["pairs"]
    assert {(p["gather"], p["aggregate"]) for p in pairs} == {("L0H0", "L1H0"), ("L0H0", "L1H1")}
    assert not any(p["single_head_evidence"] for p in pairs)  # no confident single pair
    reads = {(r["gather"], r["reader"]): r for r in report.reads.iter_rows(named=True)}
    assert reads[("L0H0", "L1H0")]["dla_drop"] > 0.99  # knock out the gather head: the copy writes nothing


def test_depth_profile_and_minimal_depth_of_planted(redundant):
    lm, batch, report = redundant
    profile = report.profile
    assert profile["depth"].to_list() == [1, 2]
    assert abs(profile["logit_diff"][0]) < 1e-4 and profile["acc_frac"][0] < 0.01  # layer 0 alone: no answer
    engine = AblationEngine(lm, batch)
    assert abs(profile["logit_diff"][1] - float(engine.clean.logit_diff.mean())) < 1e-4  # last depth = the model
    assert report.summary["minimal_model"]["depth"] == 2


def test_planted_ga_circuit_gives_its_clean_pair_and_names_its_decoys():
    """discovery.planted_ga (another construction: the aggregate head selects by gathered content) with one
    aggregate head: the verdict is clean with exactly the planted pair, and both planted decoys are named."""
    from discovery.evidence import EvidenceThresholds, evidence_report
    from discovery.toy.planted import planted_model, planted_prompts

    circuit = planted_model(aggregate_copies=1)
    lm = circuit.lm
    batch = annotate(planted_prompts(16), lm.tokenizer, padding_side="left")
    report = evidence_report(lm, batch, pattern_table(lm, batch), EvidenceThresholds(n_controls=8), **FAST)
    assert report.summary["verdict"] == "clean"
    roles = {r["head"]: r["role"] for r in report.summary["roles"]}
    assert [h for h, r in roles.items() if r == "gather"] == [str(circuit.gather)]
    assert [h for h, r in roles.items() if r == "aggregate"] == [str(circuit.aggregate)]
    (pair,) = report.summary["details"]["pairs"]
    assert (pair["gather"], pair["aggregate"], pair["single_head_evidence"]) == (
        str(circuit.gather), str(circuit.aggregate), True)
    assert {str(h) for h in circuit.decoys.values()} <= set(report.summary["details"]["decoys"])
    assert report.summary["minimal_model"]["depth"] == 3  # the aggregate head's layer is the last one needed


def test_depth_profile_equals_the_truncated_engine():
    """Reading each layer out through the final norm equals running the engine truncated there: accuracy and
    logit difference from the candidates' unembedding rows (the engine's checked shortcut; gold_logprob null
    at truncated depths), the whole vocabulary when the engine has no shortcut (gold_logprob too)."""
    from discovery.evidence import depth_profile

    lm = load_model("tiny:llama")
    batch = annotate(mc_prompts(4), lm.tokenizer, padding_side="left")
    profile = depth_profile(lm, batch)
    engine = AblationEngine(lm, batch)
    assert engine.readout is not None
    engine.layer_rows = 0
    from_engine = depth_profile(lm, batch, engine)  # the engine's clean hidden states: no pass of its own
    assert engine.layer_rows == 0
    engine.readout = None  # as for a model whose logits the shortcut cannot reproduce: the full readout
    full = depth_profile(lm, batch, engine)
    n = lm.inventory.n_layers
    assert profile["gold_logprob"].null_count() == n - 1 and full["gold_logprob"].null_count() == 0
    for column in ("logit_diff", "acc"):
        assert from_engine[column].to_list() == pytest.approx(profile[column].to_list(), abs=1e-5)
        assert full[column].to_list() == pytest.approx(profile[column].to_list(), abs=1e-5)
    for depth in range(1, n + 1):
        engine = AblationEngine(lm, batch, readout_layer=depth - 1)
        assert abs(profile["logit_diff"][depth - 1] - float(engine.clean.logit_diff.mean())) < 1e-5
        assert abs(profile["acc"][depth - 1] - float(engine.clean.acc.mean())) < 1e-9
        assert abs(full["gold_logprob"][depth - 1] - float(engine.clean.gold_logprob.mean())) < 1e-5


def test_control_draws_match_size_and_layers():
    from discovery.evidence import control_draws
    from discovery.heads import HeadId

    pool = [HeadId(layer, i, "attn") for layer in range(3) for i in range(4)]
    group = (HeadId(1, 0, "attn"), HeadId(1, 1, "attn"), HeadId(2, 3, "attn"))
    draws = control_draws(group, pool, 50, seed=3)
    assert len(draws) == 3  # layer 1 has 2 free heads (1 way to pick 2), layer 2 has 3 (3 ways to pick 1)
    for d in draws:
        assert len(d) == 3 and not set(d) & set(group)
        assert sorted(h.layer for h in d) == [1, 1, 2]
    assert len(set(draws)) == len(draws)
    assert draws == control_draws(group, pool, 50, seed=3)
    # a layer without enough free heads lends from the group's other layers
    full = tuple(HeadId(0, i, "attn") for i in range(4))
    assert all(len(d) == 4 for d in control_draws(full, pool, 5))


def _row(layer: int, head: int, *, sel: float = 0.25, gather: float = 0.1, effects: dict | None = None) -> dict:
    """One head-table row: pattern metrics and effects per scope with a +-0.05 interval."""
    row = {"layer": layer, "head": head, "kind": "attn", "selectivity": sel, "agg_select": sel, "gather_score": gather}
    for scope in ("all", "query", "segment", "summary", "mean_all"):
        value = (effects or {}).get(scope, 0.0)
        row |= {f"d_ld_{scope}": value, f"d_ld_{scope}_lo": value - 0.05, f"d_ld_{scope}_hi": value + 0.05}
    return row


def test_verdict_rules_on_a_hand_made_table():
    """Pure verdict logic: a selective head with no effect is a decoy, one whose effect lives elsewhere than
    the query is not an aggregate head, and a model at chance gets no roles but decoys and a reason."""
    import polars as pl

    from discovery.evidence import verdicts

    frame = pl.DataFrame([
        _row(0, 0, sel=0.9),  # selective, no effect anywhere: decoy
        _row(0, 1, sel=0.9, effects={"all": -3.0, "segment": -2.9, "query": -0.6}),  # selective, effect at segments
        _row(1, 0, effects={"all": -2.0, "query": -1.9}),  # effect at the query, no pattern
        _row(1, 1, gather=0.9, effects={"mean_all": -0.3}),  # gather pattern, a small but real effect: not a decoy
    ])
    clean = {"logit_diff": 4.0, "acc": 0.9, "chance": 0.25}
    roles, verdict = verdicts(frame, None, clean=clean)
    got = dict(zip(roles["name"].to_list(), roles["role"].to_list()))
    assert got == {"L0H0": "decoy", "L0H1": "other_important", "L1H0": "other_important", "L1H1": "none"}
    assert verdict["verdict"] == "none" and verdict["decoys"] == ["L0H0"]
    assert verdict["carriers"][0] == {"head": "L0H1", "effect": -3.0, "rel_drop": 0.75, "where": "segments",
                                      "role": "other_important"}
    assert "L0H1 (75% of clean, at the segments)" in verdict["reason"]
    _, at_chance = verdicts(frame, None, clean={"logit_diff": -0.1, "acc": 0.25, "chance": 0.25})
    assert at_chance["verdict"] == "none" and "does not do the task" in at_chance["reason"]


def test_evidence_text_says_where_the_summary_reads_when_the_table_has_it():
    """A head acting at the segments that reads another option (high gather_cross) says so in its
    evidence line; a table from before gather_cross existed still gets a line, without it."""
    import polars as pl

    from discovery.evidence import verdicts

    clean = {"logit_diff": 4.0, "acc": 0.9, "chance": 0.25}
    reader = _row(0, 0, gather=0.25, effects={"all": -3.0, "segment": -2.9})
    roles, _ = verdicts(pl.DataFrame([{**reader, "gather_cross": 0.98}]), None, clean=clean)
    (text,) = roles["evidence"].to_list()
    assert "gather_score 0.25, gather_cross 0.98" in text and roles["role"].to_list() == ["other_important"]
    roles, _ = verdicts(pl.DataFrame([reader]), None, clean=clean)
    assert "gather_cross" not in roles["evidence"].item() and "gather_score 0.25" in roles["evidence"].item()


def test_evidence_text_gives_drops_and_shares_with_the_same_sign():
    """The evidence line quotes drops (clean - ablated, positive = the head helps, rank.verdict.drop's
    convention) with their interval and share of clean: a helpful head reads positive twice, a harmful
    one negative twice (it once printed "d_ld all -3.00 [...] (+75%)")."""
    import polars as pl

    from discovery.evidence import verdicts

    clean = {"logit_diff": 4.0, "acc": 0.9, "chance": 0.25}
    helps = _row(0, 0, effects={"all": -3.0, "segment": -2.9})
    hurts = _row(0, 1, effects={"all": 0.4})
    roles, _ = verdicts(pl.DataFrame([helps, hurts]), None, clean=clean)
    helps_text, hurts_text = roles["evidence"].to_list()
    assert "drop all 3.00 [2.95, 3.05] (75% of clean 4.00)" in helps_text
    assert "segment 2.90 [2.85, 2.95] (72% of clean 4.00)" in helps_text
    assert "query 0.00 [-0.05, 0.05] (0% of clean 4.00)" in helps_text  # no "-0.00"
    assert "drop all -0.40 [-0.45, -0.35] (-10% of clean 4.00)" in hurts_text
    assert "d_ld" not in helps_text and "+" not in helps_text


def test_evidence_text_says_when_the_query_reads_just_past_the_gold_option():
    """A head acting at the query whose row sits right after the gold option (high agg_after, low
    agg_select) shows both numbers in its evidence line; older tables without agg_after do not."""
    import polars as pl

    from discovery.evidence import verdicts

    clean = {"logit_diff": 4.0, "acc": 0.9, "chance": 0.25}
    late = _row(2, 1, sel=0.12, effects={"all": -2.0, "query": -2.0})
    roles, _ = verdicts(pl.DataFrame([{**late, "agg_after": 0.93}]), None, clean=clean)
    assert "agg_select 0.12, agg_after 0.93, gather_score" in roles["evidence"].item()
    roles, _ = verdicts(pl.DataFrame([late]), None, clean=clean)
    assert "agg_after" not in roles["evidence"].item()


def test_bad_input_is_one_line_errors():
    import polars as pl

    from discovery.errors import GascanError
    from discovery.evidence import EvidenceThresholds, evidence_report

    with pytest.raises(GascanError, match="outside 0..1"):
        EvidenceThresholds(selectivity=1.5)
    with pytest.raises(GascanError, match="unknown depth metric"):
        EvidenceThresholds(depth_metric="loss")
    lm = redundant_circuit()
    batch = annotate(redundant_prompts(2), lm.tokenizer, padding_side="left")
    with pytest.raises(GascanError, match="no selectivity column"):
        evidence_report(lm, batch, pl.DataFrame({"layer": [0], "head": [0], "kind": ["attn"]}))
    batch.cand_first_token[0, 1] = batch.cand_first_token[0, 0]  # two candidates, one first token
    with pytest.raises(GascanError, match="share their first token"):
        evidence_report(lm, batch, pattern_table(lm, batch))



def test_role_groups_from_patterns_and_the_gather_cap():
    import polars as pl

    from discovery.evidence import EvidenceThresholds, role_groups

    frame = pl.DataFrame([
        _row(0, 0, gather=0.9, effects={"segment": -0.1}), _row(0, 1, gather=0.8, effects={"segment": -0.1}),
        _row(1, 0, gather=0.9, effects={"segment": -2.0, "all": -2.0}), _row(1, 1, sel=0.7),
        _row(2, 0, gather=0.9, effects={"segment": -0.5}), _row(2, 1, sel=0.9, effects={"query": -1.0, "all": -1.0}),
    ])
    groups = {g.name: g for g in role_groups(frame, EvidenceThresholds(max_gather_groups=2, top_k=2), clean_ld=4.0)}
    assert set(groups) == {"selective", "selective@query", "gatherers L1", "gatherers L2", "top2"}  # L0: smallest drop
    assert [str(h) for h in groups["selective"].heads] == ["L1H1", "L2H1"] and groups["selective"].scope == ("all",)
    assert groups["selective@query"].scope == ("query",) and groups["gatherers L1"].scope == ("segment",)
    assert [str(h) for h in groups["top2"].heads] == ["L1H0", "L2H1"]
    uncapped = {g.name for g in role_groups(frame, EvidenceThresholds(max_gather_groups=None), clean_ld=4.0)}
    assert "gatherers L0" in uncapped


def test_group_controls_are_drawn_only_where_they_can_decide(redundant):
    """Controls are drawn only for a group whose joint drop could make it significant, and every decision
    equals the full test's: each group's joint ablation and all its controls, run by hand through the engine."""
    from discovery.evidence import EvidenceThresholds, Group, control_draws, group_ablations
    from discovery.heads import HeadId
    from discovery.measure.ablation import Ablation, AblationEngine
    from discovery.stats import bootstrap_ci

    lm, batch, report = redundant
    th = EvidenceThresholds(n_controls=12)
    h = lambda name: HeadId(int(name[1]), int(name[3]), "attn")
    groups = [Group("copies@query", "aggregate", (h("L1H0"), h("L1H1")), ("query",)),
              Group("decoy", "aggregate", (h("L1H2"),), ("all",)),
              Group("idle", "aggregate", (h("L1H3"), h("L1H4")), ("all",))]
    engine = AblationEngine(lm, batch)
    ran: list[str] = []
    run = engine.run
    engine.run = lambda ablations, *a, **k: (ran.extend(x.label for x in ablations), run(ablations, *a, **k))[1]
    table = {r["group"]: r for r in group_ablations(engine, report.heads, th, groups=groups, bootstrap=200)
             .iter_rows(named=True)}
    engine.run = run
    clean_ld = float(engine.clean.logit_diff.mean())
    pool = list(engine.inventory.heads())
    n_full = 0
    for g in groups:
        draws = control_draws(g.heads, pool, th.n_controls, seed=0)
        ablations = [Ablation(g.heads, "zero", g.scope)] + [Ablation(d, "zero", g.scope) for d in draws]
        ld = engine.effects(ablations, engine.run(ablations)).logit_diff.double()  # [ablation, prompt]
        n_full += len(ablations)
        mean, _, hi = (float(x) for x in bootstrap_ci(ld[0], 200, seed=0))
        control = ld[1:].mean(-1)  # [draw]
        beyond = mean < float(torch.quantile(control, 1.0 - th.control_quantile))
        full_decision = beyond and -mean >= th.group * clean_ld and hi < 0
        row = table[g.name]
        assert row["significant"] == full_decision
        assert row["effect"] == pytest.approx(mean, abs=1e-9)
        assert row["controls_drawn"] == (g.name == "copies@query")
        if row["controls_drawn"]:
            assert row["control_n"] == len(draws) and row["control_p"] == pytest.approx(
                float((1 + (control <= mean).sum()) / (1 + len(draws))))
        else:
            assert row["control_n"] == 0 and row["control_mean"] is None and row["beyond_control"] is None
    assert table["copies@query"]["significant"] and table["copies@query"]["credited"] == ["L1H0", "L1H1"]
    # three joints, the strong group's controls, its two spare-one tests: fewer than the full test's ablations
    assert ran.count("control:copies@query") == table["copies@query"]["control_n"]
    assert len(ran) == 3 + table["copies@query"]["control_n"] + 2 < n_full


def test_a_task_the_model_does_not_do_costs_no_tests_and_keeps_the_full_tests_verdict(tmp_path, monkeypatch):
    """tiny:llama (random weights) does not do mc. The evidence stage stops after its clean pass and the pair
    stage runs nothing (on SmolLM2-135M mc the full tests took minutes to say the same); forcing the full
    tests on the same scan gives the same verdict, and no head a G&A role."""
    from discovery.artifacts import read_summary
    from discovery.evidence import stage
    from pipelines.options import ScanOptions
    from pipelines.pipeline import run

    lm = load_model("tiny:llama")
    options = ScanOptions(tasks=["mc"], prompts=16, seed=1, bootstrap=100)  # accuracy 0.25, chance 0.25
    fast = run(lm, options, tmp_path / "fast", report=False)
    ev = read_summary(tmp_path / "fast")["evidence"]["mc"]
    clean = ev["details"]["clean"]
    assert clean["acc"] - clean["chance"] < 0.05 or clean["logit_diff"] <= 0  # the premise: the task is not done
    assert ev["task_done"] is False and "does not do the task" in ev["skipped"]
    assert ev["roles"] == [] and ev["groups"] == [] and ev["reads"] == []
    stages = fast.summary["stages"]
    assert stages["evidence"]["forward_equivalents"] <= 1.0 + 1e-6  # the clean pass only
    assert stages["pairs"]["forward_equivalents"] == 0.0
    assert fast.summary["pairs_skipped"] == {"mc": "the model does not do the task (evidence stage), so no pair "
                                                    "was ranked or tested"}

    monkeypatch.setattr(stage, "task_done", lambda clean, th: True)  # the tests run as if the task were done
    full = run(lm, options, tmp_path / "full", report=False)
    full_ev = read_summary(tmp_path / "full")["evidence"]["mc"]
    assert "skipped" not in full_ev and full.summary["stages"]["evidence"]["forward_equivalents"] > 5.0
    assert not [r for r in full_ev["roles"] if r["role"] in ("gather", "aggregate")]
    assert full.verdict.tasks[0].outcome == fast.verdict.tasks[0].outcome == "none"
    assert full.verdict.tasks[0].sentence == fast.verdict.tasks[0].sentence
