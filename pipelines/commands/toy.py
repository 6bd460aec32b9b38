"""``gascan toy train|truth|placement``: train a small model in which G&A can emerge (deterministically),
label its heads by exhaustive ablation, and check placement advice by training one hybrid per layer.

Arguments are only parsed here; validation lives in :class:`discovery.toy.TrainConfig` (one-line
errors before any heavy import) and the work in :func:`discovery.toy.trainer.train`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from discovery.errors import GascanError
from discovery.toy.config import SSM_INITS, TrainConfig


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise GascanError(f"{flag} {text!r} is not a comma-separated list of integers",
                          f"e.g. {flag} 1,3") from None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("toy", help="train toy models in which G&A emerges",
                                   description="Train toy models in which G&A emerges.")
    sub = parser.add_subparsers(dest="toy_command", metavar="ACTION")
    t = sub.add_parser("train", help="train a transformer, Mamba-1, Mamba-2 or hybrid toy model on a synthetic task",
                       description="Deterministic toy-model trainer: same seed, same weights (on one machine).")
    t.add_argument("--arch", default="transformer", help="transformer, mamba1, mamba2 or hybrid (default transformer)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", required=True, type=Path, help="output directory (a Hugging Face model dir)")
    t.add_argument("--attn-layers", default=None, help="hybrid: attention layer indices (comma list)")
    t.add_argument("--overwrite", action="store_true", help="replace a previous toy run in --out")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_recipe_args(t)
    t.set_defaults(func=run_train)
    tr = sub.add_parser("truth", help="exhaustive ablation ground truth of a (small) model -> truth.json beside it",
                        description="Zero-ablate every head alone (all / query / segment positions), compute the "
                        "pattern metrics and the pair interaction test on the model's own task (from its "
                        "training.json), and write DIR/truth.json: the heads whose ablation breaks the task, "
                        "labelled gather or aggregate, and the confirmed gather->aggregate pairs.")
    tr.add_argument("model", nargs="?", default=None, help="model directory (default: the bundled toy model)")
    tr.add_argument("--prompts", type=int, default=128, help="test prompts (default 128)")
    tr.add_argument("--seed", type=int, default=1, help="seed of the test prompts")
    tr.add_argument("--out", default=None, help="where to write (default: MODEL/truth.json, or "
                    "MODEL/truth_channels.json with --channels)")
    tr.add_argument("--channels", action="store_true",
                    help="Mamba-1: the channel-level truth instead: every channel of every Mamba-1 layer "
                    "ablated alone (all positions and the query; batched), with its pattern metrics")
    tr.add_argument("--scopes", default="all,query",
                    help="--channels: where each channel is ablated, comma list of all, query (default all,query;"
                    " each scope costs one forward-equivalent per channel and later layer)")
    tr.set_defaults(func=run_truth)
    pl_ = sub.add_parser("placement", help="check placement advice: train one hybrid per attention layer",
                         description="Rank the layers of a scanned model with `gascan place`, then train Bamba "
                         "hybrids (Mamba-2 layers, softmax attention at exactly one layer) with attention at "
                         "each layer, same recipe and seeds, and compare their test accuracy: the recommended "
                         "layer should win. Finished runs are reused, so an interrupted check resumes. Writes "
                         "OUT/placement_check.json and OUT/placement_check.md.")
    pl_.add_argument("scan", help="scan directory of the model the advice is for (e.g. a toy transformer)")
    pl_.add_argument("--out", required=True, type=Path, help="root directory of the hybrid runs and the table")
    pl_.add_argument("--try-layers", default=None, help="attention layers to train (comma list; default all)")
    pl_.add_argument("--seeds", default="0,1", help="seeds per layer (comma list; default 0,1)")
    pl_.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_recipe_args(pl_)
    pl_.set_defaults(func=run_placement, arch="hybrid", seed=0, attn_layers=None)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _add_recipe_args(t: argparse.ArgumentParser) -> None:
    """The training recipe's options, shared by `toy train` and `toy placement`."""
    t.add_argument("--task", default="mc", help="mc or kv (default mc)")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--save-every", type=int, default=None, help="write DIR/checkpoints/step-N every K steps")
    t.add_argument("--save-at", default="", help="also checkpoint at these steps (comma list)")
    t.add_argument("--task-option", action="append", default=[], metavar="K=V",
                   help="task generator option (repeatable), e.g. option_words=2")
    t.add_argument("--curriculum-steps", type=int, default=0,
                   help="mc: start with questions about 1 subject, double the subjects every N steps (0: off)")
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4, help="attention heads per attention layer")
    t.add_argument("--width", type=int, default=128)
    t.add_argument("--mlp-ratio", type=int, default=2, help="MLP width as a multiple of --width (0: attention-only layers)")
    t.add_argument("--ssm-heads", type=int, default=8, help="Mamba-2 heads per SSM layer")
    t.add_argument("--ssm-state", type=int, default=32)
    t.add_argument("--conv-kernel", type=int, default=4, help="Mamba-2 convolution width (default 4, Mamba's own)")
    t.add_argument("--ssm-init", default=TrainConfig.ssm_init, choices=SSM_INITS,
                   help="hybrid: start the Mamba-2 mixers as the Mamba-2 toy's (dt 0.001-0.1; default) or with "
                   "Bamba's init (dt 1.31: short memory; hybrids trained before this option existed)")
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--decay-steps", type=int, default=0, help="lower the lr linearly to 0 over the last N steps")
    t.add_argument("--induction-weight", type=float, default=0.0,
                   help="add this times a next-token loss on repeated random sequences (grows copy heads; 0 = off)")
    t.add_argument("--induction-length", type=int, default=16, help="length of each random sequence before it repeats")
    t.add_argument("--induction-steps", type=int, default=0,
                   help="add the induction loss in the first N steps only (0: every step)")
    t.add_argument("--knowledge-weight", type=float, default=0.0,
                   help="mc: add this times a next-token loss on facts such as ' apple is fruit.' (0 = off)")
    t.add_argument("--knowledge-facts", type=int, default=8, help="facts per knowledge sequence")
    t.add_argument("--init-std", type=float, default=0.1)
    t.add_argument("--vocab-size", type=int, default=600)
    t.add_argument("--train-size", type=int, default=20000, help="prompts in the training pool")
    t.add_argument("--test-size", type=int, default=256, help="held-out test prompts (disjoint words)")
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--time-budget", type=float, default=None, help="stop training after this many seconds")
    t.add_argument("--threads", type=int, default=1, help="torch threads (fixed for bit-identical runs; 1 is fastest on a shared CPU)")


