"""``gascan inspect``: the head inventory of every supported architecture, from its config.

Expected counts are derived here from the tiny configs by each family's own rules (which layers are
attention, heads per layer, Mamba-1 channel groups), independently of the adapter's tables.
"""
from __future__ import annotations

import json

import pytest

from discovery.model.loading import load_model
from discovery.model.tiny import TINY_CONFIGS
from pipelines.cli import main

ARCHS = sorted(TINY_CONFIGS)
ATTENTION_ONLY = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"}
TOP_KEYS = {"architecture", "n_layers", "layers", "n_heads"}
LAYER_KEYS = {"index", "kinds", "heads"}
LAYER_EXTRA_KEYS = {"widths"}  # allowed beside the stable keys


def expected_layers(arch: str, mamba1_width: int | None = None) -> list[dict[str, tuple[int, int]]]:
    """Per layer ``{kind: (count, width)}`` from the config's own fields."""
    cfg = TINY_CONFIGS[arch]

    def mamba1(channels: int) -> tuple[int, int]:
        width = mamba1_width or channels // 32
        return channels // width, width

    if arch in ATTENTION_ONLY:
        heads = cfg["num_attention_heads"]
        width = cfg.get("head_dim", cfg["hidden_size"] // heads)
        return [{"attn": (heads, width)} for _ in range(cfg["num_hidden_layers"])]
    if arch == "gpt2":
        return [{"attn": (cfg["n_head"], cfg["n_embd"] // cfg["n_head"])} for _ in range(cfg["n_layer"])]
    if arch in ("mamba", "falcon_mamba"):
        return [{"ssm": mamba1(cfg["expand"] * cfg["hidden_size"])} for _ in range(cfg["num_hidden_layers"])]
    if arch == "mamba2":
        return [{"ssm": (cfg["num_heads"], cfg["head_dim"])} for _ in range(cfg["num_hidden_layers"])]
    if arch == "zamba2":  # hybrid layers: the shared attention block (on 2 x hidden) plus a Mamba-2 mixer
        ssm = (cfg["n_mamba_heads"], cfg["mamba_headdim"])
        attn = (cfg["num_attention_heads"], 2 * cfg["hidden_size"] // cfg["num_attention_heads"])
        return [{"attn": attn, "ssm": ssm} if kind == "hybrid" else {"ssm": ssm}
                for kind in cfg["layers_block_type"]]
    if arch == "jamba":
        attn = (cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"])
        ssm = mamba1(cfg["mamba_expand"] * cfg["hidden_size"])
        return [{"attn": attn} if i % cfg["attn_layer_period"] == cfg["attn_layer_offset"] else {"ssm": ssm}
                for i in range(cfg["num_hidden_layers"])]
    if arch == "bamba":
        attn = (cfg["num_attention_heads"], cfg["hidden_size"] // cfg["num_attention_heads"])
        ssm = (cfg["mamba_n_heads"], cfg["mamba_d_head"])
        return [{"attn": attn} if i in cfg["attn_layer_indices"] else {"ssm": ssm}
                for i in range(cfg["num_hidden_layers"])]
    if arch == "falcon_h1":
        both = {"attn": (cfg["num_attention_heads"], cfg["head_dim"]),
                "ssm": (cfg["mamba_n_heads"], cfg["mamba_d_head"])}
        return [dict(both) for _ in range(cfg["num_hidden_layers"])]
    raise AssertionError(f"no expectation written for {arch}: add one when adding a tiny config")


def inspect_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    capsys.readouterr()
    rc = main(["inspect", *args, "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    return json.loads(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_json_counts(arch: str, capsys: pytest.CaptureFixture) -> None:
    data = inspect_json(capsys, f"tiny:{arch}")
    want = expected_layers(arch)
    assert set(data) == TOP_KEYS
    assert data["architecture"] == arch
    assert data["n_layers"] == len(want) == len(data["layers"])
    for index, (layer, exp) in enumerate(zip(data["layers"], want)):
        assert LAYER_KEYS <= set(layer) <= LAYER_KEYS | LAYER_EXTRA_KEYS
        assert set(layer["heads"]) == {"attn", "ssm"}
        assert layer["index"] == index
        assert layer["kinds"] == [k for k in ("attn", "ssm") if k in exp]  # attn listed first
        assert layer["heads"] == {k: exp.get(k, (0, 0))[0] for k in ("attn", "ssm")}
        assert layer["widths"] == {k: w for k, (_, w) in exp.items()}
    assert data["n_heads"] == {k: sum(e.get(k, (0, 0))[0] for e in want) for k in ("attn", "ssm")}


def test_hybrids_list_both_kinds_in_the_right_layers(capsys: pytest.CaptureFixture) -> None:
    """Spelled out for the hybrids, so a wrong rule in expected_layers cannot hide a wrong table."""
    kinds = {arch: [layer["kinds"] for layer in inspect_json(capsys, f"tiny:{arch}")["layers"]]
             for arch in ("zamba2", "jamba", "bamba", "falcon_h1")}
    assert kinds["zamba2"] == [["ssm"], ["attn", "ssm"], ["ssm"], ["attn", "ssm"]]
    assert kinds["jamba"] == [["ssm"], ["attn"], ["ssm"], ["attn"]]
    assert kinds["bamba"] == [["ssm"], ["attn"], ["ssm"], ["attn"]]
    assert kinds["falcon_h1"] == [["attn", "ssm"]] * 3


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "jamba"])
def test_mamba1_group_width(arch: str, capsys: pytest.CaptureFixture) -> None:
    channels = 128  # expand 2 x hidden 64 in every tiny Mamba-1 config
    default = inspect_json(capsys, f"tiny:{arch}")
    ssm_layers = [layer for layer in default["layers"] if "ssm" in layer["kinds"]]
    assert ssm_layers
    assert all(layer["heads"]["ssm"] == 32 and layer["widths"]["ssm"] == 4 for layer in ssm_layers)
    channel_level = inspect_json(capsys, f"tiny:{arch}", "--mamba1-group-width", "1")
    for layer in channel_level["layers"]:
        if "ssm" in layer["kinds"]:
            assert layer["heads"]["ssm"] == channels and layer["widths"]["ssm"] == 1
    assert channel_level["n_heads"]["ssm"] == channels * len(ssm_layers)
    assert channel_level["n_heads"]["attn"] == default["n_heads"]["attn"]
    wide = inspect_json(capsys, f"tiny:{arch}", "--mamba1-group-width", "16")
    assert wide["n_heads"]["ssm"] == 8 * len(ssm_layers)
    assert [layer["heads"]["ssm"] for layer in wide["layers"]] == \
        [e.get("ssm", (0, 0))[0] for e in expected_layers(arch, 16)]
    assert all(layer["widths"].get("ssm", 16) == 16 for layer in wide["layers"])


def test_mamba1_group_width_that_does_not_divide(capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    rc = main(["inspect", "tiny:mamba", "--json", "--mamba1-group-width", "3"])
    captured = capsys.readouterr()
    assert rc != 0 and captured.out == ""
    assert captured.err.count("\n") == 1
    assert "width 3 does not divide the 128 channels" in captured.err
    assert "--mamba1-group-width" in captured.err


@pytest.mark.parametrize("arch", ARCHS)
def test_inventory_matches_output_projections(arch: str) -> None:
    """Each group's heads tile its output projection's input exactly (what ablation slices rely on)."""
    lm = load_model(f"tiny:{arch}")
    inv = lm.inventory
    assert len(inv.heads()) == sum(inv.n_heads().values())
    assert len(set(inv.heads())) == len(inv.heads())  # HeadIds are unique
    for group in inv.groups:
        weight = lm.adapter.out_proj_weight(group.layer, group.kind)  # [d_model, in_features]
        assert group.count * group.width == weight.shape[1]
        assert group.columns(group.count - 1).stop == weight.shape[1]
        assert lm.model.get_submodule(group.out_proj) is lm.adapter.out_proj(group.layer, group.kind)


@pytest.mark.parametrize("arch", ["zamba2", "llama", "mamba"])
def test_rich_table(arch: str, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    assert main(["inspect", f"tiny:{arch}"]) == 0
    out = capsys.readouterr().out
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in out.splitlines() if line.count("│") >= 6]
    data = [r for r in rows if r[0].isdigit()]
    totals = [r for r in rows if r[0] == "total"]
    want = expected_layers(arch)
    assert [int(r[0]) for r in data] == list(range(len(want)))
    for row, exp in zip(data, want):
        assert row[1] == ",".join(k for k in ("attn", "ssm") if k in exp)
        assert (int(row[2]), int(row[3])) == (exp.get("attn", (0,))[0], exp.get("ssm", (0,))[0])
        assert row[4] == "/".join(str(exp[k][1]) if k in exp else "-" for k in ("attn", "ssm"))
    assert len(totals) == 1
    assert (int(totals[0][2]), int(totals[0][3])) == tuple(
        sum(e.get(k, (0,))[0] for e in want) for k in ("attn", "ssm"))
