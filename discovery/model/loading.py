"""Load a checkpoint safely: a local HF directory, a cached hub id (offline), a ``.gguf`` file,
``tiny:ARCH`` (a random tiny model for plumbing), ``bundled:NAME`` (a toy model shipped in the package:
``mc-transformer``, ``mc-mamba2``, ``mc-mamba2-k2``, ``mc-hybrid``, ``mc1-transformer``, ``mc3-transformer``), or nothing (the bundled default, ``bundled:mc-transformer``).

Weights load without executing code: safetensors and GGUF by default; pickled weights and remote
code only with explicit opt-ins. Every failure is one line with the fix (:class:`ModelLoadError`).
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from discovery.errors import ModelLoadError
from discovery.model import PICKLE_SUFFIXES
from discovery.model.adapter import Adapter, adapter_for

# what a spec names, and the cheap checks of what is there, live in the torch-free discovery.model.spec
# (re-exported here: callers import resolve_spec, PACKAGED, ... from the loader)
from discovery.model.spec import (  # noqa: F401
    BUNDLED_SPEC,
    DTYPE_NAMES,
    PACKAGED,
    _hub_cache_dir,
    check_dtype,
    check_gguf,
    packaged_checkpoint,
    resolve_spec,
)
from discovery.model.spec import check_directory as _check_directory

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64}
assert set(DTYPES) == set(DTYPE_NAMES)


@dataclass
class LoadedModel:
    """A model ready for scanning: the module, its tokenizer, its adapter and where it came from."""

    model: torch.nn.Module
    tokenizer: Any
    adapter: Adapter
    spec: str
    files: list[Path] = field(default_factory=list)
    _hash: str | None = field(default=None, repr=False)

    @property
    def inventory(self):
        return self.adapter.inventory

    @property
    def name(self) -> str:
        return Path(self.spec).name if self.files else self.spec

    def checkpoint_hash(self) -> str:
        """sha256 over the weight files' bytes (or the parameters, for in-memory models); cached."""
        if self._hash is None:
            digest = hashlib.sha256()
            if self.files:
                for path in sorted(self.files):
                    digest.update(path.name.encode())
                    with open(path, "rb") as handle:
                        for block in iter(lambda: handle.read(1 << 22), b""):
                            digest.update(block)
            else:
                for name, tensor in sorted(self.model.state_dict().items()):
                    digest.update(name.encode())
                    digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            self._hash = digest.hexdigest()[:16]
        return self._hash


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    check_dtype(dtype)
    return DTYPES[dtype]


def load_tokenizer(spec: str | os.PathLike | None, *, trust_remote_code: bool = False):
    """Load only the tokenizer of a model spec (no weights)."""
    from transformers import AutoTokenizer

    kind, directory, name = resolve_spec(spec)
    if kind == "tiny":
        from discovery.model.tiny import tiny_tokenizer

        return tiny_tokenizer()
    try:
        if kind == "gguf":
            return AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
        return AutoTokenizer.from_pretrained(directory, local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as err:  # transformers raises many types here
        raise ModelLoadError(f"no usable tokenizer in {directory} ({err.__class__.__name__})",
                             "copy tokenizer.json / tokenizer_config.json next to the weights") from None


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Share one read-only ``gguf.GGUFReader`` per file while a GGUF checkpoint loads.

    transformers parses the file once for the config, once for the weights and once for the tokenizer;
    on Gemma3-270M (a 262k-token vocabulary) each parse takes ~8 s of a ~39 s load. The reader only
    maps the file and indexes its fields, and nothing in the load writes to it, so one serves all three.
    """
    from unittest import mock

    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: os.PathLike | str, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    with mock.patch.object(gguf, "GGUFReader", shared_reader):
        yield


def load_model(
    spec: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | None = "float32",
    device: str = "cpu",
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    mamba1_group_width: int | None = None,
) -> LoadedModel:
    """Load a model spec (see module docstring) with its tokenizer and adapter, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch_dtype = _dtype(dtype)
    kind, directory, name = resolve_spec(spec)
    if kind == "tiny":
        from discovery.model.tiny import tiny_model, tiny_tokenizer

        model = tiny_model(name, attn_implementation=attn_implementation).to(torch_dtype).to(device)
        return LoadedModel(model, tiny_tokenizer(), adapter_for(model, mamba1_group_width), str(spec))
    assert directory is not None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if kind == "dir":  # check the folder, then its tokenizer: fail in a second, not after loading the weights
        _check_directory(directory, allow_pickle, trust_remote_code)
        tokenizer = load_tokenizer(directory, trust_remote_code=trust_remote_code)
    else:
        check_gguf(directory / name)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # errors must stay one line on stderr
    try:
        if kind == "gguf":
            files = [directory / name]
            from unittest import mock

            import transformers.modeling_gguf_pytorch_utils as gguf_utils

            # the GGUF converter's own tqdm bar ignores transformers' progress-bar switch
            with _gguf_parsed_once(), mock.patch.object(gguf_utils, "tqdm", lambda iterable, **_: iterable):
                model = AutoModelForCausalLM.from_pretrained(
                    directory, gguf_file=name, dtype=torch_dtype, local_files_only=True,
                    attn_implementation=attn_implementation, use_kernels=False,
                )
                # the tokenizer lives in the same file: read it once the weights proved sound
                tokenizer = load_tokenizer(spec)
        else:
            files = sorted(directory.glob("*.safetensors")) or sorted(
                p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
            # use_kernels=False: gascan hooks the reference modules, which hub kernels would replace
            # (transformers 5.25 kernelizes by default; 5.24 did not)
            options = dict(dtype=torch_dtype, local_files_only=True, trust_remote_code=trust_remote_code,
                           use_safetensors=None if allow_pickle else True, use_kernels=False)
            try:
                model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn_implementation,
                                                             **options)
            except ValueError as err:  # e.g. pure SSMs have no sdpa path
                if "attention implementation" not in str(err) and "attn_implementation" not in str(err):
                    raise
                model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", **options)
    except ModelLoadError:
        raise
    except Exception as err:
        text = f"{err.__class__.__name__}: {err}".splitlines()[0][:200]
        where = directory / name if kind == "gguf" else directory
        raise ModelLoadError(f"could not load the weights in {where} ({text})",
                             "the checkpoint is corrupt or truncated: copy it again") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model = model.to(device).eval()
    return LoadedModel(model, tokenizer, adapter_for(model, mamba1_group_width), str(spec or BUNDLED_SPEC), files)


def as_loaded(model: Any, tokenizer: Any = None, *, name: str | None = None,
              mamba1_group_width: int | None = None) -> LoadedModel:
    """Accept what a Python user has in hand: a :class:`LoadedModel`, an nnsight ``LanguageModel``
    (its wrapped transformers module and tokenizer are used), or a transformers model plus its
    tokenizer. Every caller then goes through the same engine, so effects are identical whichever way
    the model was handed in."""
    if isinstance(model, LoadedModel):
        return model
    inner = getattr(model, "_module", None)  # nnsight Envoy / LanguageModel
    if inner is not None and isinstance(inner, torch.nn.Module) and not isinstance(model, torch.nn.Module):
        tokenizer = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
        model = inner
    if not isinstance(model, torch.nn.Module):
        raise ModelLoadError(f"cannot use a {type(model).__name__} as a model",
                             "pass a gascan LoadedModel, an nnsight LanguageModel or a transformers model")
    if tokenizer is None:
        raise ModelLoadError("a transformers model was given without its tokenizer", "pass tokenizer=...")
    spec = name or str(getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__)
    return LoadedModel(model.eval(), tokenizer, adapter_for(model, mamba1_group_width), spec)
