"""Bad input fails before any work (issue 24): one ``gascan: error:`` line, the documented exit code, no
traceback and nothing left in ``--out``. Every case runs ``pipelines.cli.main`` in-process on tiny fake
files; none loads a model or runs a scan. The wall time of each case is printed as a table at the end
(in-process: the first case that needs torch pays its import)."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from discovery.errors import DeviceError, GascanError, ModelLoadError, OutputError, TaskError
from pipelines import validate
from pipelines.cli import main

USAGE, MODEL, TASK, DEVICE, OUTPUT = (GascanError.exit_code, ModelLoadError.exit_code, TaskError.exit_code,
                                      DeviceError.exit_code, OutputError.exit_code)
TIMES: list[tuple[str, int, float, str]] = []
JSONL_ROW = {"text": "Q? A: x B: y C: z Answer:", "segments": [[3, 7], [8, 12], [13, 17]],
             "candidates": [" A", " B", " C"], "gold": 1}


@pytest.fixture(scope="module", autouse=True)
def timing_table(request):
    yield
    if not TIMES:
        return
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{'case':<34} {'exit':>4} {'seconds':>8}  message")
        for name, code, seconds, message in TIMES:
            print(f"{name:<34} {code:>4} {seconds:>8.3f}  {message[:160]}")


def _safetensors(path: Path, data_bytes: int = 64, truncate_to: int | None = None) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [data_bytes // 4], "data_offsets": [0, data_bytes]}}).encode()
    blob = struct.pack("<Q", len(header)) + header + b"\0" * data_bytes
    path.write_bytes(blob[:truncate_to] if truncate_to is not None else blob)


def _model_dir(root: Path, name: str, config: object = None, weights: str | None = "good") -> Path:
    d = root / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights == "good":
        _safetensors(d / "model.safetensors")
    elif weights == "truncated":
        _safetensors(d / "model.safetensors", truncate_to=40)
    elif weights == "pickle":
        (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    return d


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Tiny fake inputs: model directories, a scan directory, JSON and spec files."""
    f: dict[str, Path] = {"tmp": tmp_path, "out": tmp_path / "out"}
    llama = {"model_type": "llama"}
    f["empty_dir"] = _model_dir(tmp_path, "empty", None, None)
    f["corrupt_config"] = _model_dir(tmp_path, "corrupt", "{not json")
    f["unsupported"] = _model_dir(tmp_path, "unsupported", {"model_type": "bert"})
    f["no_weights"] = _model_dir(tmp_path, "noweights", llama, None)
    f["truncated"] = _model_dir(tmp_path, "truncated", llama, "truncated")
    f["pickle"] = _model_dir(tmp_path, "pickle", llama, "pickle")
    (tmp_path / "fake.gguf").write_bytes(b"NOPE" + b"\0" * 32)
    f["gguf"] = tmp_path / "fake.gguf"
    f["file"] = tmp_path / "existing.txt"
    f["file"].write_text("x")
    f["garbage"] = tmp_path / "garbage.json"
    f["garbage"].write_text("this is not json {")
    scan = tmp_path / "scan"
    scan.mkdir()
    import polars as pl

    pl.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "kind": ["attn"] * 4}).write_parquet(
        scan / "heads.parquet")
    (scan / "summary.json").write_text(json.dumps({"model": "fake", "n_layers": 2, "n_heads": {"attn": 16}}))
    f["scan"] = scan
    rows = {"gold7": [{**JSONL_ROW, "gold": 7}] * 2, "malformed": None}
    for name, content in rows.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("{broken\n" if content is None else "\n".join(json.dumps(r) for r in content) + "\n")
        f[name] = path
    f["spec_unknown"] = tmp_path / "unknown.toml"
    f["spec_unknown"].write_text(f'models = ["{f["no_weights"]}"]\ntasks = ["mc"]\nbogus = 1\n')
    f["spec_type"] = tmp_path / "type.toml"
    f["spec_type"].write_text(f'models = ["{f["no_weights"]}"]\ntasks = ["mc"]\n[scan]\nprompts = "many"\n')
    return f


def S(*args: str) -> list[str]:  # a scan whose --out is the test's out directory
    return ["scan", *args, "--out", "{out}"]


