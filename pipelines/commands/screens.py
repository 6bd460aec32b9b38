"""``gascan screens MODEL --task T --out F.json``: the cheap screens' recall of the exact sweep's top heads."""
from __future__ import annotations

import argparse
from typing import Any

from pipelines.commands.common import add_model_arguments, load_options


def add_parser(sub: argparse._SubParsersAction) -> None:
    from discovery.measure.recall import SCREENS, TARGET, TOP
    from pipelines.commands.tasks import add_task_arguments

    parser = sub.add_parser(
        "screens", help="measure the screens' recall of the exact sweep's top heads",
        description="Run the exact all-position zero-ablation sweep over every head (the reference) and the "
        "cheap screens (AtP, AtP with the QK fix, AtP* GradDrop, the query-position exact sweep) on the same "
        "prompts; report each screen's recall of the exact top heads (by |d_ld_all|) within its own top-k, "
        "the smallest k reaching the target recall, Spearman, and its cost in forward-equivalents. Task "
        "options a toy checkpoint was trained with are used unless --task-option overrides them.")
    add_model_arguments(parser)
    parser.add_argument("--task", default="mc", help="task spec, NAME or NAME:PATH (default: mc)")
    add_task_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16, help="prompts (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the task generator (default 0)")
    parser.add_argument("--screens", default=",".join(SCREENS),
                        help=f"comma-separated screens (default: {','.join(SCREENS)})")
    parser.add_argument("--top", type=int, default=TOP, help=f"exact top heads to find (default {TOP})")
    parser.add_argument("--target", type=float, default=TARGET, help=f"recall target for k (default {TARGET})")
    parser.add_argument("--max-memory", type=float, default=None, metavar="MB", help="engine memory budget")
    parser.add_argument("--out", default=None, help="also write the results as JSON here (atomically)")
    parser.add_argument("--summarize", nargs="+", default=None, metavar="F.json",
                        help="instead: print the markdown table (screen × model) of earlier --out files")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.summarize:
        import json
        from pathlib import Path

        print(markdown_table([json.loads(Path(path).read_text()) for path in args.summarize]))
        return 0
    from pipelines import validate

    validate.prompts(args.prompts)
    validate.positive(args.top, "--top")
    validate.positive(args.max_memory, "--max-memory")
    from discovery.errors import GascanError
    from discovery.measure.recall import SCREENS

    screens = [s.strip() for s in args.screens.split(",") if s.strip()]
    bad = [s for s in screens if s not in SCREENS]
    if bad or not screens:
        raise GascanError(f"unknown screen {bad[0] if bad else '(none)'!r}", f"use some of {', '.join(SCREENS)}")
    if not 0 < args.target <= 1:
        raise GascanError(f"--target must be in (0, 1], got {args.target}", "pass e.g. 0.9")
    validate.device_available(args.device)
    import sys

    from rich.console import Console

    from discovery.io import write_json
    from discovery.measure.recall import measure_screens
    from discovery.tasks import load_task_options, parse_task_options
    from pipelines import pipeline
    from pipelines.bench import machine
    from pipelines.progress import reporter, stage
    from pipelines.sweep import task_batch

    console = Console(emoji=False, width=None if sys.stdout.isatty() else 160)
    given = parse_task_options(args.task_option or [])
    with reporter() as progress, stage(progress, "loading model"):
        lm = load_options(args).load(args.model)
    from_file = (lambda name: load_task_options(args.task_options, name)) if args.task_options else None
    task_opts = pipeline.task_options(lm.files, [args.task], given, from_file)[args.task]
    batch = task_batch(lm, args.task, {"seed": args.seed, "n": args.prompts, **task_opts})
    console.print(f"{lm.name}: {lm.inventory.n_layers} layers, {sum(lm.inventory.n_heads().values())} heads, "
                  f"{len(batch)} prompts × {batch.input_ids.shape[1]} positions; task {args.task} {task_opts}")
    result = measure_screens(lm, batch, screens=screens, top=args.top, target=args.target,
                             max_memory_mb=args.max_memory, log=console.print)
    result |= {"spec": args.model, "task": args.task, "task_options": task_opts, "seed": args.seed,
               "machine": machine()}
    console.print(table(result))
    if args.out:
        write_json(args.out, result)
        console.print(f"wrote {args.out}")
    return 0


def table(result: dict[str, Any]):
    """One row per screen: recall@top, the k for the target recall, Spearman, forward-equivalents, seconds."""
    from rich.markup import escape
    from rich.table import Table

    ref = result["reference"]
    top = next(iter(result["screens"].values()))["top"] if result["screens"] else 0
    out = Table(title=f"{escape(result['model'])}: recall of the exact top {top} (exact sweep "
                f"{ref['forward_equivalents']:.1f} fwd-eq, {ref['seconds']:.1f} s)")
    for col in ("screen", f"recall@{top}", "k for target", "spearman", "spearman |.|", "fwd-eq", "s"):
        out.add_column(col, justify="left" if col == "screen" else "right")

    def num(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for rec in result["screens"].values():
        out.add_row(rec["name"], f"{rec['recall_at_k'][rec['top']]:.2f}", str(rec["k_for_recall"]),
                    num(rec["spearman"], ".2f"), num(rec["spearman_abs"], ".2f"),
                    num(rec["forward_equivalents"], ".2f"), f"{rec['seconds']:.1f}")
    return out


def markdown_table(results: list[dict[str, Any]]) -> str:
    """Screen × model: recall@top, the k reaching the target, Spearman of |.|, forward-equivalents."""
    first = next(iter(results[0]["screens"].values())) if results and results[0]["screens"] else {"top": 10, "target": 0.9}
    lines = [(f"| model | heads | prompts | screen | recall@{first['top']} | k for recall ≥ {first['target']} "
              "| major heads | k for all major | Spearman | Spearman (abs) | fwd-eq | exact sweep fwd-eq |"),
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def num(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    import torch

    from discovery.measure.recall import screen_recall

    for res in results:
        names = list(res["reference"]["d_ld_all"])
        exact = torch.tensor([res["reference"]["d_ld_all"][h] for h in names])  # [head]
        for stored in res["screens"].values():  # recomputed from the stored scores: one definition
            rec = stored | screen_recall(exact, torch.tensor([stored["scores"][h] for h in names]),
                                         top=stored["top"], target=stored["target"])
            rec["recall_at_k"] = {str(k): v for k, v in rec["recall_at_k"].items()}
            lines.append(f"| {res['model']} | {res['n_heads']} | {res['n_prompts']} | {rec['name']} "
                         f"| {rec['recall_at_k'][str(rec['top'])]:.2f} | {rec['k_for_recall']} | {rec['n_major']} "
                         f"| {rec['k_for_major']} | {num(rec['spearman'])} "
                         f"| {num(rec['spearman_abs'])} | {num(rec['forward_equivalents'])} "
                         f"| {num(res['reference']['forward_equivalents'])} |")
    return "\n".join(lines)
