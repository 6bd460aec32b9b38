"""``gascan compare DIR...``: several scans side by side (G&A depth, effect sizes, clean scores, steps)."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "compare", help="put several scans side by side",
        description="One row per scan × task: clean scores, the gather and aggregate heads (top pair, else most "
        "probable) with their depth as a fraction of the model's layers, their effects relative to the clean "
        "logit difference, and the training step for checkpoint series (from step-N directory names or "
        "training.json).")
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="scan directories")
    parser.add_argument("--out", default=None, metavar="OUT",
                        help="also write OUT/compare.{md,html,parquet} and figures (depth; metrics against step)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from pipelines import validate

    for path in args.dirs:
        validate.scan_dir(path)
    validate.out_dir(args.out)
    from discovery.report import fmt
    from discovery.report.compare import COLUMNS, compare_scans, write_comparison

    table = compare_scans(args.dirs)
    if args.json:
        print(json.dumps(table.to_dicts(), indent=1, default=str))
    else:
        import sys

        cols = [c for c in COLUMNS if c in table.columns]
        cell = lambda value: value if isinstance(value, str) else fmt(value)  # noqa: E731
        if not sys.stdout.isatty():  # piped or redirected: one record per row, nothing cut to the terminal width
            for i, r in enumerate(table.iter_rows(named=True), 1):
                print(f"[{i}/{table.height}]")
                print("\n".join(f"  {c.replace('_', ' ')}: {cell(r[c])}" for c in cols))
        else:
            from rich.console import Console
            from rich.markup import escape
            from rich.table import Table

            view = Table(title=f"{table.height} scan × task rows")
            for c in cols:
                view.add_column(c.replace("_", " "), overflow="fold")
            for r in table.iter_rows(named=True):
                view.add_row(*[escape(cell(r[c])) for c in cols])
            Console(emoji=False, highlight=False).print(view)
    if args.out:
        path = write_comparison(table, args.out)
        print(f"wrote {path}")
    return 0
