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
    parser.add_argument("--budget", default=None, metavar="B",
                        help="with --rerun evidence: rerun the evidence tests and pairs within this budget instead "
                        "of the scan's (auto, none, N forward-equivalents or Ns seconds, as gascan scan --budget); "
                        "the sweep is kept and the scan directory records the new budget")
    parser.add_argument("--device", default="cpu", help="device for --load-model / --pairs (default cpu)")
    parser.set_defaults(func=run)


def _set_budget(scan_dir: str, summary: dict, budget: str) -> None:
    """Record a new evidence budget in the scan directory, keeping its sweep (:func:`pipelines.resume.adopt`)."""
    from discovery.artifacts import update_summary
    from pipelines import resume

    fp = summary.get("fingerprint")
    if isinstance(fp, dict) and "options" in fp:
        resume.adopt(scan_dir, resume.with_settings(fp, budget=budget), ["sweep"])
    else:  # a scan from before fingerprints: its options are all there is
        update_summary(scan_dir, {"options": {**(summary.get("options") or {}), "budget": budget}})


def run(args: argparse.Namespace) -> int:
    from discovery.errors import GascanError
    from pipelines import validate

    validate.scan_dir(args.dir)
    rerun = args.rerun or ("pairs" if args.pairs else None)
    if args.budget is not None:
        validate.budget(args.budget)
        if rerun != "evidence":
            raise GascanError("--budget changes what the evidence tests and pairs run",
                              "pass --rerun evidence with it")
    if args.load_model or rerun:
        validate.device_available(args.device)
    from discovery.artifacts import read_scan
    from discovery.model.loading import load_model
    from pipelines import pipeline

    from rich.console import Console

    from pipelines.progress import reporter, stage

    summary = read_scan(args.dir).summary
    with reporter(Console(stderr=True, emoji=False)) as progress:  # rich bars in a terminal, plain lines in a log
        lm = None
        if args.load_model or rerun:
            with stage(progress, "loading model"):
                lm = load_model(summary.get("spec"), device=args.device)
        if args.budget is not None:
            _set_budget(args.dir, summary, str(args.budget))
        # the verdict is decided again from the tables whatever reran, then drawn
        result = pipeline.finish(lm, args.dir, start=rerun or "verdict", progress=progress)
    if rerun:
        from discovery.rank.verdict import HeadRef

        top = result.summary.get("top_pairs") or []
        name = lambda h: HeadRef(h["layer"], h["head"], h["kind"]).name  # noqa: E731
        print("top pairs: " + ", ".join(f"{name(p['gather'])} → {name(p['aggregate'])} (verified: {p.get('verified')})"
                                        for p in top[:3]))
    print(f"verdict: {result.verdict.headline}")
    print(f"wrote {result.report} and {result.report.with_suffix('.md') if result.report else ''}")
    return 0
