"""The per-model report: content from a real scan of a tiny model, escaping, figures, rebuilds."""
from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from synthetic import synthetic_heads, synthetic_summary, write_synthetic_scan

from discovery.artifacts import read_scan
from discovery.report import load_example, save_example, write_report
from pipelines.cli import main

EVIL = "<script>alert(1)</script>"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_scan(tmp_path_factory):
    """A real scan of tiny:llama (8 prompts of mc) and the loaded model."""
    from discovery.artifacts import write_scan
    from discovery.model.loading import load_model
    from pipelines.sweep import ScanOptions, scan_model

    lm = load_model("tiny:llama")
    heads, summary = scan_model(lm, ScanOptions(prompts=8, bootstrap=200))
    out = write_scan(tmp_path_factory.mktemp("scan"), heads, summary)
    return out, lm


def _images(html_text: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html_text)]


def test_report_of_a_real_scan_has_every_part(tiny_scan):
    out, lm = tiny_scan
    path = write_report(out, lm)
    html_text = path.read_text()
    md = (out / "report.md").read_text()
    # clean scores from summary.json appear in both documents
    summary = json.loads((out / "summary.json").read_text())
    acc = summary["tasks"]["mc"]["clean"]["acc"]
    assert f"{acc:.3f}" in html_text and f"{acc:.3f}" in md
    for title in ("Clean scores", "How the verdict was decided", "Heads with the largest effects",
                  "G&amp;A depth profile", "Layer × head maps", "Example attention patterns", "Where attention belongs"):
        assert f"<summary>{title}" in html_text, title  # appendix sections are closed <details>
    # no verdict stored and decide() unavailable in this install, or decided: either way a verdict element
    assert 'id="verdict"' in html_text and "**Verdict" in md
    # figures: PNG files on disk, the same images embedded (self-contained: no external src)
    figures = sorted((out / "figures").glob("*.png"))
    names = {f.stem for f in figures}
    assert {"effect_map", "depth_profile_0", "heatmap_0_attn", "example_patterns"} <= names
    embedded = _images(html_text)
    assert len(embedded) == len(figures)
    assert all(img.startswith(PNG_MAGIC) for img in embedded)
    assert {img for img in embedded} == {f.read_bytes() for f in figures}
    assert not re.search(r'src="(?!data:)', html_text)
    for f in figures:
        assert f"figures/{f.name}" in md
    # the head with the largest drop is listed first in the effects table
    frame = pl.read_parquet(out / "heads.parquet")
    top = frame.sort("d_ld_all").row(0, named=True)
    assert f"L{top['layer']}H{top['head']}" in html_text
    # the example pattern was saved without pickle and matches the model's own attention rows
    example = load_example(out / "patterns.npz")
    assert example["patterns"].ndim == 3 and example["patterns"].shape[0] == 2
    q = example["query_pos"]
    np.testing.assert_allclose(example["patterns"][:, q, : q + 1].sum(-1), 1.0, atol=1e-4)
    assert example["tokens"][q] == ":"  # "...Answer:" ends the prompt
    assert all(example["tokens"][p] == "\n" for p in example["summary_pos"])


def test_rebuild_without_the_model_reuses_saved_patterns(tiny_scan, tmp_path):
    out, lm = tiny_scan
    write_report(out, lm)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("heads.parquet", "summary.json", "patterns.npz"):
        (copy / name).write_bytes((out / name).read_bytes())
    summary = json.loads((copy / "summary.json").read_text())
    summary["spec"] = "/nowhere/big-model"  # not loadable: the figure must come from patterns.npz
    (copy / "summary.json").write_text(json.dumps(summary))
    assert main(["report", str(copy)]) == 0
    assert (copy / "figures" / "example_patterns.png").read_bytes() == (out / "figures" / "example_patterns.png").read_bytes()


def test_every_string_from_models_and_tokens_is_escaped(tmp_path):
    out = write_synthetic_scan(tmp_path / "scan", model=EVIL)
    summary = json.loads((out / "summary.json").read_text())
    summary["architecture"] = EVIL
    summary["tasks"] = {EVIL: summary["tasks"]["mc"]}
    (out / "summary.json").write_text(json.dumps(summary))
    frame = pl.read_parquet(out / "heads.parquet").with_columns(pl.lit(EVIL).alias("task"))
    frame.write_parquet(out / "heads.parquet")
    n = 12
    save_example(out / "patterns.npz", {
        "task": EVIL, "prompt_index": 0, "tokens": ["Q", EVIL, "\n", "a", "\n", "Answer", ":", "x", "y", "z", "w", "v"],
        "patterns": np.tril(np.ones((2, n, n), dtype=np.float32)), "layers": [2, 3], "heads": [1, 2],
        "kinds": ["attn", "attn"], "roles": ["gather", "aggregate"], "names": [EVIL, "L3H2"],
        "summary_pos": [2, 4], "query_pos": 6, "gold_segment": 0})
    write_report(out)
    html_text = (out / "report.html").read_text()
    md = (out / "report.md").read_text()
    assert "<script" not in html_text.lower()
    # Markdown: no raw HTML (every < is backslash-escaped outside the fenced token list) and no entities
    prose = re.sub(r"```+text\n.*?\n```+", "", md, flags=re.DOTALL)
    assert not re.search(r"(?<!\\)<", prose)
    assert "&lt;" not in md and "&gt;" not in md
    escaped = "&lt;script&gt;alert(1)&lt;/script&gt;"
    assert html_text.count(escaped) >= 5  # title, header, task rows, example tokens, head names
    assert r"\<script\>alert(1)\</script\>" in md
    # the token itself is shown in the example prompt's token list
    assert re.search(r"<pre>[^<]*" + re.escape(escaped), html_text)
    assert (out / "figures" / "example_patterns.png").read_bytes().startswith(PNG_MAGIC)


