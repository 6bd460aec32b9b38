"""``gascan inspect MODEL [--json]``: architecture, layers and the heads of every layer."""
from __future__ import annotations

import argparse
import json

from pipelines.commands.common import add_model_arguments, load_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("inspect", help="list a model's layers and heads",
                            description="Print a model's head inventory: kinds, counts and widths per layer.")
    add_model_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the stable JSON form")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pipelines import validate

    validate.model(args.model, dtype=args.dtype, device_name=args.device, allow_pickle=args.allow_pickle,
                   trust_remote_code=args.trust_remote_code)
    validate.device_available(args.device)
    lm = load_from_args(args)
    inv = lm.inventory
    if args.json:
        print(json.dumps(inv.as_json(), indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"{escape(lm.name)} — {inv.architecture}, {inv.n_layers} layers")
    table.add_column("layer", justify="right")
    table.add_column("kinds")
    table.add_column("attn heads", justify="right")
    table.add_column("ssm heads", justify="right")
    table.add_column("width (attn/ssm)")
    for layer in inv.as_json()["layers"]:
        widths = "/".join(str(layer["widths"].get(k, "-")) for k in ("attn", "ssm"))
        table.add_row(str(layer["index"]), ",".join(layer["kinds"]), str(layer["heads"]["attn"]),
                      str(layer["heads"]["ssm"]), widths)
    totals = inv.n_heads()
    table.add_row("total", "", str(totals["attn"]), str(totals["ssm"]), "", style="bold")
    Console(emoji=False).print(table)
    return 0
