"""``gascan place DIR --budget K [--unit head|layer]``: where attention should be kept or inserted."""
from __future__ import annotations

import argparse

from discovery.errors import GascanError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "place", help="rank where attention belongs in a hybrid, from a scan's G&A evidence",
        description="Rank layers (or heads) where attention should be kept (distilling a Transformer into a "
        "hybrid) or inserted (a pure SSM), from the scan's G&A evidence: classifier probabilities, ablation "
        "effects relative to the clean score, and verified G&A pairs. Each choice says why.")
    parser.add_argument("dir", metavar="DIR", help="a scan directory")
    parser.add_argument("--budget", type=int, default=None, metavar="K",
                        help="how many layers/heads (default: ~1 layer in 16, or ~2%% of heads)")
    parser.add_argument("--unit", choices=("layer", "head"), default="layer")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


def _units(scan, unit: str) -> int:
    """How many layers or heads the scanned model has (summary.json, else the head table)."""
    summary = scan.summary
    if unit == "layer":
        return int(summary.get("n_layers") or scan.heads["layer"].n_unique())
    return int(sum((summary.get("n_heads") or {}).values()) or scan.heads.select("layer", "head", "kind").n_unique())


def run(args: argparse.Namespace) -> int:
    import json

    from pipelines import validate

    validate.scan_dir(args.dir)
    validate.positive(args.budget, "--budget")
    from discovery.artifacts import read_scan
    from discovery.rank.placement import default_budget, place
    from discovery.report import scored_heads

    scan = read_scan(args.dir)
    budget = args.budget if args.budget is not None else default_budget(scan.summary, args.unit)
    available = _units(scan, args.unit)
    if budget > available:  # an error, not a clamp: a budget beyond the model is a wrong number
        raise GascanError(f"--budget {budget} exceeds the {available} {args.unit}s of "
                          f"{scan.summary.get('model') or args.dir}", f"pass --budget {available} or less")
    choices = place(scored_heads(scan), scan.summary, scan.pairs, budget=budget, unit=args.unit)
    if args.json:
        print(json.dumps([c.as_dict() for c in choices], indent=1))
        return 0
    if not choices:
        print("no advice: the scan has no effects or probabilities to rank by")
        return 0
    print(f"{scan.summary.get('model')}: {len(choices)} {args.unit}(s) for attention, best first")
    for i, c in enumerate(choices, 1):
        print(f"{i}. {c.name}: {c.action} (score {c.score:.2f})\n   why: {c.why}")
    return 0
