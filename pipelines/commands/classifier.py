"""``gascan classifier {train,eval,planted,show}``: the head classifier behind P(gather) and P(aggregate)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from discovery.errors import GascanError


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("classifier", help="train, evaluate or inspect the head classifier",
                            description="The classifier that turns a head's metrics and effects into "
                            "P(gather) and P(aggregate).")
    actions = parser.add_subparsers(dest="classifier_command", metavar="ACTION")

    t = actions.add_parser("train", help="fit a classifier on labelled head tables",
                           description="Fit on head tables (heads.parquet files or scan directories). Labels: "
                           "--labels files (JSON list of {model or checkpoint, layer, head, kind, role}, or a "
                           "truth.json); without --labels, each scan's truth.json. The published heads "
                           "(Bick et al.) are added whenever a table is of one of those checkpoints.")
    _tables_and_labels(t)
    t.add_argument("--out", default="classifier.json", help="where to write the JSON artifact (default ./classifier.json)")
    t.add_argument("--C", type=float, default=1.0, dest="c", help="inverse L2 regularisation strength (default 1)")
    t.add_argument("--save-table", default=None, metavar="PARQUET", help="also write the labelled training rows")
    t.add_argument("--provenance", default=None, metavar="TEXT",
                   help="how the tables were made (commands), stored in the artifact's meta as 'data'")
    t.set_defaults(func=run_train)

    e = actions.add_parser("eval", help="leave-one-model-out precision and recall per role",
                           description="Train on every labelled model but one and score the held-out one, for "
                           "each model. With no tables: the training rows shipped with gascan.")
    _tables_and_labels(e, required=False)
    e.add_argument("--C", type=float, default=1.0, dest="c", help="inverse L2 regularisation strength (default 1)")
    e.add_argument("--threshold", type=float, default=0.5, help="probability counted as a positive (default 0.5)")
    e.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    e.set_defaults(func=run_eval)

    p = actions.add_parser("planted", help="scan the planted-circuit variants (labelled training data)",
                           description="Build every planted G&A circuit variant, scan it, rank its pairs and "
                           "write OUT/<name>/{heads.parquet,summary.json,pairs.parquet,truth.json}.")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--prompts", type=int, default=32)
    p.set_defaults(func=run_planted)

    s = actions.add_parser("show", help="print a classifier artifact's features, weights and provenance")
    s.add_argument("path", nargs="?", default=None, help="a classifier JSON (default: the shipped one)")
    s.set_defaults(func=run_show)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _tables_and_labels(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("tables", nargs="+" if required else "*", metavar="HEADS",
                        help="heads.parquet files or scan directories")
    parser.add_argument("--labels", action="append", default=[], metavar="L",
                        help="labels JSON or truth.json (repeatable)")
    parser.add_argument("--no-published", action="store_true", help="do not add the published heads' labels")


def _check_inputs(args: argparse.Namespace) -> None:
    """Tables and label files readable, before polars and the classifier are imported."""
    from pipelines import validate

    validate.head_tables(args.tables)
    for path in args.labels:
        validate.json_file(path, "labels file")


def _labelled(args: argparse.Namespace):
    from discovery.rank.classifier import label_rows, load_tables, published_labels, read_labels
    from pipelines import validate
    from pipelines.classifier_data import labels_for_dirs, labels_from_truth

    frame = load_tables(args.tables)
    labels: list[dict] = []
    for path in args.labels:
        data = validate.json_file(path, "labels file")
        if isinstance(data, dict) and ("gather" in data or "aggregate" in data) and "labels" not in data:
            labels += labels_from_truth(path)
        else:
            labels += read_labels(path)
    if not args.labels:
        dirs = [t if Path(t).is_dir() else str(Path(t).parent) for t in args.tables]
        labels += labels_for_dirs(dirs)
    if not args.no_published:
        labels += published_labels()
    labelled = label_rows(frame, labels)
    if labelled.height == 0:
        raise GascanError("none of the labels matches a model in the given tables",
                          "check the labels' model names / checkpoint hashes against summary.json")
    return labelled


def run_train(args: argparse.Namespace) -> int:
    from pipelines import validate

    _check_inputs(args)
    validate.out_file(args.out)
    validate.out_file(args.save_table, "--save-table")
    from discovery.rank.classifier import leave_one_model_out, save_classifier, train_classifier

    labelled = _labelled(args)
    lomo = leave_one_model_out(labelled, c=args.c) if labelled.select("model", "checkpoint").n_unique() > 1 else None
    meta = {"trained_on": sorted({str(m) for m in labelled["model"].unique().to_list()})}
    if args.provenance:
        meta["data"] = args.provenance
    if lomo is not None:
        meta["leave_one_model_out"] = _lomo_summary(lomo)
    clf = train_classifier(labelled, c=args.c, meta=meta)
    path = save_classifier(clf, args.out)
    if args.save_table:
        from discovery.io import write_parquet

        write_parquet(args.save_table, labelled)
    print(f"trained on {clf.meta['n_rows']} heads of {clf.meta['n_models']} models "
          f"({clf.meta['n_gather']} gather, {clf.meta['n_aggregate']} aggregate); wrote {path}")
    if lomo is not None:
        _print_lomo(lomo)
    return 0


def _lomo_summary(lomo) -> dict:
    import polars as pl

    out = {"models": lomo.height}
    for role in ("gather", "aggregate"):
        out[f"{role}_precision"] = lomo[f"{role}_precision"].mean()
        out[f"{role}_recall"] = lomo[f"{role}_recall"].mean()
        out[f"{role}_top1"] = float((lomo[f"{role}_best_rank"] == 1).mean() or 0.0)  # models without the role: null
        out[f"{role}_false_positives"] = int(lomo[f"{role}_false_positives"].sum())
    out["pair_in_top3"] = float(lomo.filter(pl.col("pair_in_top3").is_not_null())["pair_in_top3"].mean() or 0.0)
    return out


def _print_lomo(lomo) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="leave-one-model-out (precision and recall at the threshold; rank of the best true head)")
    cols = ["model", "task", "heads", "gather_precision", "gather_recall", "gather_best_rank", "gather_false_positives",
            "aggregate_precision", "aggregate_recall", "aggregate_best_rank", "aggregate_false_positives", "pair_in_top3"]
    short = ["model", "task", "heads", "G prec", "G rec", "G rank", "G FP", "A prec", "A rec", "A rank", "A FP",
             "pair in top 3"]
    for c in short:
        table.add_column(c)
    for r in lomo.iter_rows(named=True):
        table.add_row(*[escape("–" if r[c] is None else f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]))
                        for c in cols])
    console = Console(width=max(120, Console().width), emoji=False, highlight=False)
    console.print(table)
    summary = _lomo_summary(lomo)
    console.print(escape("mean: ") + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in summary.items()))


def run_eval(args: argparse.Namespace) -> int:
    _check_inputs(args)
    from discovery.rank.classifier import leave_one_model_out, shipped_training_rows

    labelled = _labelled(args) if args.tables else shipped_training_rows()
    lomo = leave_one_model_out(labelled, threshold=args.threshold, c=args.c)
    if args.json:
        print(json.dumps(lomo.to_dicts(), indent=1))
    else:
        _print_lomo(lomo)
    return 0


def run_planted(args: argparse.Namespace) -> int:
    from pipelines import validate

    validate.prompts(args.prompts)
    validate.out_dir(args.out, "OUT")
    from pipelines.classifier_data import build_planted_set

    dirs = build_planted_set(args.out, prompts=args.prompts, progress=print)
    print(f"wrote {len(dirs)} planted scans under {args.out}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    if args.path is not None:
        from pipelines import validate

        validate.json_file(args.path, "classifier file")
    from discovery.rank.classifier import load_classifier

    clf = load_classifier(args.path)
    print(json.dumps({"version": clf.version, "meta": clf.meta}, indent=1))
    width = max(len(f) for f in clf.features)
    print(f"{'feature':<{width}}  {'gather':>8}  {'aggregate':>9}")
    for i, f in enumerate(clf.features):
        print(f"{f:<{width}}  {clf.coef['gather'][i]:>8.3f}  {clf.coef['aggregate'][i]:>9.3f}")
    return 0