def test_hybrid_gets_separate_attention_and_ssm_maps(tmp_path):
    out = tmp_path / "hybrid"
    out.mkdir()
    heads = synthetic_heads("hybrid", ssm_layers=(0, 2, 4), gather=(2, 1), aggregate=(3, 2))
    heads.write_parquet(out / "heads.parquet")
    summary = synthetic_summary("hybrid", architecture="bamba", ssm_heads=12)
    (out / "summary.json").write_text(json.dumps(summary))
    write_report(out)
    names = {p.stem for p in (out / "figures").glob("*.png")}
    assert {"heatmap_0_attn", "heatmap_0_ssm"} <= names
    md = (out / "report.md").read_text()
    assert "Skipped: the example attention pattern needs the model" in md
    # placement: the SSM gather head's layer gets "insert attention", the attention aggregate layer "keep"
    assert re.search(r"\| L2S1 \| insert attention \|", md)
    assert re.search(r"\| L3H2 \| keep attention \|", md)


def test_report_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0] and "Fix:" in err[0]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "heads.parquet").write_bytes(b"not parquet")
    (tmp_path / "bad" / "summary.json").write_text("{}")
    with pytest.raises(Exception) as info:
        read_scan(tmp_path / "bad")
    assert "cannot read the scan" in str(info.value)


TOY = Path(__file__).resolve().parents[1] / "reports" / "toy-mc-transformer"
PCT = re.compile(r"([+-]?\d+(?:\.\d+)?) \(([+-]?\d+)% of clean\)")


@pytest.fixture(scope="module")
def toy_report(tmp_path_factory):
    """The committed toy scan's tables, copied, with a hand-built verdict (a stand-in for decide()) in
    summary.json, and its report rebuilt from the tables alone."""
    import shutil

    from verdict_standin import standin_verdict

    out = tmp_path_factory.mktemp("toy") / "scan"
    shutil.copytree(TOY, out, ignore=shutil.ignore_patterns("report.*", "figures"))
    summary = json.loads((out / "summary.json").read_text())
    verdict = standin_verdict(summary, pl.read_parquet(out / "pairs.parquet").to_dicts(),
                              sentence="Stand-in: gather L1H0 -> aggregate L3H1 <|bos|> & co.")
    summary["verdict"] = verdict.as_dict()
    (out / "summary.json").write_text(json.dumps(summary))
    write_report(out)
    return out, verdict


def _first_screen_md(md: str) -> str:
    return md.split("\n---\n")[0]


def test_the_report_renders_the_stored_verdict(toy_report):
    out, verdict = toy_report
    html_text, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    verdict_html = re.search(r'<section id="verdict".*?</section>', html_text, re.DOTALL).group(0)
    assert "Stand-in: gather L1H0 -&gt; aggregate L3H1 &lt;|bos|&gt; &amp; co." in verdict_html
    assert f"confidence: {verdict.tasks[0].confidence}" in verdict_html
    assert r"Stand-in: gather L1H0 -\> aggregate L3H1 \<\|bos\|\> & co." in _first_screen_md(md)
    # the pair table's status column is the verdict's: every tested pair's status appears in its row
    for call in verdict.tasks[0].pairs:
        status = call.status.replace("_", " ")
        assert re.search(rf"\| {call.rank} \| {call.gather.name} \| {call.aggregate.name} \|[^\n]*\| {status} \|", md)


def test_markdown_has_no_html_entities_and_percentages_keep_their_sign(toy_report):
    out, _ = toy_report
    md = (out / "report.md").read_text()
    for entity in ("&gt;", "&lt;", "&amp;"):
        assert entity not in md
    found = PCT.findall(md)
    assert len(found) >= 5
    for number, pct in found:
        if float(number) != 0 and int(pct) != 0:
            assert (float(number) > 0) == (int(pct) > 0), (number, pct)
    assert not re.search(r"-\d+% cost|costs -\d", md)
    # the G&A heads help: their drop is positive, never printed as a negative cost
    assert re.search(r"\| L1H0 \| gather \| \+\d", md)