def config_from_args(args: argparse.Namespace):
    """A validated TrainConfig from parsed arguments (one-line GascanError on bad input)."""
    from discovery.tasks.definition import parse_task_options  # imports torch: not at parser time

    cfg = TrainConfig(
        arch=args.arch, task=args.task, seed=args.seed, steps=args.steps, batch_size=args.batch_size,
        lr=args.lr, weight_decay=args.weight_decay, decay_steps=args.decay_steps, init_std=args.init_std, layers=args.layers,
        heads=args.heads, width=args.width, mlp_ratio=args.mlp_ratio, ssm_heads=args.ssm_heads,
        ssm_state=args.ssm_state, conv_kernel=args.conv_kernel, ssm_init=args.ssm_init,
        attn_layers=None if args.attn_layers is None else _int_list(args.attn_layers, "--attn-layers"),
        task_options=parse_task_options(args.task_option),
        curriculum_steps=args.curriculum_steps, induction_weight=args.induction_weight,
        induction_length=args.induction_length, induction_steps=args.induction_steps,
        knowledge_weight=args.knowledge_weight, knowledge_facts=args.knowledge_facts,
        vocab_size=args.vocab_size, train_size=args.train_size,
        test_size=args.test_size, eval_every=args.eval_every, save_every=args.save_every,
        save_at=_int_list(args.save_at, "--save-at"), time_budget=args.time_budget, threads=args.threads,
    )
    return cfg.validate()