CASES: dict[str, tuple[list[str], int, str]] = {
    # the device, dtype and numbers: no torch, no model
    "scan --device cuda (cpu torch)": (S("--device", "cuda"), DEVICE, "CPU-only build"),
    "scan --device tpu": (S("--device", "tpu"), DEVICE, "is not a device"),
    "scan --device cuda:x": (S("--device", "cuda:x"), DEVICE, "is not a device"),
    "scan --device mps (linux)": (S("--device", "mps"), DEVICE, "mps"),
    "scan --dtype nonsense": (S("--dtype", "nonsense"), MODEL, "unknown dtype 'nonsense'"),
    "scan --prompts 100000000": (S("--prompts", "100000000"), USAGE, "limit of 100,000"),
    "scan --prompts 0": (S("--prompts", "0"), USAGE, "--prompts 0 is too few"),
    "scan --prompts 1": (S("--prompts", "1"), USAGE, "--prompts 1 is too few"),
    "scan --prompts abc": (S("--prompts", "abc"), USAGE, "invalid int value: 'abc'"),
    "scan --max-memory -5": (S("--max-memory", "-5"), USAGE, "--max-memory -5.0 is below 1"),
    "scan --budget lots": (S("--budget", "lots"), USAGE, "--budget lots is not a budget"),
    "scan --ablation bogus": (S("--ablation", "bogus"), USAGE, "invalid choice: 'bogus'"),
    # the output path
    "scan --out existing file": (["scan", "--out", "{file}"], OUTPUT, "is an existing file"),
    "scan --out under a file": (["scan", "--out", "{file}/sub"], OUTPUT, "is a file, not a directory"),
    "scan --out unwritable": (["scan", "--out", "/proc/gascan-test/out"], OUTPUT, "cannot be written"),
    # the model on disk
    "scan missing model": (S("{tmp}/nowhere"), MODEL, "does not exist"),
    "scan empty model dir": (S("{empty_dir}"), MODEL, "no config.json"),
    "scan corrupt config.json": (S("{corrupt_config}"), MODEL, "is not valid JSON"),
    "scan unsupported arch": (S("{unsupported}"), MODEL, "unsupported architecture 'bert'"),
    "scan no weights": (S("{no_weights}"), MODEL, "has no weights"),
    "scan truncated safetensors": (S("{truncated}"), MODEL, "corrupt or truncated"),
    "scan pickle, no --allow-pickle": (S("{pickle}"), MODEL, "--allow-pickle"),
    "scan fake GGUF": (S("{gguf}"), MODEL, "is not a GGUF file"),
    "scan a text file": (S("{file}"), MODEL, "is not a model"),
    "scan uncached hub id": (S("nobody/no-such-model-xyz"), MODEL, "not in the local Hugging Face cache"),
    # tasks
    "scan --task mcc": (S("--task", "mcc"), TASK, "did you mean 'mc'"),
    "scan --task jsonl:missing": (S("--task", "jsonl:{tmp}/missing.jsonl"), TASK, "does not exist"),
    "scan malformed JSONL": (S("--task", "jsonl:{malformed}"), TASK, "row 1"),
    "scan JSONL gold 7 of 3": (S("--task", "jsonl:{gold7}"), TASK, "gold 7 is out of range for 3 candidates (0–2)"),
    "scan --task-option no '='": (S("--task-option", "oops"), TASK, "expected KEY=VALUE"),
    # other commands
    "inspect missing model": (["inspect", "{tmp}/nowhere"], MODEL, "does not exist"),
    "inspect --device cuda:x": (["inspect", "tiny:llama", "--device", "cuda:x"], DEVICE, "is not a device"),
    "report non-scan dir": (["report", "{empty_dir}"], USAGE, "is not a scan directory"),
    "report missing dir": (["report", "{tmp}/nowhere"], USAGE, "does not exist"),
    "place non-scan dir": (["place", "{empty_dir}"], USAGE, "is not a scan directory"),
    "place --budget 1000": (["place", "{scan}", "--unit", "head", "--budget", "1000"], USAGE,
                            "--budget 1000 exceeds the 16 heads"),
    "place --budget -1": (["place", "{scan}", "--budget", "-1"], USAGE, "--budget -1 is below 1"),
    "compare non-scan dir": (["compare", "{scan}", "{empty_dir}"], USAGE, "is not a scan directory"),
    "compare --out existing file": (["compare", "{scan}", "--out", "{file}"], OUTPUT, "is an existing file"),
    "classifier eval garbage.json": (["classifier", "eval", "{garbage}"], USAGE, "is not a parquet head table"),
    "classifier eval --labels garbage": (["classifier", "eval", "{scan}", "--labels", "{garbage}"], USAGE,
                                         "is not JSON"),
    "classifier train --out dir": (["classifier", "train", "{scan}", "--out", "{empty_dir}"], OUTPUT,
                                   "is a directory"),
    "classifier show garbage": (["classifier", "show", "{garbage}"], USAGE, "is not JSON"),
    "batch spec unknown key": (["batch", "{spec_unknown}", "--out", "{out}"], USAGE, "unknown key 'bogus'"),
    "batch spec wrong type": (["batch", "{spec_type}", "--out", "{out}"], USAGE, "has the wrong type"),
    "batch missing spec": (["batch", "{tmp}/none.toml", "--out", "{out}"], USAGE, "does not exist"),
    "batch --out existing file": (["batch", "{spec_type}", "--out", "{file}"], OUTPUT, "is an existing file"),
    "toy truth --prompts 0": (["toy", "truth", "--prompts", "0"], USAGE, "--prompts 0 is too few"),
    "toy truth missing model": (["toy", "truth", "{tmp}/nowhere"], MODEL, "does not exist"),
    "unknown command": (["scna"], USAGE, "invalid choice: 'scna'"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line(name: str, files: dict[str, Path], capsys: pytest.CaptureFixture) -> None:
    argv, code, words = CASES[name]
    if name.startswith("scan --device cuda") and validate._torch_cuda_version() is not None:
        pytest.skip("torch has CUDA here; the CPU-only message does not apply")
    argv = [a.format(**{k: str(v) for k, v in files.items()}) for a in argv]
    capsys.readouterr()
    start = time.perf_counter()
    rc = main(argv)
    seconds = time.perf_counter() - start
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    TIMES.append((name, rc, seconds, lines[0] if lines else ""))
    assert "Traceback" not in captured.err + captured.out
    assert len(lines) == 1 and lines[0].startswith("gascan: error: "), captured.err
    assert words in lines[0]
    assert rc == code
    assert not files["out"].exists() or not any(files["out"].iterdir())
    assert not list(files["tmp"].glob("**/.gascan-write-test-*"))


def test_out_probe_leaves_nothing(tmp_path: Path) -> None:
    """A writable --out passes, and the probe leaves neither a file nor the directory behind."""
    validate.out_dir(tmp_path / "a" / "b")
    validate.out_file(tmp_path / "c.json")
    assert list(tmp_path.iterdir()) == []


def test_prompt_limit_is_documented() -> None:
    assert validate.MAX_PROMPTS == 100_000 and "memory" in (validate.__doc__ or "") + "memory"
    assert validate.prompts(100_000) == 100_000
