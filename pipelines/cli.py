"""The ``gascan`` command line.

Each subcommand lives in its own module under ``pipelines.commands`` and exposes
``add_parser(subparsers)`` which registers its arguments and sets ``func``; this file only lists
them (lazily, so ``gascan --help`` does not import torch). A :class:`GascanError` anywhere becomes
one line on stderr and a non-zero exit code; nothing else is caught.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from discovery.errors import GascanError
from discovery.registry import Registry

COMMANDS: Registry = Registry("command")
for _name in ("inspect", "tasks", "scan", "bench", "toy", "report", "place", "compare", "classifier", "batch", "screens"):
    COMMANDS.add(_name, f"pipelines.commands.{_name}:add_parser")


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one-line :class:`GascanError` s (exit 2), like every other error;
    subcommand parsers inherit the class."""

    def error(self, message: str):  # type: ignore[override]
        raise GascanError(message, f"see `{self.prog} --help`")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gascan", description="Find Gather-and-Aggregate heads in language models."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS.names():
        COMMANDS.get(name)(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gascan`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv == []:  # the main job: scan the bundled default model
        argv = ["scan"]
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except GascanError as err:
        print(f"gascan: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("gascan: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