def run_train(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    from discovery.toy.data import check_task_options
    from discovery.toy.trainer import prepare_out_dir, train

    check_task_options(cfg.task, cfg.task_options)
    prepare_out_dir(args.out, args.overwrite)  # fail on an unwritable --out before building data
    result = train(cfg, args.out, progress=not args.quiet, overwrite=True)
    print(f"saved {result.out_dir}: test accuracy {result.test_accuracy:.3f} after {result.steps} steps "
          f"({result.train_seconds:.0f} s training, {len(result.checkpoints)} checkpoints)")
    return 0


def run_placement(args: argparse.Namespace) -> int:
    """``gascan toy placement``: train hybrids with attention at each layer and compare (placement_check)."""
    from discovery.toy.placement_check import check_placement, placement_markdown

    cfg = config_from_args(args)
    layers = None if args.try_layers is None else _int_list(args.try_layers, "--try-layers")
    seeds = _int_list(args.seeds, "--seeds")
    table = check_placement(args.scan, cfg, args.out, layers=layers, seeds=seeds,
                            progress=None if args.quiet else print, show_bars=not args.quiet)
    print(placement_markdown(table), end="")
    print(f"wrote {args.out / 'placement_check.json'} and {args.out / 'placement_check.md'}")
    return 0


def run_truth(args: argparse.Namespace) -> int:
    """``gascan toy truth``: ground truth by exhaustive single-head ablation (see discovery.truth)."""
    from pathlib import Path

    from pipelines import validate

    validate.prompts(args.prompts)
    validate.out_file(args.out)
    validate.model(args.model)
    from rich.console import Console

    from discovery.io import write_json
    from discovery.model.loading import load_model
    from discovery.rank.truth import ground_truth
    from discovery.tasks import build_task
    from discovery.tasks.base import annotate
    from discovery.toy import trained_task_options

    console = Console(stderr=True, emoji=False)
    lm = load_model(args.model)
    defaults = trained_task_options(lm.files) or {"mc": {}}
    task, options = next(iter(defaults.items()))
    prompts = build_task(task, {**options, "n": args.prompts, "seed": args.seed}).prompts()
    batch = annotate(prompts, lm.tokenizer, padding_side="left")
    if args.channels:
        return _channel_truth(args, lm, batch, task, options, console)
    from pipelines.progress import reporter, stage

    with reporter(console) as progress, stage(progress, f"ablating every head of {lm.name} on {task} "
                                                        f"({len(batch)} prompts)"):
        truth = ground_truth(lm, batch)
    truth.update({"model": lm.name, "task": task, "task_options": options, "checkpoint": lm.checkpoint_hash()})
    target = Path(args.out) if args.out else Path(lm.files[0]).parent / "truth.json"
    write_json(target, truth)
    console.print(truth_summary(truth))
    console.print(f"wrote {target}")
    return 0


def _channel_truth(args: argparse.Namespace, lm, batch, task: str, options: dict, console) -> int:
    """``gascan toy truth --channels``: :func:`discovery.rank.truth.channel_truth` -> truth_channels.json."""
    from pathlib import Path

    from discovery.errors import GascanError
    from discovery.io import write_json
    from discovery.rank.truth import channel_truth

    if not any(g.pattern == "mamba1" for g in lm.inventory.groups):
        raise GascanError(f"{lm.name} has no Mamba-1 layers", "drop --channels (it is for Mamba-1 models)")
    scopes = tuple(s.strip() for s in args.scopes.split(",") if s.strip())
    if not scopes or set(scopes) - {"all", "query"}:
        raise GascanError(f"--scopes {args.scopes!r} is not a comma list of all, query", "pass e.g. --scopes all")
    with console.status(f"ablating every channel of {lm.name} on {task} ({len(batch)} prompts)"):
        truth = channel_truth(lm, batch, scopes=scopes)
    truth.update({"model": lm.name, "task": task, "task_options": options, "checkpoint": lm.checkpoint_hash(),
                  "seed": args.seed})
    target = Path(args.out) if args.out else Path(lm.files[0]).parent / "truth_channels.json"
    write_json(target, truth)
    top = ", ".join(f"L{r['layer']}C{r['channel']} ({r['drop']:+.2f})" for r in truth["important"][:12])
    console.print(f"clean accuracy {truth['clean']['acc']:.3f}, logit diff {truth['clean']['logit_diff']:.3f}; "
                  f"{len(truth['important'])} of {truth['n_channels']} channels drop it by >= "
                  f"{truth['effect']:.0%}: {top or 'none'}; {truth['forward_equivalents']:.1f} forward-equivalents")
    console.print(f"wrote {target}")
    return 0


def truth_summary(truth: dict) -> str:
    """The labels of a ``truth.json`` in a few readable lines."""
    from discovery.report import fmt, head_name

    def name(d: dict) -> str:
        return head_name(d["layer"], d["head"], d.get("kind", "attn"))

    clean = truth["clean"]
    pairs = [f"{name(p['gather'])}->{name(p['aggregate'])} (selection {p['selection_clean']:.2f} -> "
             f"{p['selection_without_gather']:.2f}, mediated {fmt(p.get('mediated'), 2)}"
             + (f", through the set {fmt(p['set_mediated'], 2)})" if p.get("set_mediated") is not None else ")")
             for p in truth["pairs"] if p["confirmed"]]
    lines = [f"clean accuracy {clean['acc']:.3f}, logit diff {clean['logit_diff']:.3f}",
             f"gather: {', '.join(map(name, truth['gather'])) or 'none'}",
             f"aggregate: {', '.join(map(name, truth['aggregate'])) or 'none'}",
             f"confirmed pairs: {', '.join(pairs) or 'none'}"]
    for j in truth.get("joint_mediation") or []:
        lines.append(f"{name(j['gather'])}'s cost flowing through all later aggregate heads together: "
                     f"{fmt(j['mediated'], 2)} ({j['effect_gather']:+.2f} -> {j['effect_gather_with_aggregates_held']:+.2f} "
                     f"with {', '.join(map(name, j['aggregates']))} held)")
        if j.get("set_mediated") is not None:
            lines.append(f"{name(j['gather'])}'s cost flowing through the later members of the redundant aggregate "
                         f"set ({', '.join(map(name, j['set']))}): {fmt(j['set_mediated'], 2)}")
    group = truth.get("aggregate_set")
    if group:
        lines.append(f"redundant aggregate set {', '.join(map(name, group['heads']))}: joint query ablation "
                     f"{group['d_ld_query_joint']:+.2f} logit diff ({'breaks' if group['breaks_task'] else 'does not break'} the task)")
    # heads that break the task without a G&A label: where their effect lives and where they read
    for r in sorted((r for r in truth["heads"] if r["role"] == "other_important"), key=lambda r: r["d_ld_all"]):
        lines.append(f"other head that breaks the task {name(r)}: logit diff {r['d_ld_all']:+.2f} "
                     f"(query {r['d_ld_query']:+.2f}, segments {r['d_ld_segment']:+.2f}); gather_score "
                     f"{fmt(r.get('gather_score'), 2)}, gather_cross {fmt(r.get('gather_cross'), 2)}, "
                     f"agg_select {fmt(r.get('agg_select'), 2)}, agg_after {fmt(r.get('agg_after'), 2)}")
    for role, m in (truth.get("pattern_margin") or {}).items():
        if m:
            other = "none" if m["strongest_other"] is None else f"{m['strongest_other']:.3f}"
            lines.append(f"{role} margin on {m['metric']}: weakest {role} {m['weakest_labelled']:.3f}, "
                         f"strongest other head that matters {other}")
    return "\n".join(lines)
