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
    parser.add_argument("--pairs", action="store_true",
                        help="(re)rank G&A pairs first: loads the model, runs the interaction test and the "
                        "verified joint ablations, writes pairs.parquet and updates summary.json")
    parser.add_argument("--device", default="cpu", help="device for --load-model / --pairs (default cpu)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from discovery.artifacts import read_scan
    from discovery.report import write_report

    lm = None
    if args.load_model or args.pairs:
        from discovery.model.loading import load_model

        lm = load_model(read_scan(args.dir).summary.get("spec"), device=args.device)
    if args.pairs:
        from discovery.artifacts import write_pairs
        from discovery.rank.pairs import scan_pairs

        scan = read_scan(args.dir)
        table, fields = scan_pairs(lm, scan.heads, scan.summary, evidence=scan.evidence)
        write_pairs(args.dir, table, fields)
        from discovery.report import head_name

        name = lambda h: head_name(h["layer"], h["head"], h["kind"])
        print(f"ranked {table.height} candidate pairs; top: "
              + ", ".join(f"{name(p['gather'])} → {name(p['aggregate'])} (verified: {p.get('verified')}, confident: {p.get('confident')})"
                          for p in fields["top_pairs"][:3]))
    path = write_report(args.dir, lm)
    print(f"wrote {path} and {path.with_suffix('.md')}")
    return 0
