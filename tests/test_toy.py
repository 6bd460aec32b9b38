"""The toy trainer: determinism, loadable Hugging Face output, the bundled models, CLI errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from discovery.errors import GascanError
from discovery.toy import TrainConfig, bundled_checkpoints, bundled_model_path
from discovery.toy.data import encode, task_prompts
from discovery.toy.trainer import (
    TEST_SEED_OFFSET,
    curriculum_ranks,
    evaluate,
    heldout_prompts,
    subject_order,
    train,
)
from pipelines.cli import main

LABELS = [" A", " B", " C", " D"]


def tiny_cfg(**kw) -> TrainConfig:
    """A run of a couple of seconds: small width, few steps, small data."""
    base = {"arch": "transformer", "task": "mc", "seed": 0, "steps": 20, "batch_size": 16, "layers": 2,
            "heads": 2, "width": 32, "ssm_heads": 4, "ssm_state": 16, "vocab_size": 400, "train_size": 400,
            "test_size": 32, "eval_every": 10, "task_options": {"option_words": 2}}
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("toy")
    out = {}
    for name, cfg in {"a": tiny_cfg(save_every=10), "b": tiny_cfg(), "c": tiny_cfg(seed=1)}.items():
        train(cfg, root / name, progress=False)
        out[name] = root / name
    return out


def test_training_is_deterministic_for_a_seed(runs):
    a = load_file(runs["a"] / "model.safetensors")
    b = load_file(runs["b"] / "model.safetensors")
    c = load_file(runs["c"] / "model.safetensors")
    assert a.keys() == b.keys() and len(a) > 10
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit for bit
    differing = [k for k in a if a[k].shape == c[k].shape and not torch.equal(a[k], c[k])]
    assert len(differing) >= len(a) - 2  # another seed: (nearly) every tensor differs
    assert (runs["a"] / "tokenizer.json").read_bytes() == (runs["b"] / "tokenizer.json").read_bytes()
    # saving checkpoints along the way does not change the final weights, and the run records its history
    meta = json.loads((runs["a"] / "training.json").read_text())
    meta_b = json.loads((runs["b"] / "training.json").read_text())
    assert [h["loss"] for h in meta["history"]] == [h["loss"] for h in meta_b["history"]]
    assert meta["steps"] == 20 and meta["seed"] == 0 and meta["task_options"] == {"option_words": 2}
    assert meta["checkpoints"] == ["checkpoints/step-000010"]
    assert meta["command"].startswith("gascan toy train --arch transformer --task mc --seed 0")


def test_saved_directories_load_offline_with_single_token_labels(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for d in (runs["a"], runs["a"] / "checkpoints" / "step-000010"):
        model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
        assert type(model).__name__ == "LlamaForCausalLM"
        for text in LABELS + [":", "\n"]:
            assert len(tok(text, add_special_tokens=False)["input_ids"]) == 1, text
        assert tok.bos_token_id is not None and tok.pad_token_id is not None and tok.eos_token_id is not None
        meta = json.loads((d / "training.json").read_text())
        cfg = TrainConfig.from_dict(meta["config"])
        train_texts = {p.text for p in task_prompts("mc", "train", 0, cfg.train_size, cfg.task_options)}
        heldout = heldout_prompts(cfg, train_texts)  # the run's own held-out prompts
        assert not {p.text for p in heldout} & train_texts
        assert evaluate(model, encode(heldout, tok)) == pytest.approx(meta["test_accuracy"])
        unseen = task_prompts("mc", "test", 2 * TEST_SEED_OFFSET, 32, cfg.task_options)  # disjoint words
        assert evaluate(model, encode(unseen, tok)) == pytest.approx(meta["unseen_words_accuracy"])
    assert not list(runs["a"].glob("**/*.bin")) and not list(runs["a"].glob("**/.*tmp*"))


@pytest.mark.parametrize("arch,extra", [("mamba2", {}), ("mamba2", {"conv_kernel": 2}), ("mamba1", {}),
                                        ("hybrid", {"attn_layers": [1], "conv_kernel": 2})])
def test_ssm_and_hybrid_runs_save_and_reload(tmp_path, arch, extra):
    from transformers import AutoModelForCausalLM

    cfg = tiny_cfg(arch=arch, steps=3, eval_every=3, **extra)
    result = train(cfg, tmp_path / arch, progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / arch, local_files_only=True)
    assert type(model).__name__ == {"mamba2": "Mamba2ForCausalLM", "mamba1": "MambaForCausalLM",
                                    "hybrid": "BambaForCausalLM"}[arch]
    if arch == "hybrid":
        assert model.config.attn_layer_indices == [1]
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv1d)]
    assert convs and {c.kernel_size[0] for c in convs} == {extra.get("conv_kernel", 4)}
    meta = json.loads((tmp_path / arch / "training.json").read_text())
    assert meta["arch"] == arch and result.steps == 3 and 0.0 <= meta["test_accuracy"] <= 1.0
    assert ("--conv-kernel 2" in meta["command"]) == ("conv_kernel" in extra)


def test_mamba1_training_scan_matches_transformers_and_is_restored():
    """The trainer's Mamba-1 scan (discovery/toy/mamba1_scan.py) gives transformers' own outputs and
    gradients, and the mixers get their own forward back afterwards."""
    from discovery.model.tiny import tiny_model
    from discovery.toy.mamba1_scan import fast_mamba1

    model = tiny_model("mamba").train()
    ids = torch.randint(0, 200, (3, 17), generator=torch.Generator().manual_seed(0))
    ref = model(input_ids=ids).logits
    ref.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with fast_mamba1(model):
        out = model(input_ids=ids).logits
        out.sum().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g, atol=1e-4, rtol=1e-3)
    assert all("forward" not in vars(m) for m in model.modules())


def test_hybrid_ssm_init_matches_the_mamba2_toy():
    """--ssm-init mamba2 gives a hybrid's mixers the Mamba-2 toy's start: dt in [0.001, 0.1] instead of
    Bamba's softplus(1) = 1.31, Kaiming-uniform conv and out_proj; attention and embeddings untouched;
    the same seed gives the same weights."""
    import math

    from discovery.toy.models import build_model

    special = {"vocab_size": 400, "bos": 1, "eos": 2, "pad": 0}
    kw = {"arch": "hybrid", "attn_layers": [1], "layers": 3, "width": 64, "ssm_heads": 4, "conv_kernel": 2}
    bamba = build_model(TrainConfig(**kw, ssm_init="bamba").validate(), special)
    a = build_model(TrainConfig(**kw).validate(), special)  # the default
    b = build_model(TrainConfig(**kw, ssm_init="mamba2").validate(), special)
    mixers = [m for m in a.modules() if hasattr(m, "dt_bias")]
    assert len(mixers) == 2  # layers 0 and 2
    for m in mixers:
        dt = torch.nn.functional.softplus(m.dt_bias)  # [head]
        assert dt.min() >= 1e-3 - 1e-7 and dt.max() <= 0.1 + 1e-7 and dt.unique().numel() == 4
        assert torch.allclose(m.A_log, torch.log(torch.arange(1.0, 5.0)))
        bound = math.sqrt(6 / (1 + 5)) * math.sqrt(3 / 2)  # kaiming_uniform(a=sqrt 5), fan_in = kernel 2
        assert m.conv1d.weight.abs().max() <= bound and m.conv1d.weight.std() > 0.2 and not m.conv1d.bias.any()
    for m in (m for m in bamba.modules() if hasattr(m, "dt_bias")):
        assert torch.allclose(torch.nn.functional.softplus(m.dt_bias), torch.full((4,), math.log1p(math.e)))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    attn_a, attn_bamba = a.model.layers[1].self_attn, bamba.model.layers[1].self_attn
    assert torch.equal(attn_a.q_proj.weight, attn_bamba.q_proj.weight)  # drawn before the re-init
    with pytest.raises(GascanError, match="--ssm-init"):
        TrainConfig(**kw, ssm_init="s4").validate()


def test_runs_recorded_before_ssm_init_read_as_bamba_hybrids():
    """A hybrid's training.json from before --ssm-init existed was trained with Bamba's init (then the only
    one); other architectures have no SSM init to record and take the default."""
    old_hybrid = TrainConfig.from_dict({"arch": "hybrid", "attn_layers": [1], "seed": 3})
    assert old_hybrid.ssm_init == "bamba" and old_hybrid.seed == 3
    assert TrainConfig.from_dict({"arch": "hybrid", "ssm_init": "mamba2"}).ssm_init == "mamba2"
    assert TrainConfig.from_dict({"arch": "transformer"}).to_dict() == TrainConfig().to_dict()
    assert TrainConfig().ssm_init == "mamba2"


def test_recorded_command_reproduces_every_setting():
    """training.json's command, parsed by the CLI, gives back the same config (every setting has a flag)."""
    import shlex

    from discovery.toy.trainer import command_line
    from pipelines.cli import build_parser
    from pipelines.commands.toy import config_from_args

    cfg = TrainConfig(arch="hybrid", batch_size=7, lr=0.003, weight_decay=0.02, decay_steps=5, init_std=0.05, layers=3,
                      heads=2, width=64, mlp_ratio=1, ssm_heads=4, ssm_state=8, conv_kernel=2, attn_layers=[1], ssm_init="mamba2",
                      curriculum_steps=9, induction_weight=0.5, induction_length=8, induction_steps=3,
                      knowledge_weight=0.5, knowledge_facts=4, vocab_size=500, train_size=300, test_size=20,
                      eval_every=5, save_every=10, save_at=[4], time_budget=60.0, threads=2,
                      task_options={"option_words": "3", "option_template": "{label}: {choice} "})
    argv = shlex.split(command_line(cfg, "/tmp/out"))[1:]
    assert config_from_args(build_parser().parse_args(argv)).to_dict() == cfg.to_dict()