def test_the_first_screen_is_short(toy_report):
    out, _ = toy_report
    html_text, md = (out / "report.html").read_text(), (out / "report.md").read_text()
    ranked = re.search(r'<table id="ranked">(.*?)</table>', html_text, re.DOTALL).group(1)
    rows = re.findall(r"<tr>(.*?)</tr>", ranked, re.DOTALL)
    assert 2 <= len(rows) <= 11  # header + at most 10 heads
    assert all(len(re.findall(r"<t[hd][ >]", r)) <= 7 for r in rows)
    first = _first_screen_md(md)
    table = [line for line in first.splitlines() if line.startswith("|") and not line.startswith("|---")]
    assert 2 <= len(table) <= 11 and all(line.count(" | ") + 1 <= 7 for line in table)
    assert first.count("![") == 1 and "figures/effect_map.png" in first  # one figure on the first screen
    # the appendix is folded: every section after the first screen is a closed <details>
    appendix = html_text.split("<h2>Appendix</h2>")[1]
    assert appendix.count("<details>") >= 8 and "<details open" not in appendix
    # long lists are cut: the toy's roles name at most ten heads per role
    roles = md.split("## Roles by the evidence standards")[1].split("\n## ")[0]
    for line in roles.splitlines():
        if line.startswith("mc:") and "more; full list in evidence.parquet" in line:
            assert line.count("L") <= 45


def test_where_it_acts_shows_the_gather_heads_segment_drop_and_which_model_showed_it():
    """Gemma3-270M's verdict gather L5H3 helps when ablated everywhere (drop -0.17) yet carries the task at
    its segments in the minimal model (+1.03 of a clean 6.08): the first screen shows that drop, not a dash."""
    from discovery.report.first_screen import acts_at

    gather = {"where": "none", "mm_where": "segments", "d_ld_segment": 0.03, "d_ld_segment_lo": -0.08,
              "d_ld_segment_hi": 0.15, "mm_d_ld_segment": -1.03, "mm_d_ld_segment_lo": -1.67,
              "mm_d_ld_segment_hi": -0.39}
    assert acts_at(gather, "gather") == "segments +1.03 [+0.39, +1.67] †"
    aggregate = {"where": "query", "mm_where": "query", "d_ld_query": -1.32, "d_ld_query_lo": -1.61,
                 "d_ld_query_hi": -1.03, "mm_d_ld_query": -19.3}
    assert acts_at(aggregate, "aggregate") == "query +1.32 [+1.03, +1.61]"  # the full model's, when it shows it
    assert acts_at({"where": "elsewhere", "mm_where": None}, "other_important") == "–"
    assert acts_at({"where": "summary tokens", "d_ld_summary": -0.2}, None) == "summary tokens +0.20"
    # in the narrow first-screen column a cell wraps only before its interval or between scope words
    summary = {"where": "summary tokens", "d_ld_summary": -1.18, "d_ld_summary_lo": -1.76, "d_ld_summary_hi": -0.67}
    assert acts_at(summary, None, space="\u00a0") == "summary tokens\u00a0+1.18 [+0.67,\u00a0+1.76]"
    assert acts_at({"where": "none"}, None, space="\u00a0") == "–"


def test_effect_map_marks_in_capitals_only_the_heads_the_verdict_sentence_names():
    """SmolLM2's verdict names L16H0, L16H2 -> L18H6; L17H8 has the gather role but is in no verified pair: the
    map marks it ``g`` and the legend says what the lower case means (the map read ``G`` on it before)."""
    from discovery.rank.verdict import HeadRef, PairCall, TaskVerdict, Verdict
    from discovery.report.first_screen import marks, marks_legend

    def pair(gather: int, status: str) -> PairCall:
        return PairCall("kv", 0, HeadRef(16, gather, "attn"), HeadRef(18, 6, "attn"), status, 0.2, 0.1, 0.3, 0.0,
                        0.05, 50, 0.02, "gather", "aggregate", 0.9, 0.9)

    heads = pl.DataFrame({"task": ["kv"] * 4, "layer": [16, 16, 17, 18], "head": [0, 2, 8, 6],
                          "kind": ["attn"] * 4, "role": ["gather", "gather", "gather", "aggregate"]})
    verified = TaskVerdict("kv", "verified", "G&A verified: ...", "high", "", (pair(0, "verified"),
                           pair(2, "not_significant")), ("L16H0", "L16H2", "L17H8"), ("L18H6",))
    shown = marks(Verdict((verified,)), heads)
    assert shown == {"kv": [(16, 0, "attn", "G"), (16, 2, "attn", "g"), (17, 8, "attn", "g"), (18, 6, "attn", "A")]}
    assert "g / a: heads with that role" in marks_legend(Verdict((verified,)), shown)
    # a G&A-like verdict names every role head; without a verdict the evidence roles are all capitals
    like = TaskVerdict("kv", "ga_like", "G&A-like heads ...", "low", "", (), ("L16H0", "L16H2", "L17H8"), ("L18H6",))
    assert [m[3] for m in marks(Verdict((like,)), heads)["kv"]] == ["G", "G", "G", "A"]
    assert [m[3] for m in marks(None, heads)["kv"]] == ["G", "G", "G", "A"]
    assert "g / a" not in marks_legend(None, marks(None, heads))
    # a Mamba-1 group refined to channels without a role is marked "c": no g / a legend for it
    assert "g / a" not in marks_legend(Verdict((verified,)), {"mc": [(0, 9, "ssm", "c")]})
