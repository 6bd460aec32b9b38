"""Loading checkpoints: saved directories, cached hub ids, the safety opt-ins, and every loading error
(one line on stderr naming the problem and the fix, non-zero exit) through ``gascan inspect``."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from discovery.errors import ModelLoadError
from discovery.model.loading import load_model
from discovery.model.tables import supported_model_types
from discovery.model.tiny import tiny_model, tiny_tokenizer
from pipelines.cli import main

ARCH = "llama"
LOAD_EXIT = ModelLoadError.exit_code


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved with save_pretrained (safetensors) and its tokenizer beside it."""
    directory = tmp_path_factory.mktemp("saved") / "tiny-llama"
    tiny_model(ARCH).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


@pytest.fixture
def copy(saved: Path, tmp_path: Path):
    """A fresh copy of the saved model to break in one test."""

    def make(name: str = "model") -> Path:
        target = tmp_path / name
        shutil.copytree(saved, target)
        return target

    return make


def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))  # [batch, pos]


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids()).logits  # [batch, pos, vocab]


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """Logits of the in-memory model the saved one was built from (same seed)."""
    return logits(tiny_model(ARCH))  # [batch, pos, vocab]


def run_inspect(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["inspect", *args, "--json"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def assert_one_line_error(capsys: pytest.CaptureFixture, args: list[str], *words: str) -> str:
    """``gascan inspect ARGS`` fails with the loading exit code and one stderr line holding ``words``."""
    rc, out, err = run_inspect(capsys, *args)
    assert rc == LOAD_EXIT != 0
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("gascan: error: ") and ". Fix: " in err
    for word in words:
        assert word in err, (word, err)
    return err


# ------------------------------------------------------------------------------------------- success


def test_saved_directory_loads_with_same_logits(saved: Path, reference: torch.Tensor,
                                                capsys: pytest.CaptureFixture) -> None:
    lm = load_model(saved)
    assert lm.files == [saved / "model.safetensors"]
    assert lm.inventory.n_heads() == {"attn": 12, "ssm": 0}
    assert lm.tokenizer("Answer: B")["input_ids"] == tiny_tokenizer()("Answer: B")["input_ids"]
    torch.testing.assert_close(logits(lm.model), reference, atol=1e-5, rtol=0)
    rc, out, err = run_inspect(capsys, str(saved))
    assert rc == 0 and err == ""  # no progress bars or warnings on a clean load
    assert json.loads(out)["n_heads"] == {"attn": 12, "ssm": 0}


def test_dtype_option(saved: Path, reference: torch.Tensor, capsys: pytest.CaptureFixture) -> None:
    lm = load_model(saved, dtype="bfloat16")
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(logits(lm.model).float(), reference, atol=0.15, rtol=0.05)
    assert_one_line_error(capsys, [str(saved), "--dtype", "int7"], "unknown dtype 'int7'", "bfloat16")


def test_cached_hub_id_loads_offline(saved: Path, reference: torch.Tensor, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id present in the local cache (the hub's own snapshot layout) loads without a network."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    repo = cache / "models--gascan-test--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(saved, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    lm = load_model("gascan-test/tiny-llama")
    assert lm.files == [repo / "snapshots" / commit / "model.safetensors"]
    torch.testing.assert_close(logits(lm.model), reference, atol=1e-5, rtol=0)


# -------------------------------------------------------------------------------------------- errors


def test_path_missing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "no-such-model"
    assert_one_line_error(capsys, [str(missing)], "does not exist", str(missing), "tiny:ARCH")


def test_file_that_is_not_a_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert_one_line_error(capsys, [str(text)], "is not a model", ".gguf")


def test_directory_without_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert_one_line_error(capsys, [str(tmp_path)], "not a model directory", "no config.json")


def test_invalid_config_json(copy, capsys: pytest.CaptureFixture) -> None:
    directory = copy()
    (directory / "config.json").write_text('{"model_type": "llama",')
    assert_one_line_error(capsys, [str(directory)], "config.json is not valid JSON")


def test_unsupported_architecture(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    err = assert_one_line_error(capsys, [str(tmp_path)], "unsupported architecture 'bert'",
                                "gascan supports:")
    for model_type in supported_model_types():
        assert model_type in err
    families = {"llama", "gpt2", "mamba", "mamba2", "zamba2", "jamba", "bamba", "falcon_h1"}
    assert families <= set(supported_model_types())


def test_no_weights(copy, capsys: pytest.CaptureFixture) -> None:
    directory = copy()
    (directory / "model.safetensors").unlink()
    assert_one_line_error(capsys, [str(directory)], "has no weights", "*.safetensors")


@pytest.mark.parametrize("cut", ["half", "last_bytes", "empty"])
def test_truncated_weights(copy, cut: str, capsys: pytest.CaptureFixture) -> None:
    directory = copy()
    weights = directory / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate({"half": size // 2, "last_bytes": size - 8, "empty": 0}[cut])
    assert_one_line_error(capsys, [str(directory)], "could not load the weights", str(directory),
                          "corrupt or truncated")


def test_corrupt_header(copy, capsys: pytest.CaptureFixture) -> None:
    directory = copy()
    with open(directory / "model.safetensors", "r+b") as handle:
        handle.seek(8)  # after the header length: the JSON header itself
        handle.write(b"\x00garbage")
    assert_one_line_error(capsys, [str(directory)], "could not load the weights", "corrupt or truncated")


def test_no_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    directory = tmp_path / "bare"
    tiny_model(ARCH).save_pretrained(directory)  # weights only
    assert_one_line_error(capsys, [str(directory)], "no usable tokenizer", "tokenizer.json")


def test_pickled_weights_need_opt_in(copy, reference: torch.Tensor, capsys: pytest.CaptureFixture) -> None:
    directory = copy()
    (directory / "model.safetensors").unlink()
    torch.save(tiny_model(ARCH).state_dict(), directory / "pytorch_model.bin")
    assert_one_line_error(capsys, [str(directory)], "pickled weights", "pytorch_model.bin", "--allow-pickle")
    with pytest.raises(ModelLoadError, match="pickled"):
        load_model(directory)
    rc, out, err = run_inspect(capsys, str(directory), "--allow-pickle")
    assert rc == 0 and err == "" and json.loads(out)["n_heads"] == {"attn": 12, "ssm": 0}
    lm = load_model(directory, allow_pickle=True)
    assert lm.files == [directory / "pytorch_model.bin"]
    torch.testing.assert_close(logits(lm.model), reference, atol=1e-5, rtol=0)


def test_remote_code_needs_opt_in(copy, reference: torch.Tensor, tmp_path: Path,
                                  capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers.dynamic_module_utils as dynamic

    directory = copy("custom")
    (directory / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\n\nclass CustomLlama(LlamaForCausalLM):\n    pass\n")
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomLlama"}
    (directory / "config.json").write_text(json.dumps(config))
    assert_one_line_error(capsys, [str(directory)], "auto_map", "custom code", "--trust-remote-code")
    # with the opt-in the checkpoint's own class runs; its module copy goes to a temporary cache
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    lm = load_model(directory, trust_remote_code=True)
    assert type(lm.model).__name__ == "CustomLlama"
    torch.testing.assert_close(logits(lm.model), reference, atol=1e-5, rtol=0)


def test_hub_id_not_cached_never_downloads(tmp_path: Path, capsys: pytest.CaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    empty = tmp_path / "empty-cache"
    empty.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(empty))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(empty))
    monkeypatch.chdir(tmp_path)  # so "org/name" is not a relative path by accident
    assert_one_line_error(capsys, ["HuggingFaceTB/SmolLM2-135M"], "'HuggingFaceTB/SmolLM2-135M'",
                          "not in the local Hugging Face cache", "never downloads", "hf download")
    assert os.listdir(empty) == []  # nothing was fetched or created


def test_unknown_tiny_architecture(capsys: pytest.CaptureFixture) -> None:
    rc, out, err = run_inspect(capsys, "tiny:bert")
    assert rc != 0 and out == "" and err.count("\n") == 1
    assert "no tiny config for 'bert'" in err and "llama" in err


def test_bundled_models_have_machine_independent_specs(capsys: pytest.CaptureFixture) -> None:
    from discovery.model.loading import load_model

    assert load_model().spec == "bundled:mc-transformer"  # no spec: the default, named without a path
    rc, out, _err = run_inspect(capsys, "bundled:mc1-transformer")
    assert rc == 0 and json.loads(out)["n_layers"] == 4
    assert_one_line_error(capsys, ["bundled:nope"], "no bundled toy model 'nope'", "mc1-transformer")
