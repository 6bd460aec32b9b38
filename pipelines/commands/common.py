"""Arguments shared by subcommands that load a model (their defaults are :class:`LoadOptions`')."""
from __future__ import annotations

import argparse

from pipelines.options import LoadOptions

_DEFAULTS = LoadOptions()


def add_model_arguments(parser: argparse.ArgumentParser, *, optional_model: bool = True) -> None:
    """MODEL plus the loading options (dtype, device, safety opt-ins, Mamba-1 grouping)."""
    parser.add_argument(
        "model", nargs="?" if optional_model else None, default=None,
        help="a model directory, a .gguf file, a cached hub id, or tiny:ARCH"
        + (" (default: the bundled toy model)" if optional_model else ""),
    )
    group = parser.add_argument_group("model loading")
    group.add_argument("--dtype", default=_DEFAULTS.dtype, help="float32 (default), bfloat16, float16")
    group.add_argument("--device", default=_DEFAULTS.device, help="cpu (default), cuda, cuda:1, ...")
    group.add_argument("--allow-pickle", action="store_true",
                       help="allow pickled weights (.bin/.pt), which can execute code when loaded")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="allow the checkpoint's own Python code to run (auto_map)")
    group.add_argument("--mamba1-group-width", type=int, default=_DEFAULTS.mamba1_group_width,
                       help="Mamba-1 channels per head (default: channels/32; 1 = channel level)")


def load_options(args: argparse.Namespace) -> LoadOptions:
    """The :class:`LoadOptions` of parsed ``args`` (see :func:`add_model_arguments`)."""
    return LoadOptions(dtype=args.dtype, device=args.device, allow_pickle=args.allow_pickle,
                       trust_remote_code=args.trust_remote_code, mamba1_group_width=args.mamba1_group_width)


def load_from_args(args: argparse.Namespace, attn_implementation: str = "sdpa"):
    """Load the model named by parsed ``args``."""
    return load_options(args).load(args.model, attn_implementation=attn_implementation)
