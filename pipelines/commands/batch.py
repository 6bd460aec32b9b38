"""``gascan batch SPEC --out DIR``: many checkpoints x tasks, sharded, resumable, serial or on Ray."""
from __future__ import annotations

import argparse

DEFAULT_OUT = "runs/batch"


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "batch", help="scan many checkpoints x tasks (resumable; serial or Ray)",
        description="Scan every checkpoint x task of SPEC as shards (checkpoint x task x layer range). "
        "SPEC is a TOML/YAML file (models, tasks, [scan], [load], [task_options.NAME]) or a directory of "
        "checkpoints (each subdirectory with a config.json; checkpoints/step-N gives the training step). "
        "Finished shards are kept: rerunning the same command continues where it stopped, and a "
        "checkpoint whose weights changed is rescanned. Exit code 1 when some shards failed.")
    parser.add_argument("spec", metavar="SPEC", help="batch spec (.toml, .yaml) or a directory of checkpoints")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT})")
    parser.add_argument("--executor", choices=("serial", "ray"), default="serial",
                        help="serial: in this process (default); ray: Ray actors, one model per actor")
    parser.add_argument("--ray-address", default=None, metavar="ADDR",
                        help="join a running Ray cluster (`auto`, or host:port); default: start a local one")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="Ray actors (default: as many as the cluster's CPUs, or GPUs / --gpus-per-worker)")
    parser.add_argument("--gpus-per-worker", type=float, default=0.0, metavar="G",
                        help="GPUs per Ray actor (1: one actor per GPU; fractions share a GPU; default 0)")
    parser.add_argument("--max-retries", type=int, default=2, metavar="N",
                        help="resubmissions of a shard whose worker process died (default 2)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch threads of the serial executor (default: torch's; Ray actors use 1 per CPU)")
    overrides = parser.add_argument_group("overrides of the spec")
    overrides.add_argument("--task", action="append", default=None, metavar="T", help="task spec (repeatable)")
    overrides.add_argument("--ablation", default=None, help="exact, query, atp or none")
    overrides.add_argument("--prompts", type=int, default=None, help="prompts per task")
    overrides.add_argument("--seed", type=int, default=None, help="seed of the task generators and bootstrap")
    overrides.add_argument("--layers-per-shard", type=int, default=None, metavar="K",
                           help="split each model into shards of K layers (default: whole model)")
    overrides.add_argument("--device", default=None, help="device for the models (cpu, cuda, ...)")
    parser.add_argument("--no-report", action="store_true", help="tables and summaries only, no per-checkpoint reports")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from discovery.model.spec import check_dtype
    from pipelines import validate
    from pipelines.batch import load_spec, override, run_batch
    from pipelines.batch.executors import RayExecutor, SerialExecutor

    validate.out_dir(args.out)
    validate.device(args.device)
    for flag, value in (("--workers", args.workers), ("--threads", args.threads), ("--layers-per-shard",
                                                                                   args.layers_per_shard)):
        validate.positive(value, flag)
    console = Console(stderr=True)
    spec = load_spec(args.spec)
    tasks = None
    if args.task:
        from pipelines.batch import resolve_task

        tasks = [resolve_task(t, Path.cwd()) for t in args.task]
    spec = override(spec, tasks=tasks, ablation=args.ablation, prompts=args.prompts, seed=args.seed,
                    layers_per_shard=args.layers_per_shard, device=args.device)
    check_dtype(spec.load.dtype)
    validate.device(spec.load.device)
    validate.tasks(spec.tasks, lambda task: spec.scan.task_options.get(task, {}), n=spec.scan.prompts,
                   seed=spec.scan.seed)
    validate.device_available(spec.load.device)
    if args.executor == "ray":
        executor = RayExecutor(address=args.ray_address, workers=args.workers, gpus_per_worker=args.gpus_per_worker,
                               max_retries=args.max_retries)
    else:
        executor = SerialExecutor(threads=args.threads)
    console.print(f"[bold]{spec.name}[/bold]: {len(spec.checkpoints)} checkpoints x {len(spec.tasks)} tasks "
                  f"({', '.join(spec.tasks)}), executor {args.executor}")
    result = run_batch(spec, args.out, executor, progress=not args.quiet, console=console,
                       reports=not args.no_report)
    summary = result.summary
    for entry in summary["checkpoints"]:
        if entry.get("verdict"):
            console.print(f"{entry['name']}: {entry['verdict']}")
    console.print(f"{result.total} shards: {result.ran} ran, {result.skipped} already done, "
                  f"{len(result.failures)} failed; {summary['heads_rows']} head rows in "
                  f"{Path(args.out) / 'heads.parquet'} ({summary['wall_seconds']:.1f} s)")
    executor_stats = summary.get("executor") or {}
    if executor_stats.get("worker_deaths"):
        console.print(f"[yellow]{executor_stats['worker_deaths']} worker process(es) died[/yellow]; "
                      f"{executor_stats.get('resubmitted', 0)} shard(s) resubmitted to fresh workers")
    for failure in result.failures:
        console.print(f"[red]failed[/red] {failure['shard']} after {failure['attempts']} attempt(s): "
                      f"{failure['reason']}")
    if summary.get("series"):
        console.print(f"series: {summary['series']['table']}, {summary['series']['figure']}")
    if result.failures:
        console.print(f"rerun the same command to retry the {len(result.failures)} failed shard(s)")
        return 1
    return 0
