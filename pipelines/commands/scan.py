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
                        help="auto (default): screened for a model whose exact all-position sweep would cost over "
                        "100 forward-equivalents (about 200 heads or more), exact otherwise; "
                        "exact: all-position and query-position single-head sweeps; "
                        "query: query position only; atp: attribution screen only; screened: the default screen over every "
                        "head, then the exact all-position sweep on its top-k only (the other heads' all-position "
                        "columns null; summary.json records the screen, k and its agreement); none: patterns only")
    parser.add_argument("--prompts", type=int, default=_DEFAULTS.prompts,
                        help=f"prompts per task (default {_DEFAULTS.prompts})")
    parser.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed of the task generators and bootstrap")
    parser.add_argument("--max-memory", type=float, default=_DEFAULTS.max_memory_mb, metavar="MB",
                        help="memory budget for batched ablation rows, in MiB (default: 512 rows)")
    parser.add_argument("--refine-channels", action=argparse.BooleanOptionalAction, default=_DEFAULTS.refine_channels,
                        help="Mamba-1: after the group sweep, split the channel groups that matter in halves, "
                        "level by level, down to the channels that carry the effect (default on; the summary "
                        "and report say when it was skipped and why)")
    parser.add_argument("--budget", default=_DEFAULTS.budget, metavar="B",
                        help="bound on the evidence and pair tests per task: auto (default: 1.5x the exact "
                        "all-position sweep's cost, at least 200 forward-equivalents), none (test every head), N "
                        "forward-equivalents (one clean forward over the prompts = 1) or Ns seconds; the heads "
                        "left untested are listed in the report")
    parser.add_argument("--no-report", action="store_true", help="write the tables and the verdict only")
    parser.add_argument("--force", action="store_true",
                        help="start over in --out, removing the scan there (by default a rerun of the same scan "
                        "resumes at its first incomplete stage, and a scan of other options is refused)")
    parser.set_defaults(func=run)


def check(args: argparse.Namespace) -> list[str]:
    """Everything about the arguments that can fail, before the model loads; returns the tasks."""
    from pipelines import validate

    validate.prompts(args.prompts)
    validate.budget(args.budget)
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
    from pipelines.resume import precheck

    precheck(args.out, force=args.force, tasks=tasks, ablation=args.ablation, prompts=args.prompts, seed=args.seed,
             given=given)
    validate.device_available(args.device)
    return tasks


def run(args: argparse.Namespace) -> int:
    tasks = check(args)
    from rich.console import Console
    from rich.markup import escape

    from discovery.tasks import load_task_options, parse_task_options
    from pipelines import pipeline
    from pipelines.progress import reporter, stage

    console = Console(stderr=True, emoji=False)
    given = parse_task_options(args.task_option or [])
    with reporter(console) as progress:  # rich bars in a terminal, plain lines in a log
        with stage(progress, "loading model"):
            lm = load_options(args).load(args.model)
        from_file = (lambda name: load_task_options(args.task_options, name)) if args.task_options else None
        options = ScanOptions(tasks=tasks, task_options=pipeline.task_options(lm.files, tasks, given, from_file),
                              ablation=args.ablation, prompts=args.prompts, seed=args.seed,
                              max_memory_mb=args.max_memory, refine_channels=args.refine_channels,
                              budget=args.budget)
        console.print(f"[bold]{escape(lm.name)}[/bold]: {lm.inventory.architecture}, {lm.inventory.n_layers} "
                      f"layers, {sum(lm.inventory.n_heads().values())} heads; tasks {', '.join(tasks)}")
        result = pipeline.run(lm, options, args.out, progress=progress, report=not args.no_report, force=args.force)
    done = [s for s in pipeline.STAGES if s not in result.ran and result.summary["stages"][s]["complete"]]
    if done:
        console.print(f"resumed: {', '.join(done)} complete from an earlier run"
                      + (f"; ran {', '.join(result.ran)}" if result.ran else "; nothing left to run"))
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
    print_stage_table(console, result.summary)
    return 0


def print_stage_table(console: Any, summary: dict[str, Any]) -> None:
    """What each stage cost: a rich table in a terminal, one plain line per stage otherwise."""
    from discovery.artifacts import stage_rows

    rows = stage_rows(summary)
    if not rows:
        return
    def fmt(value: float | None, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    cells = [(name, fmt(wall, ".2f"), fmt(fe, ".1f"), fmt(peak, ".0f")) for name, wall, fe, peak in rows]
    header = ("stage", "wall s", "forward-equivalents", "peak MiB")
    if console.is_terminal:
        from rich.table import Table

        table = Table(header[0], title="cost per stage")
        for name in header[1:]:
            table.add_column(name, justify="right")
        for row in cells:
            table.add_row(*row)
        console.print(table)
        return
    width = max(len(c[0]) for c in cells)
    console.print(f"{header[0]:<{width}}  {header[1]:>8}  {header[2]:>19}  {header[3]:>8}", highlight=False)
    for name, wall, fe, peak in cells:
        console.print(f"{name:<{width}}  {wall:>8}  {fe:>19}  {peak:>8}", highlight=False, markup=False)


def refinement_line(ref: dict[str, Any] | None) -> str:
    """One line on the Mamba-1 channel refinement of a task ("" for a model without Mamba-1 layers)."""
    if not ref or ref.get("reason") == "no Mamba-1 layers":
        return ""
    if ref.get("status") != "done":
        return f"channel refinement skipped: {ref.get('reason')}"
    from discovery.heads import channel_label

    leaves = ", ".join(channel_label(x["head"], x["channel_start"], x["channel_end"]) for x in ref["leaves"])
    return (f"channel refinement: {ref['groups_refined']} groups -> {len(ref['leaves'])} heads "
            f"({leaves or 'none'}); {ref['forward_equivalents']} forward-equivalents "
            f"(every channel alone: {ref['channel_sweep_forward_equivalents']})")
