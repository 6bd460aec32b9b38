"""``gascan report DIR``: rebuild report.md, report.html and figures/ from a scan's tables."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "report", help="rebuild a scan's report from its tables",
        description="Rebuild DIR/report.md, DIR/report.html (self-contained) and DIR/figures/*.png from "
        "DIR/heads.parquet and DIR/summary.json (and pairs.parquet, patterns.npz when present). The example "
        "attention pattern is redrawn from patterns.npz, or by loading the model when it is small.")
    parser.add_argument("dir", metavar="DIR", help="a scan directory (the --out of gascan scan)")
    parser.add_argument("--load-model", action="store_true",
                        help="load the scanned model (summary.json's spec) to redraw the example pattern, "
                        "whatever its size")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from discovery.report import read_scan, write_report

    lm = None
    if args.load_model:
        from discovery.loading import load_model

        lm = load_model(read_scan(args.dir).summary.get("spec"))
    path = write_report(args.dir, lm)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0
