"""``gascan scan [MODEL] --task T ... --out DIR``: every stage of the one pipeline on one model."""
from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands.common import add_model_arguments, load_options
from pipelines.options import ABLATION_MODES, ScanOptions

DEFAULT_OUT = "runs/scan"
_DEFAULTS = ScanOptions()


def add_parser(sub: argparse._SubParsersAction) -> None:
    from pipelines.commands.tasks import add_task_arguments

    parser = sub.add_parser(
        "scan", help="sweep every head of a model, test the candidates, write the verdict and report",
        description="Load a model once and run the pipeline: per task the sweep (patterns, attribution "
        "screen, ablation), the evidence tests, the pair ranking, the verdict and the report, all written "
        "to DIR (heads.parquet, evidence*.parquet, pairs.parquet, summary.json, report.md/html). With no "
        "MODEL, scan the bundled toy model.")
    add_model_arguments(parser)
    parser.add_argument("--task", action="append", default=None, metavar="T",
                        help="task spec, NAME or NAME:PATH (repeatable; default: mc)")
    add_task_arguments(parser)
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--ablation", choices=ABLATION_MODES, default=_DEFAULTS.ablation,
                        help="exact: all-position and query-position single-head sweeps (default); "
                        "query: query position only; atp: attribution screen only; none: patterns only")
    parser.add_argument("--prompts", type=int, default=_DEFAULTS.prompts,
                        help=f"prompts per task (default {_DEFAULTS.prompts})")
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed of the task generators and bootstrap")
    parser.add_argument("--max-memory", type=float, default=_DEFAULTS.max_memory_mb, metavar="MB",
                        help="memory budget for batched ablation rows, in MiB (default: 512 rows)")
    parser.add_argument("--refine-channels", action=argparse.BooleanOptionalAction, default=_DEFAULTS.refine_channels,
                        help="Mamba-1: after the group sweep, split the channel groups that matter in halves, "
                        "level by level, down to the channels that carry the effect (default on; the summary "
                        "and report say when it was skipped and why)")
    parser.add_argument("--no-report", action="store_true", help="write the tables and the verdict only")
    parser.set_defaults(func=run)


def check(args: argparse.Namespace) -> list[str]:
    """Everything about the arguments that can fail, before the model loads; returns the tasks."""
    from pipelines import validate

    validate.prompts(args.prompts)
    validate.positive(args.max_memory, "--max-memory")
    validate.out_dir(args.out)
    validate.model(args.model, dtype=args.dtype, device_name=args.device, allow_pickle=args.allow_pickle,
                   trust_remote_code=args.trust_remote_code)
    tasks = args.task or list(_DEFAULTS.tasks)
    from discovery.tasks import load_task_options, parse_task_options  # imports torch

    given = parse_task_options(args.task_option or [])

    def options_for(task: str) -> dict[str, Any]:
        from_file = load_task_options(args.task_options, task.partition(":")[0]) if args.task_options else {}
        return {**from_file, **given}

    validate.tasks(tasks, options_for, n=args.prompts, seed=args.seed)
    validate.device_available(args.device)
    return tasks


def run(args: argparse.Namespace) -> int:
    tasks = check(args)
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from discovery.tasks import load_task_options, parse_task_options
    from pipelines import pipeline

    console = Console(stderr=True, emoji=False)
    given = parse_task_options(args.task_option or [])
    with console.status("loading model"):
        lm = load_options(args).load(args.model)
    from_file = (lambda name: load_task_options(args.task_options, name)) if args.task_options else None
    options = ScanOptions(tasks=tasks, task_options=pipeline.task_options(lm.files, tasks, given, from_file),
                          ablation=args.ablation, prompts=args.prompts, seed=args.seed,
                          max_memory_mb=args.max_memory, refine_channels=args.refine_channels)
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

        result = pipeline.run(lm, options, args.out, progress=progress, report=not args.no_report)
    for task, info in result.summary["tasks"].items():
        clean = info["clean"]
        console.print(f"{task}: accuracy {clean['acc']:.3f}, logit diff {clean['logit_diff']:.3f} "
                      f"({info['n_prompts']} prompts, {info['seconds']:.1f} s)")
        line = refinement_line(info.get("refinement"))
        if line:
            console.print(f"{task}: {escape(line)}")
    console.print(f"[bold]verdict[/bold]: {escape(result.verdict.headline)}")
    if result.report is not None:
        console.print(f"report: {result.report}")
    console.print(f"wrote {result.out / 'heads.parquet'} ({result.heads.height} rows) and "
                  f"{result.out / 'summary.json'}")
    return 0


def refinement_line(ref: dict[str, Any] | None) -> str:
    """One line on the Mamba-1 channel refinement of a task ("" for a model without Mamba-1 layers)."""
    if not ref or ref.get("reason") == "no Mamba-1 layers":
        return ""
    if ref.get("status") != "done":
        return f"channel refinement skipped: {ref.get('reason')}"
    leaves = ", ".join(f"{x['head']} (channels {x['channel_start']}:{x['channel_end']})" for x in ref["leaves"])
    return (f"channel refinement: {ref['groups_refined']} groups -> {len(ref['leaves'])} heads "
            f"({leaves or 'none'}); {ref['forward_equivalents']} forward-equivalents "
            f"(every channel alone: {ref['channel_sweep_forward_equivalents']})")
