"""``gascan tasks list`` and ``gascan tasks show TASK``: what each task renders and annotates.

``show`` prints rendered prompts with the annotated tokens marked (segments, summary tokens,
labels, the query position) so a user can see exactly which tokens every metric looks at.
Without ``--model`` it tokenizes with a GPT-2 style byte-level BPE trained on the task's own
prompts (see :mod:`discovery.tasks.toktrain`); with ``--model`` only that model's tokenizer is
loaded (no weights).
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

STYLES = {
    "segment": ["on grey23", "on dark_blue"],
    "summary": "bold black on bright_green",
    "label": "bold black on yellow",
    "query": "bold white on red",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("tasks", help="list tasks, or show a task's annotated prompts",
                            description="List the tasks, or print a task's prompts with annotated tokens marked.")
    tsub = parser.add_subparsers(dest="tasks_command", metavar="{list,show}")
    lst = tsub.add_parser("list", help="task names, descriptions and options with defaults")
    lst.set_defaults(func=run_list)
    show = tsub.add_parser("show", help="print rendered prompts with annotated tokens marked")
    show.add_argument("task", help="NAME (built-in generator) or NAME:PATH (rows from a file), e.g. mc, kv, "
                      "mc:data/mmlu.csv, jsonl:my.jsonl")
    add_task_arguments(show)
    show.add_argument("--model", default=None, help="tokenize with this model's tokenizer (default: a "
                      "byte-level BPE trained on the task's prompts)")
    show.add_argument("--n", type=int, default=2, help="how many prompts to show (default 2)")
    show.add_argument("--padding-side", choices=("left", "right"), default="left")
    show.add_argument("--max-length", type=int, default=None, help="reject prompts longer than this many tokens")
    show.set_defaults(func=run_show)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    """``--task-option KEY=VALUE`` (repeatable) and ``--task-options FILE.toml``: shared by commands."""
    parser.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a task option (repeatable); see `gascan tasks list`")
    parser.add_argument("--task-options", default=None, metavar="FILE.toml",
                        help="task options from a TOML file (top-level keys, or a [TASK] table); "
                        "--task-option wins")


def task_from_args(args: argparse.Namespace) -> Any:
    """Build the task named by ``args.task`` with options from the TOML file then ``--task-option``."""
    from discovery.tasks import build_task, load_task_options, parse_task_options, split_spec

    options: dict[str, Any] = {}
    if getattr(args, "task_options", None):
        options.update(load_task_options(args.task_options, split_spec(args.task)[0]))
    options.update(parse_task_options(getattr(args, "task_option", []) or []))
    return build_task(args.task, options)


def run_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from discovery.tasks import TASKS, get_task_class

    console = Console(emoji=False)
    for name in TASKS.names():
        cls = get_task_class(name)
        files = f" — also {name}:PATH" if cls.accepts_file and name != "jsonl" else ""
        table = Table(title=f"[bold]{name}[/bold]: {cls.description}{files}", title_justify="left",
                      show_edge=False, expand=False)
        table.add_column("option", style="cyan", no_wrap=True)
        table.add_column("default", no_wrap=True)
        table.add_column("values")
        table.add_column("meaning")
        for key, opt in cls.all_options().items():
            default = "(see meaning)" if opt.default is None else repr(opt.default)
            table.add_row(key, default, opt.describe_range(), opt.help)
        console.print(table)
        console.print()
    return 0


def _tokenizer(args: argparse.Namespace, prompts: list[Any]) -> tuple[Any, str]:
    if args.model is None:
        from discovery.tasks.toktrain import tokenizer_for_prompts

        return tokenizer_for_prompts(prompts), "byte-level BPE trained on this task's prompts (no --model)"
    from discovery.model.loading import load_tokenizer

    return load_tokenizer(args.model), f"tokenizer of {args.model}"


def run_show(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from discovery.errors import TaskError
    from discovery.tasks import annotate
    from discovery.tasks.base import _encode_with_offsets

    if args.n < 1:
        raise TaskError(f"--n must be at least 1 (got {args.n})", "use --n 1 or more")
    task = task_from_args(args)
    prompts = task.prompts()
    shown = prompts[: args.n]
    tokenizer, tok_name = _tokenizer(args, prompts)
    batch = annotate(shown, tokenizer, padding_side=args.padding_side, max_length=args.max_length)
    console = Console(highlight=False, emoji=False)
    console.print(f"[bold]{task.name}[/bold] — {len(prompts)} prompts, showing {len(shown)}; {tok_name}; "
                  f"scoring: {batch.scoring}")
    console.print("options: " + ", ".join(f"{k}={v!r}" for k, v in task.options.items()))
    if task.skipped:
        console.print(f"[yellow]skipped {len(task.skipped)} malformed row(s): "
                      + "; ".join(f"row {r}: {why}" for r, why in task.skipped[:5]) + "[/yellow]")
    legend = Text("legend: ")
    for key in ("segment", "summary", "label", "query"):
        style = STYLES[key][0] if isinstance(STYLES[key], list) else STYLES[key]
        legend.append(f" {key} ", style=style)
        legend.append(" ")
    console.print(legend)
    for i, p in enumerate(batch.prompts):
        mask = batch.attention_mask[i].bool()
        ids = batch.input_ids[i][mask].tolist()
        pad = int((~mask).nonzero()[:, 0].max() + 1) if args.padding_side == "left" and (~mask).any() else 0
        _, offsets = _encode_with_offsets(tokenizer, p.text)
        offsets = [(0, 0)] * (len(ids) - len(offsets)) + offsets  # BOS, if one was added
        seg_of: dict[int, int] = {}
        for k in range(int(batch.seg_mask[i].sum())):
            for pos in range(int(batch.seg_start[i, k]), int(batch.seg_end[i, k])):
                seg_of.setdefault(pos - pad, k)
        summary = {int(batch.summary_pos[i, k]) - pad for k in range(int(batch.seg_mask[i].sum()))}
        labels = set()
        if batch.label_pos is not None and batch.label_mask is not None:
            labels = {int(batch.label_pos[i, k]) - pad for k in range(batch.label_pos.shape[1])
                      if batch.label_mask[i, k]}
        query = int(batch.query_pos[i]) - pad
        where = p.meta.get("row")
        console.rule(f"prompt {i}" + (f" (row {where})" if where is not None else "")
                     + f" — gold {p.gold}: {p.candidates[p.gold]!r}")
        text = Text()
        for j, tid in enumerate(ids):
            s, e = offsets[j]
            piece = p.text[s:e] if e > s else tokenizer.convert_ids_to_tokens(tid)
            piece = piece.replace("\n", "⏎\n")
            if j == query:
                style = STYLES["query"]
            elif j in summary:
                style = STYLES["summary"]
            elif j in labels:
                style = STYLES["label"]
            elif j in seg_of:
                style = STYLES["segment"][seg_of[j] % 2]
            else:
                style = "underline" if j % 2 else ""
            text.append(piece, style=style)
        console.print(text)
        table = Table(show_edge=False)
        for col in ("segment", "tokens", "summary token", "label token", ""):
            table.add_column(col)
        for k in range(int(batch.seg_mask[i].sum())):
            sp = int(batch.summary_pos[i, k]) - pad
            lab = "-"
            if batch.label_pos is not None and batch.label_mask is not None and batch.label_mask[i, k]:
                lp = int(batch.label_pos[i, k]) - pad
                lab = f"{lp} {tokenizer.convert_ids_to_tokens(ids[lp])!r}"
            table.add_row(str(k), f"[{int(batch.seg_start[i, k]) - pad}, {int(batch.seg_end[i, k]) - pad})",
                          f"{sp} {tokenizer.convert_ids_to_tokens(ids[sp])!r}", lab,
                          "gold" if k == int(batch.gold_segment[i]) else "")
        console.print(table)
        cands = Table(show_edge=False)
        for col in ("candidate", "tokens", "first id", ""):
            cands.add_column(col)
        for k, c in enumerate(p.candidates):
            toks = tokenizer.convert_ids_to_tokens(batch.cand_tokens[i][k])
            cands.add_row(repr(c), " ".join(repr(t) for t in toks), str(batch.cand_tokens[i][k][0]),
                          "gold" if k == p.gold else "")
        console.print(cands)
        console.print(f"query position {query} ({tokenizer.convert_ids_to_tokens(ids[query])!r}), "
                      f"{len(ids)} tokens")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from pipelines.cli import main

    sys.exit(main(["tasks", *sys.argv[1:]]))