def test_subject_curriculum_admits_1_2_4_subjects_then_all(tmp_path):
    cfg = tiny_cfg(steps=9, eval_every=3, curriculum_steps=3)
    assert [cfg.subjects_at(s, 16) for s in (0, 2, 3, 6, 9, 12, 100)] == [1, 1, 2, 4, 8, 16, 16]
    prompts = task_prompts("mc", "train", 0, 400, cfg.task_options)
    ranks = curriculum_ranks(cfg, prompts)  # [400]
    order = subject_order(cfg, prompts)
    assert sorted(order) == sorted({p.meta["subject"] for p in prompts}) and len(order) >= 8
    assert all(order[int(r)] == p.meta["subject"] for r, p in zip(ranks, prompts))
    assert subject_order(tiny_cfg(seed=1), prompts) != order  # the order is the seed's
    a = train(cfg, tmp_path / "a", progress=False)
    b = train(cfg, tmp_path / "b", progress=False)
    assert [h["subjects"] for h in a.history] == [1, 1, 2, 4]  # in the last step before evals 0, 3, 6, 9
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    meta = json.loads((tmp_path / "a" / "training.json").read_text())
    assert meta["curriculum"]["subject_order"] == order and "--curriculum-steps 3" in meta["command"]
    plain = load_file(train(tiny_cfg(steps=9, eval_every=3), tmp_path / "c", progress=False).out_dir
                      / "model.safetensors")
    wa = load_file(tmp_path / "a" / "model.safetensors")
    assert not all(torch.equal(wa[k], plain[k]) for k in wa)  # the curriculum changed what was trained on


