"""``gascan report DIR``: rebuild report.md, report.html and figures/ from a scan's tables."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "report", help="rebuild a scan's report from its tables",
        description="Rebuild DIR/report.md, DIR/report.html (self-contained) and DIR/figures/*.png from "
        "DIR/heads.parquet and DIR/summary.json (and pairs.parquet, patterns.npz when present), after "
        "deciding the verdict again from the tables (written to summary.json). The example attention pattern "
        "is redrawn from patterns.npz, or by loading the model when it is small.")
    parser.add_argument("dir", metavar="DIR", help="a scan directory (the --out of gascan scan)")
    parser.add_argument("--load-model", action="store_true",
                        help="load the scanned model (summary.json's spec) to redraw the example pattern, "
                        "whatever its size")
    parser.add_argument("--rerun", choices=("evidence", "pairs"), default=None,
                        help="rerun the pipeline from this stage first (loads the model): evidence reruns the "
                        "evidence tests and the pair ranking, pairs only the pair ranking with its joint ablations")
    parser.add_argument("--pairs", action="store_true", help="the same as --rerun pairs")
    parser.add_argument("--device", default="cpu", help="device for --load-model / --pairs (default cpu)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipelines import validate

    validate.scan_dir(args.dir)
    rerun = args.rerun or ("pairs" if args.pairs else None)
    if args.load_model or rerun:
        validate.device_available(args.device)
    from discovery.artifacts import read_scan
    from discovery.model.loading import load_model
    from pipelines import pipeline

    summary = read_scan(args.dir).summary
    rerun = args.rerun or ("pairs" if args.pairs else None)
    lm = load_model(summary.get("spec"), device=args.device) if args.load_model or rerun else None
    # the verdict is decided again from the tables whatever reran, then drawn
    result = pipeline.finish(lm, args.dir, start=rerun or "verdict")
    if rerun:
        from discovery.rank.verdict import HeadRef

        top = result.summary.get("top_pairs") or []
        name = lambda h: HeadRef(h["layer"], h["head"], h["kind"]).name  # noqa: E731
        print("top pairs: " + ", ".join(f"{name(p['gather'])} → {name(p['aggregate'])} (verified: {p.get('verified')})"
                                        for p in top[:3]))
    print(f"verdict: {result.verdict.headline}")
    print(f"wrote {result.report} and {result.report.with_suffix('.md') if result.report else ''}")
    return 0
