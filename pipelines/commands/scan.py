"""``gascan scan [MODEL] --task T ... --out DIR``: the head table and summary of one model."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pipelines.commands.common import add_model_arguments, load_from_args

DEFAULT_OUT = "runs/scan"


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pipelines.commands.tasks import add_task_arguments
    from pipelines.sweep import ABLATION_MODES

    parser = sub.add_parser(
        "scan", help="sweep every head of a model (the main job)",
        description="Load a model once; per task run the pattern pass, the attribution screen and the ablation "
        "sweep; write DIR/heads.parquet, DIR/summary.json and the report. With no MODEL, scan the bundled "
        "toy model.")
    add_model_arguments(parser)
    parser.add_argument("--task", action="append", default=None, metavar="T",
                        help="task spec, NAME or NAME:PATH (repeatable; default: mc)")
    add_task_arguments(parser)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--ablation", choices=ABLATION_MODES, default="exact",
                        help="exact: all-position and query-position single-head sweeps (default); "
                        "query: query position only; atp: attribution screen only; none: patterns only")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per task (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task generators and bootstrap")
    parser.add_argument("--max-memory", type=float, default=None, metavar="MB",
                        help="memory budget for batched ablation rows, in MiB (default: 512 rows)")
    parser.add_argument("--no-report", action="store_true", help="write the tables only")
    parser.set_defaults(func=run)


def model_task_defaults(lm) -> dict[str, dict[str, Any]]:
    """Task options a toy model was trained with (its training.json), so it is scanned on its own format."""
    for path in lm.files[:1]:
        meta = Path(path).parent / "training.json"
        if meta.is_file():
            info = json.loads(meta.read_text())
            task = info.get("task")
            opts = {k: v for k, v in (info.get("task_options") or {}).items() if k not in ("split", "n", "seed")}
            if task == "mc":  # held-out prompts over the words the model was trained on (it cannot know others)
                opts["split"] = "train"
            if task:
                return {task: opts}
    return {}


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from discovery.artifacts import write_scan
    from discovery.tasks import load_task_options, parse_task_options, split_spec
    from pipelines.sweep import ScanOptions, scan_model

    console = Console(stderr=True, emoji=False)
    tasks = args.task or ["mc"]
    given = parse_task_options(args.task_option or [])
    options_by_task: dict[str, dict[str, Any]] = {}
    with console.status("loading model"):
        lm = load_from_args(args)
    defaults = model_task_defaults(lm)
    for task in tasks:
        opts = dict(defaults.get(split_spec(task)[0], {}))
        if args.task_options:
            opts.update(load_task_options(args.task_options, split_spec(task)[0]))
        opts.update(given)
        options_by_task[task] = opts
    options = ScanOptions(tasks=tasks, task_options=options_by_task, ablation=args.ablation,
                          prompts=args.prompts, seed=args.seed, max_memory_mb=args.max_memory)
    console.print(f"[bold]{escape(lm.name)}[/bold]: {lm.inventory.architecture}, {lm.inventory.n_layers} layers, "
                  f"{sum(lm.inventory.n_heads().values())} heads; tasks {', '.join(tasks)}")
    columns = (TextColumn("{task.description:<22}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        ids: dict[str, Any] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in ids:
                ids[stage] = bar.add_task(stage, total=total)
            bar.update(ids[stage], completed=done, total=total)

        heads, summary = scan_model(lm, options, progress=progress)
        out = write_scan(args.out, heads, summary)
        if args.ablation != "none" and heads.height:
            from discovery.artifacts import write_evidence, write_pairs
            from discovery.evidence import scan_evidence
            from discovery.rank.pairs import scan_pairs

            # position-resolved effects, minimal model, group ablations, verdicts (bars per stage)
            tables, evidence_fields = scan_evidence(lm, heads, summary, progress=progress)
            write_evidence(out, tables, evidence_fields)
            summary.update(evidence_fields)
            progress("pairs (ranking, joint ablation)", 0, 1)
            # the evidence roles steer the candidates (its gather/aggregate heads always compete)
            pairs, fields = scan_pairs(lm, heads, summary, evidence=tables.get("evidence"))
            write_pairs(out, pairs, fields)
            progress("pairs (ranking, joint ablation)", 1, 1)
    for task, info in summary["tasks"].items():
        clean = info["clean"]
        console.print(f"{task}: accuracy {clean['acc']:.3f}, logit diff {clean['logit_diff']:.3f} "
                      f"({info['n_prompts']} prompts, {info['seconds']:.1f} s)")
    if not args.no_report:
        try:
            from discovery.report import write_report
        except ImportError:
            write_report = None
        if write_report is not None:
            with console.status("writing the report"):
                html = write_report(out, lm)
            console.print(f"report: {html}")
    console.print(f"wrote {out / 'heads.parquet'} ({heads.height} rows) and {out / 'summary.json'}")
    return 0
