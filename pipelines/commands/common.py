"""Arguments shared by subcommands that load a model."""
from __future__ import annotations

import argparse


def add_model_arguments(parser: argparse.ArgumentParser, *, optional_model: bool = True) -> None:
    """MODEL plus the loading options (dtype, device, safety opt-ins, Mamba-1 grouping)."""
    parser.add_argument(
        "model", nargs="?" if optional_model else None, default=None,
        help="a model directory, a .gguf file, a cached hub id, or tiny:ARCH"
        + (" (default: the bundled toy model)" if optional_model else ""),
    )
    group = parser.add_argument_group("model loading")
    group.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    group.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    group.add_argument("--allow-pickle", action="store_true",
                       help="allow pickled weights (.bin/.pt), which can execute code when loaded")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="allow the checkpoint's own Python code to run (auto_map)")
    group.add_argument("--mamba1-group-width", type=int, default=None,
                       help="Mamba-1 channels per head (default: channels/32; 1 = channel level)")


def load_from_args(args: argparse.Namespace, attn_implementation: str = "sdpa"):
    """Load the model named by parsed ``args`` (see :func:`add_model_arguments`)."""
    from discovery.model.loading import load_model

    return load_model(
        args.model, dtype=args.dtype, device=args.device, allow_pickle=args.allow_pickle,
        trust_remote_code=args.trust_remote_code, mamba1_group_width=args.mamba1_group_width,
        attn_implementation=attn_implementation,
    )