def test_kv_task_trains_with_every_value_a_single_token(tmp_path):
    from transformers import AutoTokenizer

    train(tiny_cfg(task="kv", steps=2, eval_every=2, task_options={}, train_size=300), tmp_path / "kv",
          progress=False)
    tok = AutoTokenizer.from_pretrained(tmp_path / "kv", local_files_only=True)
    values = {c for p in task_prompts("kv", "train", 0, 300, {}) for c in p.candidates}
    assert len(values) >= 50  # " 0" .. " 99": each too rare in the corpus to be merged on its own
    assert all(len(tok(v, add_special_tokens=False)["input_ids"]) == 1 for v in values)
    meta = json.loads((tmp_path / "kv" / "training.json").read_text())
    assert meta["unseen_words_split"] is None  # kv has no word splits: held-out prompts only


def test_attention_only_model_and_question_after_options(tmp_path):
    """--mlp-ratio 0 builds attention-only layers; a template with the question after the options trains."""
    from transformers import AutoModelForCausalLM

    opts = {"option_words": 1, "template": "{options}\nQuestion: {question}\nAnswer:", "option_template": "\n{choice}: {label}"}
    train(tiny_cfg(mlp_ratio=0, steps=2, eval_every=2, task_options=opts), tmp_path / "ao", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ao", local_files_only=True)
    assert model.config.intermediate_size == 0
    assert all(p.numel() == 0 for n, p in model.named_parameters() if ".mlp." in n)
    meta = json.loads((tmp_path / "ao" / "training.json").read_text())
    assert meta["example_prompt"].index("Question:") > meta["example_prompt"].index(": D")
    with pytest.raises(GascanError, match="--mlp-ratio"):
        TrainConfig(mlp_ratio=-1).validate()


def test_lr_decays_linearly_over_the_last_steps_when_asked():
    cfg = TrainConfig(steps=10, decay_steps=4, lr=1.0)
    assert [cfg.lr_at(s) for s in range(10)] == [1.0] * 7 + [0.75, 0.5, 0.25]
    assert {TrainConfig(steps=10, lr=1.0).lr_at(s) for s in range(10)} == {1.0}  # default: constant
    with pytest.raises(GascanError, match="--decay-steps"):
        TrainConfig(steps=10, decay_steps=11).validate()


def test_time_budget_stops_early(tmp_path):
    result = train(tiny_cfg(steps=500, time_budget=0.05), tmp_path / "t", progress=False)
    meta = json.loads((tmp_path / "t" / "training.json").read_text())
    assert result.steps < 500 and meta["stopped_by"] == "time_budget" and meta["steps"] == result.steps


def _fresh_accuracy(path: Path, n: int = 200, seed: int = 4242, split: str = "train") -> float:
    """Accuracy on ``n`` new prompts (a seed the run never used) over the training words."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = json.loads((path / "training.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    prompts = task_prompts(meta["task"], split, seed, n, meta["task_options"])
    return evaluate(model, encode(prompts, tok))


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_bundled_model_is_accurate_on_a_fresh_test_split():
    """The bundled default: category questions with two-word options, half of them with shuffled
    labels (the letter must be read from the chosen option), >= 95% on new prompts."""
    path = bundled_model_path()
    meta = json.loads((path / "training.json").read_text())
    assert meta["task"] == "mc" and meta["arch"] == "transformer"
    assert int(meta["task_options"]["option_words"]) >= 2 and "question" not in meta["task_options"]
    assert meta["task_options"]["label_order"] == "mixed"
    assert _fresh_accuracy(path) >= 0.95  # chance is 0.25
    assert _size(path) <= 20e6 and (path / "model.safetensors").stat().st_size <= 5e6
    assert not [p for p in path.rglob("*") if p.suffix in (".bin", ".pt", ".pkl", ".pth")]
    truth = json.loads((path / "truth.json").read_text())
    assert truth["clean"]["acc"] >= 0.95 and len(truth["heads"]) == 16


def _fresh_truth(name: str, tmp_path: Path) -> dict:
    """``gascan toy truth bundled:NAME`` on 64 prompts the bundled truth never saw (seed 11)."""
    out = tmp_path / "truth.json"
    assert main(["toy", "truth", f"bundled:{name}", "--prompts", "64", "--seed", "11", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_bundled_model_truth_has_a_gather_head_feeding_aggregate_heads(tmp_path, capsys):
    """Recomputed ground truth of the bundled default on new prompts: one gather head in an earlier
    layer than every aggregate head, confirmed by the interaction test, and each role clear of the
    other heads that matter on its own pattern metric."""
    truth = _fresh_truth("mc-transformer", tmp_path)
    assert truth["clean"]["acc"] >= 0.95
    gathers = [(g["layer"], g["head"]) for g in truth["gather"]]
    aggregates = [(a["layer"], a["head"]) for a in truth["aggregate"]]
    assert gathers == [(1, 0)] and len(aggregates) >= 2
    assert all(layer > 1 for layer, _ in aggregates)  # gather layer before the aggregate layers
    # some aggregate heads lose the gold option without the gather head
    assert any(p["selection_without_gather"] < p["selection_clean"] - 0.2 for p in truth["pairs"])
    # each redundant aggregate head carries a little of the gather head's effect, all of them most of it,
    # so every member of the set pairs with the gather head through the set
    (joint,) = truth["joint_mediation"]
    assert max(p["mediated"] for p in truth["pairs"]) < 0.3 and joint["mediated"] >= 0.7
    assert {(a["layer"], a["head"]) for a in truth["aggregate_set"]["heads"]} == set(aggregates)
    assert joint["set_mediated"] == pytest.approx(joint["mediated"])  # every later aggregate is in the set
    assert all(p["confirmed"] and p["set_mediated"] == joint["set_mediated"] for p in truth["pairs"])
    assert {(p["aggregate"]["layer"], p["aggregate"]["head"]) for p in truth["pairs"]} == set(aggregates)
    margins = truth["pattern_margin"]
    assert margins["gather"]["difference"] >= 0.5 and margins["aggregate"]["difference"] >= 0.5
    assert "gather: L1H0" in capsys.readouterr().err


def test_bundled_mamba2_toy_has_an_ssm_aggregate_head(tmp_path, capsys):
    """The bundled Mamba-2 toy (labels before the options): >= 95% on new prompts, and its truth,
    recomputed on new prompts, has exactly one aggregate head, the SSM head L1S0, whose query
    selects the gold option on every prompt, at least 0.5 more often than any other head that matters;
    the head that matters at the segments reads another option's tokens, not its own."""
    path = bundled_model_path("mc-mamba2")
    meta = json.loads((path / "training.json").read_text())
    assert meta["arch"] == "mamba2" and meta["task_options"]["option_template"].startswith("{label}")
    assert _fresh_accuracy(path) >= 0.95
    assert not [p for p in path.rglob("*") if p.suffix in (".bin", ".pt", ".pkl", ".pth")]
    truth = _fresh_truth("mc-mamba2", tmp_path)
    assert truth["clean"]["acc"] >= 0.95
    assert truth["aggregate"] == [{"layer": 1, "head": 0, "kind": "ssm"}]
    assert truth["pattern_margin"]["aggregate"]["difference"] >= 0.5
    by_name = {(r["layer"], r["head"]): r for r in truth["heads"]}
    assert by_name[(1, 0)]["d_ld_query"] <= -0.4 * truth["clean"]["logit_diff"]  # its effect lives at the query
    # the head that matters at the segments (L0S3) is no gatherer: from every option it reads the
    # first option's label, so its gather score stays low and its cross-segment mass is high
    segment_head = by_name[(0, 3)]
    assert segment_head["role"] == "other_important"
    assert segment_head["d_ld_segment"] <= -0.4 * truth["clean"]["logit_diff"]
    assert segment_head["gather_score"] < 0.3 and segment_head["gather_cross"] >= 0.9
    err = capsys.readouterr().err
    assert "aggregate: L1S0" in err and "other head that breaks the task L0S3" in err


def test_bundled_width2_mamba2_toy_has_a_pair_that_reads_the_gold_option_one_step_late(tmp_path, capsys):
    """The width-2 Mamba-2 toy: its truth, recomputed on new prompts, has an SSM head that gathers each
    option into its last token (L1S0, effect at the option positions) and two query heads (L2S1, L2S6)
    that put over 0.8 of their query row on the two tokens right after the gold option (``agg_after``)
    and at most chance on the option itself. They aggregate by the rules' selection (the larger of the
    two), and the pair with L2S1 is confirmed by mediation, not by selection: without the gather head
    both still read the same place, but holding L2S1 at its clean output gives back 0.4 or more of the
    gather head's cost (L2S6, the smaller copy, gives back less)."""
    meta = json.loads((bundled_model_path("mc-mamba2-k2") / "training.json").read_text())
    assert meta["arch"] == "mamba2" and meta["config"]["conv_kernel"] == 2
    truth = _fresh_truth("mc-mamba2-k2", tmp_path)
    clean = truth["clean"]["logit_diff"]
    assert truth["clean"]["acc"] >= 0.95
    assert truth["gather"] == [{"layer": 1, "head": 0, "kind": "ssm"}]
    assert truth["aggregate"] == [{"layer": 2, "head": 1, "kind": "ssm"}, {"layer": 2, "head": 6, "kind": "ssm"}]
    by_name = {(r["layer"], r["head"]): r for r in truth["heads"]}
    gatherer = by_name[(1, 0)]
    assert gatherer["gather_score"] >= 0.9 and gatherer["gather_cross"] <= 0.05
    assert gatherer["d_ld_segment"] <= -0.4 * clean and abs(gatherer["d_ld_query"]) <= 0.05 * clean
    for head in ((2, 1), (2, 6)):
        reader = by_name[head]
        assert reader["d_ld_query"] <= -0.15 * clean, head
        assert reader["agg_after"] >= 0.8 and reader["agg_select"] <= 0.25, head
    # the heads acting at the option positions read nothing past the gold option
    assert by_name[(0, 4)]["agg_after"] <= 0.1 and by_name[(0, 4)]["role"] == "other_important"
    pairs = {(p["aggregate"]["layer"], p["aggregate"]["head"]): p for p in truth["pairs"]}
    assert set(pairs) == {(2, 1), (2, 6)} and pairs[(2, 1)]["confirmed"]
    assert truth["aggregate_set"] is None and pairs[(2, 6)]["set_mediated"] is None  # two single aggregates
    for p in pairs.values():
        assert abs(p["selection_clean"] - p["selection_without_gather"]) < 0.05  # where it reads: unchanged
    assert pairs[(2, 1)]["mediated"] >= 0.4 and pairs[(2, 6)]["mediated"] >= 0.1
    assert pairs[(2, 1)]["mediated"] + pairs[(2, 6)]["mediated"] <= 1.0
    (joint,) = truth["joint_mediation"]  # L2S1 and L2S6 held together carry most of L1S0's effect
    assert joint["mediated"] >= 0.6 and joint["mediated"] >= pairs[(2, 1)]["mediated"]
    assert "L1S0->L2S1" in capsys.readouterr().err


def test_bundled_hybrid_toy_has_an_attention_gather_head_feeding_ssm_aggregate_heads(tmp_path, capsys):
    """The bundled Bamba hybrid (k2 recipe, attention at layer 1, Mamba-2-style SSM init): its truth on
    new prompts has the attention head L1H2 as the one gather head (cost at the option positions) and a
    redundant set of SSM aggregate heads in layers 2-3, each mediating little of L1H2's cost alone and
    most of it together, so every one pairs with it through the set."""
    meta = json.loads((bundled_model_path("mc-hybrid") / "training.json").read_text())
    assert meta["test_accuracy"] >= 0.95 and "--ssm-init mamba2" in meta["command"]
    assert "--attn-layers 1" in meta["command"] and meta["model_class"] == "BambaForCausalLM"
    truth = _fresh_truth("mc-hybrid", tmp_path)
    clean = truth["clean"]["logit_diff"]
    assert truth["clean"]["acc"] >= 0.95
    assert truth["gather"] == [{"layer": 1, "head": 2, "kind": "attn"}]
    aggregates = {(a["layer"], a["head"], a["kind"]) for a in truth["aggregate"]}
    assert {(2, 0, "ssm"), (3, 0, "ssm"), (3, 2, "ssm"), (3, 3, "ssm"), (3, 4, "ssm")} <= aggregates
    assert {kind for _, _, kind in aggregates} == {"ssm"} and truth["aggregate_set"]["breaks_task"]
    gatherer = next(r for r in truth["heads"] if (r["layer"], r["head"], r["kind"]) == (1, 2, "attn"))
    assert gatherer["d_ld_segment"] <= -0.2 * clean and gatherer["gather_score"] >= 0.3
    (joint,) = truth["joint_mediation"]
    assert joint["set_mediated"] >= 0.6 and max(p["mediated"] for p in truth["pairs"]) < 0.3
    assert len(truth["pairs"]) == len(aggregates) and all(p["confirmed"] for p in truth["pairs"])
    assert "gather: L1H2" in capsys.readouterr().err


def test_bundled_checkpoint_series_climbs_from_chance():
    series = bundled_checkpoints()
    steps = [int(p.name.split("-")[1]) for p in series]
    assert len(series) >= 4 and steps == sorted(steps)
    accs = [json.loads((p / "training.json").read_text())["test_accuracy"] for p in series]
    assert accs == sorted(accs) and accs[0] <= 0.35 and accs[-1] >= 0.9  # chance (0.25) to after the jump
    assert _fresh_accuracy(series[0], n=100) <= 0.4


def _cli_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code != 0 and err.count("\n") == 0, err
    return err


def test_cli_rejects_bad_input_with_one_line(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert "architecture" in _cli_error(capsys, ["toy", "train", "--arch", "gpt9", "--out", out])
    err = _cli_error(capsys, ["toy", "train", "--arch", "hybrid", "--attn-layers", "1,7", "--out", out])
    assert "--attn-layers" in err and "out of range" in err
    assert "--attn-layers" in _cli_error(capsys, ["toy", "train", "--attn-layers", "x", "--out", out])
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    err = _cli_error(capsys, ["toy", "train", "--out", str(blocker / "sub"), "--steps", "1"])
    assert "cannot write to output directory" in err
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("x")
    assert "not empty" in _cli_error(capsys, ["toy", "train", "--out", str(full), "--steps", "1"])
    assert "option" in _cli_error(capsys, ["toy", "train", "--out", out, "--task-option", "bogus"])
    assert "--curriculum-steps" in _cli_error(capsys, ["toy", "train", "--out", out, "--task", "kv",
                                                       "--curriculum-steps", "5"])
    assert "option_wrds" in _cli_error(capsys, ["toy", "train", "--out", out, "--task-option", "option_wrds=2"])
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_induction_loss_grows_copy_heads():
    """--induction-weight: the auxiliary loss is next-token prediction on repeated random sequences;
    a 2-layer attention-only toy trained on it alone for 200 steps copies the second half (chance
    is 1/197), and the run is deterministic for its generator seed."""
    from discovery.toy.models import build_model
    from discovery.toy.trainer import induction_loss

    cfg = TrainConfig(layers=2, heads=2, width=64, mlp_ratio=0, batch_size=32, induction_length=12,
                      induction_weight=1.0).validate()
    plain = torch.arange(3, 200)  # ids 0-2 are the special tokens

    def copy_accuracy(model) -> float:
        half = plain[torch.randint(len(plain), (64, 12), generator=torch.Generator().manual_seed(99))]
        seq = torch.cat([half, half], 1)  # [64, 24]
        with torch.no_grad():
            predicted = model(input_ids=seq).logits[:, 12:-1].argmax(-1)  # predictions for seq[:, 13:]
        return float((predicted == seq[:, 13:]).float().mean())

    losses = []
    for _ in range(2):
        torch.manual_seed(0)
        model = build_model(cfg, {"vocab_size": 200, "bos": 0, "eos": 1, "pad": 2})
        before = copy_accuracy(model)
        optimiser = torch.optim.AdamW(model.parameters(), lr=2e-3)
        gen = torch.Generator().manual_seed(0)
        for _ in range(200):
            loss = induction_loss(model, cfg, plain, gen)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
        losses.append(float(loss.detach()))
        print(f"copy accuracy {before:.3f} -> {copy_accuracy(model):.3f}, loss {losses[-1]:.3f}")
        assert before < 0.05 and copy_accuracy(model) > 0.9
    assert losses[0] == losses[1]
    with pytest.raises(GascanError, match="--induction-weight"):
        TrainConfig(induction_weight=-1.0).validate()


def test_knowledge_loss_teaches_what_training_words_are(tmp_path):
    """--knowledge-weight: facts " apple is fruit." over the training words only (the unseen-word check
    stays honest), scored on the category tokens alone; trained on that loss alone, a 2-layer toy names
    the category of most training words (chance 1/15)."""
    from discovery.tasks.words import category_words
    from discovery.toy.data import category_facts, corpus_texts
    from discovery.toy.models import build_model
    from discovery.toy.tokenizer import train_tokenizer
    from discovery.toy.trainer import knowledge_loss

    options = {"option_words": 2, "question_form": "keyword"}
    prompts = task_prompts("mc", "train", 0, 2000, options)
    tokenizer = train_tokenizer(corpus_texts(prompts), 600, [":", "\n", *LABELS])
    facts = category_facts(tokenizer, options)
    train_words = category_words("train")
    assert len(facts) == sum(len(w) for w in train_words.values())
    texts = [tokenizer.decode(ids) for ids in facts.ids]
    test_words = {w for ws in category_words("test").values() for w in ws}
    assert " apple is fruit." in texts and not any(t.split(" is ")[0].strip() in test_words for t in texts)
    targets = [tokenizer.decode(lab[lab >= 0]) for lab in facts.labels]
    assert targets[texts.index(" apple is fruit.")] == " fruit"  # only the category's tokens are scored

    cfg = TrainConfig(layers=2, heads=2, width=64, batch_size=16, knowledge_weight=1.0, knowledge_facts=8,
                      task_options=options).validate()
    special = {"vocab_size": len(tokenizer), "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
               "pad": tokenizer.pad_token_id}

    ids = torch.nn.utils.rnn.pad_sequence(facts.ids, batch_first=True, padding_value=tokenizer.pad_token_id)
    first = torch.tensor([int((lab >= 0).nonzero()[0]) for lab in facts.labels])  # [facts] first target position
    want = torch.stack([lab[i] for lab, i in zip(facts.labels, first)])  # [facts]

    def named(model) -> float:  # share of facts whose first category token is the argmax (right padding: harmless)
        with torch.no_grad():
            logits = model(input_ids=ids).logits  # [facts, len, vocab]
        return float((logits[torch.arange(len(first)), first].argmax(-1) == want).float().mean())

    torch.manual_seed(0)
    model = build_model(cfg, special)
    before = named(model)
    optimiser = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        loss = knowledge_loss(model, cfg, facts, tokenizer.pad_token_id, gen)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    after = named(model)
    print(f"categories named: {before:.3f} -> {after:.3f}")
    assert before < 0.1 and after > 0.8
    run = train(tiny_cfg(steps=4, knowledge_weight=0.5, induction_weight=1.0, induction_steps=2), tmp_path / "k",
                progress=False)
    command = json.loads((run.out_dir / "training.json").read_text())["command"]
    assert "--knowledge-weight 0.5" in command and "--induction-steps 2" in command
    with pytest.raises(GascanError, match="--knowledge-weight needs category questions"):
        TrainConfig(knowledge_weight=1.0, task="kv").validate()
    with pytest.raises(GascanError, match="--induction-steps"):
        TrainConfig(induction_steps=-1).validate()


def test_placement_check_trains_one_hybrid_per_layer_and_resumes(tmp_path, capsys, monkeypatch):
    """`gascan toy placement`: the advice for the committed toy scan names layer 1 (its gather layer); one
    hybrid per (layer, seed) is trained with attention at that layer only; a rerun reuses finished runs."""
    from discovery.toy import placement_check

    scan = Path(__file__).resolve().parents[1] / "reports" / "toy-mc-transformer"
    ranking = placement_check.layer_ranking(scan)
    assert ranking[0]["layer"] == 1 and sorted(r["layer"] for r in ranking) == [0, 1, 2, 3]
    out = tmp_path / "place"
    args = ["toy", "placement", str(scan), "--out", str(out), "--try-layers", "1,3", "--seeds", "0", "--quiet",
            "--layers", "4", "--heads", "2", "--width", "32", "--ssm-heads", "4", "--ssm-state", "16", "--steps", "3",
            "--batch-size", "8", "--vocab-size", "400", "--train-size", "200", "--test-size", "32",
            "--task-option", "option_words=2"]
    assert main(args) == 0
    table = json.loads((out / "placement_check.json").read_text())
    assert table["recommended_layer"] == 1 and [r["layer"] for r in table["rows"]] == [1, 3]
    assert table["scan"] == str(scan.resolve())  # which scan the advice came from, for a later resume
    for row in table["rows"]:
        meta = json.loads((out / f"attn-L{row['layer']}" / "seed-0" / "training.json").read_text())
        assert meta["model_class"] == "BambaForCausalLM" and meta["config"]["attn_layers"] == [row["layer"]]
        assert row["accuracies"] == [meta["test_accuracy"]]
        assert row["first_steps_learned"] == [next((h["step"] for h in meta["history"] if h["test_accuracy"] >= 0.9),
                                                   None)]
    by_layer = {r["layer"]: r for r in table["rows"]}
    better = max(by_layer.values(), key=lambda r: r["mean_accuracy"])["mean_accuracy"]
    assert by_layer[table["best_layer"]]["mean_accuracy"] == better
    assert table["recommended_wins"] == (table["best_layer"] == 1)
    markdown = (out / "placement_check.md").read_text()
    assert "| layer 1 (recommended) | 1 |" in markdown and f"from the scan {scan.resolve()}." in markdown

    def no_training(*a, **k):
        raise AssertionError("a finished run was retrained")

    monkeypatch.setattr("discovery.toy.trainer.train", no_training)
    capsys.readouterr()
    assert main(args) == 0  # resumes: every run is read back
    assert "layer 1 (recommended)" in capsys.readouterr().out
    assert main([*args[:-2], "--layers", "3", "--task-option", "option_words=2"]) == 2
    assert "the scanned model has 4 layers" in capsys.readouterr().err
    assert main([*args, "--lr", "0.001"]) == 2  # a finished run of another recipe is never reused
    assert "trained with another recipe (lr differ)" in capsys.readouterr().err
